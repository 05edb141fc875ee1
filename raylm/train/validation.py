"""Fixed held-out batches and their loss: the validation loss the loop reports (`val_loss`,
`val_bpb`), and the stability guard's canary; and downstream task scores (`train.eval_tasks`)."""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from raylm.data.stream import TokenStream
from raylm.data.tokenizer import bits_per_byte, token_byte_lengths, tokenizer_from_json
from raylm.downstream.scoring import Scorer
from raylm.train.spec import RunSpec
from raylm.train.step import ParallelModel

VAL_SEED = 0  # the validation rows' order: the same for every data.seed


class ValidationSet:
    """`batches` global batches of `global_batch` rows of the val split, the same for every
    evaluation and every world size: chunks of `data.chunk_rows` rows drawn across the whole split
    by a fixed seed (not `data.seed`: every seed of a run sees the same tokens), so that they stand
    for the split rather than its first file; or, `across_split=False`, its first rows in file
    order (the stability guard's canary, on which its thresholds were measured).

    Bits per byte compare runs with different tokenizers: the mean loss in nats over every
    target, times the targets, over ln 2 times the UTF-8 bytes those targets stand for (end of
    text stands for none; `raylm eval` also leaves its loss out, so it reads slightly lower)."""

    def __init__(self, spec: RunSpec, model: ParallelModel, global_batch: int, batches: int,
                 across_split: bool = True):
        cfg = spec.config
        source = spec.datasets.open_split("val", dataclasses.replace(cfg.data, seed=VAL_SEED), cfg.storage,
                                          shuffle=across_split)
        stream = TokenStream(source, global_batch, model.dp_rank, model.dp_size, skip=[], engine="local")
        self.batches = [torch.from_numpy(b.tokens.astype(np.int64)) for b in stream.batches(0, 0, batches)]
        token_bytes = token_byte_lengths(tokenizer_from_json(spec.tokenizer_json))
        whole = TokenStream(source, global_batch, 0, 1, skip=[], engine="local")  # every rank's rows
        targets = [b.tokens[:, 1:] for b in whole.batches(0, 0, batches)]
        n_bytes = sum(int(token_bytes[t].sum()) for t in targets)
        self.targets_per_byte = sum(t.size for t in targets) / n_bytes if n_bytes else None

    def bits_per_byte(self, loss: float) -> Optional[float]:
        return bits_per_byte(loss, 1 / self.targets_per_byte) if self.targets_per_byte else None

    def loss(self, model: ParallelModel, micro_batch_size: int) -> float:
        model.train(False)
        try:
            device = model.world.device
            losses = [model.eval_loss(b.to(device), micro_batch_size) for b in self.batches]
            return float(torch.stack(losses).mean())  # reported: the one host sync of an evaluation
        finally:
            model.train(True)


def unigram_loss(spec: RunSpec, tokens: int = 65536) -> Optional[float]:
    """The loss of the best model that knows only token frequencies (their entropy), over about
    `tokens` tokens of the val split drawn across it by the fixed seed, the same on every rank: a
    model at this level has learned nothing else (a diverged run climbs back to it). Drawn
    across the split, not from the canary's rows in file order, which may be one document of
    an odd kind (a table: half the entropy of the text around it)."""
    cfg = spec.config
    source = spec.datasets.open_split("val", dataclasses.replace(cfg.data, seed=VAL_SEED), cfg.storage)
    stream = TokenStream(source, spec.global_batch, 0, 1, skip=[], engine="local")
    batches = max(1, -(-tokens // (spec.global_batch * spec.seq_len)))
    counts = sum(np.bincount(b.tokens[:, 1:].ravel(), minlength=cfg.model.vocab_size)
                 for b in stream.batches(0, 0, batches))
    p = counts[counts > 0] / counts.sum() if np.sum(counts) else np.array([])
    return float(-(p * np.log(p)).sum()) if len(p) else None


class TaskScores:
    """lm-evaluation-harness tasks (`train.eval_tasks`) on the model being trained, as `raylm eval
    --tasks` scores a checkpoint. Every rank runs the same requests in the same order (lm-eval
    seeds its own choices of documents and examples), each forward through its share of the
    model: FSDP's gathers and TP's collectives see every rank, and every rank gets the scores."""

    def __init__(self, spec: RunSpec, model: ParallelModel):
        from raylm.downstream import harness  # lm_eval: only in runs that score tasks

        cfg = spec.config
        self.settings, self.model, self.harness = cfg.train.eval_tasks, model, harness
        self.manager = harness.task_manager(self.settings.tasks, self.settings.include_path,
                                            "train.eval_tasks.tasks")
        (part,) = model.parts  # config checks refuse pipeline stages
        device = model.world.device

        def logits(ids: torch.Tensor) -> torch.Tensor:
            with model.autocast():
                out = part(ids.to(device))
            return out.full_tensor() if isinstance(out, DTensor) else out  # loss_parallel: sharded by vocabulary

        tokenizer = tokenizer_from_json(spec.tokenizer_json)
        scorer = Scorer(logits, tokenizer, cfg.model.max_seq_len, self.settings.batch_size)
        self.lm = harness.RaylmLM(tokenizer, cfg.model.max_seq_len,
                                  lambda method, requests: getattr(scorer, method)(requests))

    def scores(self, step: int) -> dict[str, float]:
        """`task/metric` -> value (see `raylm.downstream.harness.scores`), printed by rank 0."""
        model, settings = self.model, self.settings
        device = model.world.device
        model.train(False)
        # lm-eval seeds Python's, NumPy's and torch's generators: the run's own draws (dropout)
        # go on after it as they would have without it, so a resumed run repeats its losses.
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                results = self.harness.run_tasks(self.lm, settings.tasks, self.manager, settings.limit,
                                                 settings.num_fewshot, bootstrap_iters=0, verbosity="WARNING")
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
            model.reshard()
            model.train(True)
        scores = self.harness.scores(results)
        if model.world.rank == 0:
            listed = " | ".join(f"{name} {value:.4f}" for name, value in scores.items())
            print(f"step {step:>6} | {listed}", flush=True)
        return scores
