"""The training loop: plain torch, callable as a function with a config, hooks around each step.

Ray stays at the edges: `TrainEnv` is how the loop reaches storage and the cluster, and
`raylm.launch` provides the Ray Train one. Sweeps, the CLI and tests all call `train`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import ContextManager, Optional, Protocol

import numpy as np
import torch
import torch.distributed as dist

from raylm.config import Config, config_to_yaml, global_batch_sequences
from raylm.data.manifest import load_dataset_tokenizer
from raylm.data.stream import TokenStream, open_split
from raylm.model.sizes import flops_per_token
from raylm.model.transformer import Transformer
from raylm.parallel.runtime import ParallelModel, World, build_parallel_model
from raylm.train import checkpoint
from raylm.train.hooks import Hook
from raylm.train.metrics import MetricsLogger, peak_flops
from raylm.train.optim import apply_lr, build_optimizer, lr_at
from raylm.train.resolve import resolve_for_data


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    position: int = 0  # global index of the next sample to train on
    tokens_seen: int = 0


class TrainEnv(Protocol):
    """Where the loop meets storage and the cluster (Ray Train, or plain files in tests)."""

    run_dir: str  # local directory for metrics.jsonl and TensorBoard (rank 0 writes)

    def device(self) -> torch.device:
        """The device this rank trains on."""

    checkpoint_root: str  # where published checkpoints live (local path or s3:// URI)

    def restore_dir(self) -> ContextManager[Optional[str]]:
        """A local directory holding the checkpoint to resume from, or None."""

    def staging_dir(self, step: int) -> ContextManager[str]:
        """A local directory for this rank's part of the checkpoint of `step`."""

    def publish(self, step: int, directory: str, metrics: dict) -> str:
        """Make the staged checkpoint (every rank's part) durable; returns its URI."""

    def report(self, metrics: dict) -> None:
        """Progress for the cluster's bookkeeping (not every step: it may block)."""


@dataclass
class Run:
    """The live objects of a run, handed to hooks."""

    cfg: Config
    world: World
    model: ParallelModel
    optimizer: torch.optim.Optimizer
    state: TrainState
    seq_len: int
    global_batch: int
    flops_per_token: float
    peak_flops: float  # per device
    history: deque = field(default_factory=lambda: deque(maxlen=1000))  # recent steps' metrics, for hooks


class _EvalSet:
    """Fixed held-out batches: the first `eval_batches` global batches of the val split, in
    file order, so every evaluation and every world size sees the same tokens."""

    def __init__(self, cfg: Config, model: ParallelModel, global_batch: int):
        source, _ = open_split(cfg.data, "val", cfg.storage, shuffle=False)
        stream = TokenStream(source, global_batch, model.dp_rank, model.dp_size, skip=[], engine="local")
        self.batches = [torch.from_numpy(b.tokens.astype(np.int64))
                        for b in stream.batches(0, 0, cfg.train.eval_batches)]

    def loss(self, model: ParallelModel, micro_batch_size: int) -> float:
        model.train(False)
        try:
            device = model.world.device
            losses = [model.eval_loss(b.to(device), micro_batch_size) for b in self.batches]
            return float(torch.stack(losses).mean())
        finally:
            model.train(True)


def train(cfg: Config, env: TrainEnv, hooks: tuple[Hook, ...] = ()) -> dict:
    """Train per `cfg` on this process's rank; returns the last step's metrics."""
    world = World.current(env.device())
    source, manifests = open_split(cfg.data, "train", cfg.storage)
    cfg = resolve_for_data(cfg, manifests[0])
    seq_len = manifests[0].seq_len
    global_batch = global_batch_sequences(cfg, seq_len)

    model = build_parallel_model(lambda: Transformer(cfg.model), cfg, world)
    optimizer = build_optimizer(model.parts, cfg.optim)
    state = TrainState()
    with env.restore_dir() as restore:
        if restore is not None:
            saved = checkpoint.load(restore, model, optimizer, world, manifests[0].tokenizer.sha256)
            state = TrainState(saved["step"], saved["position"], saved["tokens_seen"])

    local_batch = global_batch // model.dp_size
    if global_batch % model.dp_size or local_batch % cfg.train.micro_batch_size:
        raise ValueError(
            f"global batch {global_batch} must split into {model.dp_size} data-parallel ranks × "
            f"whole micro-batches of train.micro_batch_size={cfg.train.micro_batch_size}")
    stream = TokenStream(source, global_batch, model.dp_rank, model.dp_size, cfg.data.skip,
                         engine=cfg.data.loader, prefetch=cfg.data.prefetch_chunks)
    evals = _EvalSet(cfg, model, global_batch) if cfg.train.eval_every > 0 else None
    # What a checkpoint needs besides tensors to be usable on its own (generation, export).
    checkpoint_files = {checkpoint.CONFIG: config_to_yaml(cfg),
                        checkpoint.TOKENIZER: load_dataset_tokenizer(
                            cfg.data.mixture[0].path if cfg.data.mixture else cfg.data.path,
                            cfg.storage, manifests[0]).to_json()}
    checkpointer = checkpoint.Checkpointer(cfg, env, model, optimizer, world, checkpoint_files)

    run = Run(cfg, world, model, optimizer, state, seq_len, global_batch,
              flops_per_token(cfg.model, seq_len), peak_flops(world.device, cfg.train.peak_tflops))
    logger = MetricsLogger(cfg, env.run_dir, world)
    hooks = (*hooks, logger)  # last: it writes out what the other hooks added
    for hook in hooks:
        hook.on_train_start(run)

    try:
        metrics = _train_steps(run, env, stream, hooks, checkpointer, evals, manifests[0].tokenizer.sha256)
        for hook in hooks:
            hook.on_train_end(run, metrics)
    finally:
        logger.close()
    return metrics


def _train_steps(run: Run, env: TrainEnv, stream: TokenStream, hooks: tuple, checkpointer: checkpoint.Checkpointer,
                 evals: Optional[_EvalSet], tokenizer_sha256: str) -> dict:
    """The steps from the run's current state to its last step; returns the last metrics."""
    cfg, world, model, optimizer, state = run.cfg, run.world, run.model, run.optimizer, run.state
    seq_len, global_batch = run.seq_len, run.global_batch
    steps = cfg.train.steps
    last = min(steps, cfg.train.stop_at_step or steps)
    metrics: dict = {}
    # Seconds the loop was blocked by checkpointing since the last step's metrics: a save (sync:
    # the whole write; async: staging) and publishing a finished async save.
    checkpoint_s = 0.0
    last_report = time.monotonic()
    t0 = time.perf_counter()
    batches = stream.batches(state.position, state.step, last)
    while True:
        if state.step in (10, 100) and world.device.type == "cpu" and not cfg.train.peak_tflops:
            # A CPU's peak is measured; the first time, at start-up, Ray was still starting
            # processes on the same cores. Keep the best figure, and keep it out of step time.
            measure_start = time.perf_counter()
            run.peak_flops = max(run.peak_flops, peak_flops(world.device))
            t0 += time.perf_counter() - measure_start
        wait_start = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            break
        data_wait = time.perf_counter() - wait_start
        poll_start = time.perf_counter()
        checkpointer.poll()
        checkpoint_s += time.perf_counter() - poll_start
        step = batch.step
        for hook in hooks:
            hook.on_step_begin(run, step)
        lr = lr_at(step, cfg.schedule, cfg.optim.lr, steps)
        apply_lr(optimizer, lr)
        tokens = torch.from_numpy(batch.tokens.astype(np.int64)).to(world.device)
        loss = float(model.forward_backward(tokens, cfg.train.micro_batch_size))
        grad_norm = float(model.clip_grad_norm(cfg.optim.grad_clip))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            # Nothing is lost: the optimizer has not stepped, the last checkpoint stands.
            raise FloatingPointError(
                f"step {step}: loss {loss} / grad norm {grad_norm} is not finite; the weights were "
                f"not updated. Samples of this step: global positions [{state.position}, "
                f"{batch.next_position}); skip them with data.skip or lower optim.lr and resume.")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        state.step = step + 1
        state.position = batch.next_position
        state.tokens_seen += global_batch * seq_len
        now = time.perf_counter()
        tokens_per_s = global_batch * seq_len / (now - t0)
        # position: where the next step's samples start, so an audit of metrics.jsonl alone
        # can tell which samples each committed step trained on (resume, resize, skip).
        metrics = {"step": state.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                   "position": state.position, "tokens": state.tokens_seen, "step_time": now - t0,
                   "data_wait": data_wait, "checkpoint_s": checkpoint_s, "tokens_per_s": tokens_per_s,
                   "mfu": run.flops_per_token * tokens_per_s / (run.peak_flops * world.world_size)}
        t0, checkpoint_s = now, 0.0
        if cfg.train.audit_samples:
            metrics["samples"] = _samples_of_step(model, batch.indices)
        if evals is not None and (state.step == last or state.step % cfg.train.eval_every == 0):
            metrics["val_loss"] = evals.loss(model, cfg.train.micro_batch_size)
            t0 = time.perf_counter()  # evaluation is not step time
        for hook in hooks:
            hook.on_step_end(run, step, metrics)
        run.history.append(metrics)

        if checkpointer.due(state.step, last):
            save_start = time.perf_counter()
            checkpointer.save(state.step, {**vars(state), "tokenizer_sha256": tokenizer_sha256},
                              metrics)
            t0 = time.perf_counter()
            checkpoint_s = t0 - save_start  # outside step_time: reported with the next step
            last_report = time.monotonic()
        elif cfg.train.report_every_s > 0 and world.agree(
                time.monotonic() - last_report >= cfg.train.report_every_s, "rank0"):
            env.report(metrics)
            last_report = time.monotonic()
        if checkpointer.failing_since is not None and world.rank == 0:
            print(f"WARNING: no checkpoint has been written since step {checkpointer.failing_since}: "
                  "this run is not protected against failures (checkpoint.allow_failures=true)", flush=True)
    checkpointer.wait()
    return metrics


def _samples_of_step(model: ParallelModel, indices: list[int]) -> list[int]:
    """The global sample indices the whole step trained on. Ranks of one data-parallel rank's
    tensor/pipeline group hold the same rows, so each dp rank's rows count once."""
    if not dist.is_initialized():
        return sorted(indices)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (model.dp_rank, indices))
    return sorted(i for rows in dict(gathered).values() for i in rows)
