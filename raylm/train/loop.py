"""The training loop: plain torch, callable as a function with a config, hooks around each step.

Ray stays at the edges: `TrainEnv` is how the loop reaches storage and the cluster, and
`raylm.launch` provides the Ray Train one. Sweeps, the CLI and tests all call `train`.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from raylm.config import CONFIG_FILE, Config, config_to_yaml
from raylm.data.stream import TokenStream
from raylm.model.sizes import flops_per_token
from raylm.model.transformer import Transformer
from raylm.parallel.world import World
from raylm.tokenizer import TOKENIZER_FILE, bits_per_byte, token_byte_lengths, tokenizer_from_json
from raylm.train import checkpoint
from raylm.train.checkpointer import Checkpointer
from raylm.train.guard import Guard
from raylm.train.guard_stop import refuse_guard_stopped
from raylm.train.resume_check import check_resume, record_config_change
from raylm.train.hooks import Hook
from raylm.train.metrics import MetricsLogger, peak_flops
from raylm.train.records import EVENTS_FILE
from raylm.train.norms import NormsProbe
from raylm.train.optim import apply_lr, build_optimizer, lr_at
from raylm.train.spec import RunSpec, resolve_run
from raylm.train.state import Run, TrainEnv, TrainState
from raylm.train.step import LossScaler, ParallelModel, build_model, needs_loss_scaling


class _EvalSet:
    """Fixed held-out batches: the first `eval_batches` global batches of the val split, in
    file order, so every evaluation and every world size sees the same tokens.

    Bits per byte compare runs with different tokenizers: the mean loss in nats over every
    target, times the targets, over ln 2 times the UTF-8 bytes those targets stand for (end of
    text stands for none; `raylm eval` also leaves its loss out, so it reads slightly lower)."""

    def __init__(self, spec: RunSpec, model: ParallelModel):
        cfg = spec.config
        source = spec.datasets.open_split("val", cfg.data, cfg.storage, shuffle=False)
        stream = TokenStream(source, spec.global_batch, model.dp_rank, model.dp_size, skip=[], engine="local")
        self.batches = [torch.from_numpy(b.tokens.astype(np.int64))
                        for b in stream.batches(0, 0, cfg.train.eval_batches)]
        token_bytes = token_byte_lengths(tokenizer_from_json(spec.tokenizer_json))
        whole = TokenStream(source, spec.global_batch, 0, 1, skip=[], engine="local")  # every rank's rows
        targets = [b.tokens[:, 1:] for b in whole.batches(0, 0, cfg.train.eval_batches)]
        n_bytes = sum(int(token_bytes[t].sum()) for t in targets)
        self.targets_per_byte = sum(t.size for t in targets) / n_bytes if n_bytes else None

    def bits_per_byte(self, loss: float) -> Optional[float]:
        return bits_per_byte(loss, 1 / self.targets_per_byte) if self.targets_per_byte else None

    def loss(self, model: ParallelModel, micro_batch_size: int) -> float:
        model.train(False)
        try:
            device = model.world.device
            losses = [model.eval_loss(b.to(device), micro_batch_size) for b in self.batches]
            return float(torch.stack(losses).mean())
        finally:
            model.train(True)


def train(run: Union[RunSpec, Config], env: TrainEnv, hooks: tuple[Hook, ...] = ()) -> dict:
    """Train on this process's rank; returns the last step's metrics. `run` is a RunSpec
    resolved on the driver, or a Config, resolved here (a single process, tests, sweeps)."""
    spec = run if isinstance(run, RunSpec) else resolve_run(run)
    cfg, seq_len, global_batch = spec.config, spec.seq_len, spec.global_batch
    world = World.current(env.device())
    source = spec.datasets.open_split("train", cfg.data, cfg.storage)

    model = build_model(lambda: Transformer(cfg.model), cfg, world)
    optimizer = build_optimizer(model.parts, cfg.optim)
    state = TrainState()
    with env.restore_dir(cfg.checkpoint.on_unusable == "start_over") as restore:
        if restore is not None:
            changes = check_resume(restore, cfg, spec.tokenizer_sha256)
            saved = checkpoint.load(restore, model, optimizer, world, spec.tokenizer_sha256)
            state = TrainState.from_saved(saved)
            if changes and world.rank == 0:  # an operator's change mid-flight, as OPT's team made them
                record_config_change(env.run_dir, state.step, changes)

    for size in spec.batch_schedule.sizes():
        if size % model.dp_size or (size // model.dp_size) % cfg.train.micro_batch_size:
            raise ValueError(
                f"global batch {size} must split into {model.dp_size} data-parallel ranks × "
                f"whole micro-batches of train.micro_batch_size={cfg.train.micro_batch_size}")
    guard = None
    if cfg.guard.enabled:
        refuse_guard_stopped(env.checkpoint_root, cfg)
        guard = Guard(cfg, model, optimizer, world, os.path.join(env.run_dir, EVENTS_FILE), env.checkpoint_root)
        guard.start(state)

    if needs_loss_scaling(cfg):
        state.loss_scale = state.loss_scale or cfg.train.loss_scale_initial
    scaler = LossScaler(state.loss_scale, cfg.train.loss_scale_growth_interval) if state.loss_scale else None

    def stream_from(state: TrainState) -> TokenStream:
        """The run's batches; the guard's skip ranges grow at each rollback."""
        # An auto loader left undecided means no launch onto a cluster decided it: a run in one process.
        return TokenStream(source, spec.batch_schedule, model.dp_rank, model.dp_size, [*cfg.data.skip, *state.skip],
                           engine="ray" if cfg.data.loader == "ray" else "local", prefetch=cfg.data.prefetch_chunks)

    evals = _EvalSet(spec, model) if cfg.train.eval_every > 0 else None
    # What a checkpoint needs besides tensors to be usable on its own (generation, export).
    checkpoint_files = {CONFIG_FILE: config_to_yaml(cfg), TOKENIZER_FILE: spec.tokenizer_json}
    checkpointer = Checkpointer(cfg.checkpoint, cfg.storage, env, model, optimizer, world, checkpoint_files)

    run = Run(cfg, world, model, optimizer, state, seq_len, global_batch,
              flops_per_token(cfg.model, seq_len), peak_flops(world.device, cfg.train.peak_tflops))
    logger = MetricsLogger(cfg, env.run_dir, world)
    probes = (NormsProbe(cfg.guard.norms_every),) if cfg.guard.norms_every else ()
    hooks = (*hooks, *probes, logger)  # the logger last: it writes out what the other hooks added
    for hook in hooks:
        hook.on_train_start(run)

    try:
        metrics = _train_steps(run, env, stream_from, hooks, checkpointer, evals, guard, scaler, spec.tokenizer_sha256)
        for hook in hooks:
            hook.on_train_end(run, metrics)
    finally:
        logger.close()
    return metrics


def _train_steps(run: Run, env: TrainEnv, stream_from: Callable[[TrainState], TokenStream], hooks: tuple,
                 checkpointer: Checkpointer, evals: Optional[_EvalSet], guard: Optional[Guard],
                 scaler: Optional[LossScaler], tokenizer_sha256: str) -> dict:
    """The steps from the run's current state to its last step; returns the last metrics."""
    cfg, world, model, optimizer, state = run.cfg, run.world, run.model, run.optimizer, run.state
    seq_len = run.seq_len
    steps = cfg.train.steps
    last = min(steps, cfg.train.stop_at_step or steps)
    metrics: dict = {}
    # Seconds the loop was blocked by checkpointing since the last step's metrics: a save (sync:
    # the whole write; async: staging) and publishing a finished async save.
    checkpoint_s = 0.0
    last_report = time.monotonic()
    t0 = time.perf_counter()
    batches = stream_from(state).batches(state.position, state.step, last, state.tokens_seen // seq_len)
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
        lr = lr_at(step, cfg.schedule, cfg.optim.lr, steps) * state.lr_scale
        apply_lr(optimizer, lr)
        tokens = torch.from_numpy(batch.tokens.astype(np.int64)).to(world.device)
        if scaler is not None:
            model.loss_scale = scaler.scale = state.loss_scale
        loss = float(model.forward_backward(tokens, cfg.train.micro_batch_size))
        if scaler is not None:
            scaler.unscale(model.parts)
        grad_norm = float(model.clip_grad_norm(cfg.optim.grad_clip))
        verdict = _verdict(step, loss, grad_norm, cfg, guard, scaler)
        if scaler is not None:
            state.loss_scale = scaler.scale
        if verdict == "ok" and not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the guard is off
            # Nothing is lost: the optimizer has not stepped, the last checkpoint stands.
            raise FloatingPointError(
                f"step {step}: loss {loss} / grad norm {grad_norm} is not finite; the weights were "
                f"not updated. Samples of this step: global positions [{state.position}, "
                f"{batch.next_position}); skip them with data.skip or lower optim.lr and resume.")
        if verdict == "rollback":
            optimizer.zero_grad(set_to_none=True)
            for hook in hooks:
                hook.on_step_abandoned(run, step)
            guard.roll_back(step, state, batch.next_position)
            batches.close()
            batches = stream_from(state).batches(state.position, state.step, last, state.tokens_seen // seq_len)
            t0 = time.perf_counter()
            continue
        if verdict == "ok":
            optimizer.step()
        elif verdict == "skip":
            guard.skipped_step(step, [state.position, batch.next_position])
        optimizer.zero_grad(set_to_none=True)

        state.step = step + 1
        state.position = batch.next_position
        state.tokens_seen += batch.global_batch * seq_len
        now = time.perf_counter()
        tokens_per_s = batch.global_batch * seq_len / (now - t0)
        # position: where the next step's samples start, so an audit of metrics.jsonl alone
        # can tell which samples each committed step trained on (resume, resize, skip).
        metrics = {"step": state.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "global_batch": batch.global_batch,
                   "position": state.position, "tokens": state.tokens_seen, "time": time.time(), "step_time": now - t0,
                   "data_wait": data_wait, "checkpoint_s": checkpoint_s, "tokens_per_s": tokens_per_s,
                   "mfu": run.flops_per_token * tokens_per_s / (run.peak_flops * world.world_size)}
        t0, checkpoint_s = now, 0.0
        if scaler is not None:
            metrics["loss_scale"] = scaler.scale
        if guard is not None:
            metrics["skipped_steps"] = guard.skipped
            if verdict == "ok":
                guard.after_healthy_step(state)
        if cfg.train.audit_samples:
            metrics["samples"] = _samples_of_step(model, batch.indices)
        if evals is not None and (state.step == last or state.step % cfg.train.eval_every == 0):
            metrics["val_loss"] = evals.loss(model, cfg.train.micro_batch_size)
            metrics["val_bpb"] = evals.bits_per_byte(metrics["val_loss"])
            t0 = time.perf_counter()  # evaluation is not step time
        for hook in hooks:
            hook.on_step_end(run, step, metrics)
        run.history.append(metrics)

        if checkpointer.due(state.step, last):
            save_start = time.perf_counter()
            if guard is not None:
                guard.save_history(state)
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


def _verdict(step: int, loss: float, grad_norm: float, cfg: Config, guard: Optional[Guard],
             scaler: Optional[LossScaler]) -> str:
    """"ok", "skip", "rollback" (the guard's), or "overflow": an fp16 overflow of the gradients
    (a finite loss), which halves the loss scale and skips the step, unless the scale falls
    below train.loss_scale_min: a divergence, rolled back (or, with the guard off, a stop)."""
    if scaler is not None and math.isfinite(loss) and not math.isfinite(grad_norm):
        scaler.update(overflow=True)
        if scaler.scale >= cfg.train.loss_scale_min:
            return "overflow"
        if guard is None:
            raise FloatingPointError(f"step {step}: the fp16 loss scale fell to {scaler.scale:g}, below "
                                     f"train.loss_scale_min={cfg.train.loss_scale_min:g}: the run diverges")
        return guard.loss_scale_floor(loss, scaler.scale, cfg.train.loss_scale_min)
    verdict = guard.judge(step, loss, grad_norm) if guard is not None else "ok"
    if scaler is not None and verdict == "ok":
        scaler.update(overflow=False)
    return verdict


def _samples_of_step(model: ParallelModel, indices: list[int]) -> list[int]:
    """The global sample indices the whole step trained on. Ranks of one data-parallel rank's
    tensor/pipeline group hold the same rows, so each dp rank's rows count once."""
    if not dist.is_initialized():
        return sorted(indices)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (model.dp_rank, indices))
    return sorted(i for rows in dict(gathered).values() for i in rows)
