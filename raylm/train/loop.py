"""The training loop, in torchtitan's shape: `Trainer.train` owns the schedule, the hooks,
evaluation and checkpoints; `_queue` is one optimizer step; `forward_backward` runs the
micro-batches (`ParallelModel.forward_backward`) and clips the gradients. The batches come from
`BatchFeed` (raylm.train.feed); `GuardedSteps` (raylm.train.guarded) carries out the stability
guard's decisions.

A step is queued on the device whole, its verdict included (`raylm.train.resilience.judge`: the
update a suspect step must not take is withheld there), and the host reads what the steps did
only every `train.read_every` steps or where it needs the model as a step leaves it (`_read`):
a steady step makes no host sync, so the device never waits for the host's bookkeeping.

`TrainEnv` is how the loop reaches storage and the cluster (`raylm.launch.worker` gives it the Ray
Train one, `LocalEnv` plain files); with data.loader=ray the stream starts a reader actor. Workers,
sweeps' trials, benchmarks and tests all run `train` on a `RunSpec` resolved before it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from raylm.config import CONFIG_FILE, Config, config_to_yaml
from raylm.data.stream import Batch
from raylm.data.tokenizer import TOKENIZER_FILE
from raylm.errors import DivergedError
from raylm.model.sizes import flops_per_token
from raylm.model.transformer import Transformer
from raylm.parallel.float8 import after_optimizer_step
from raylm.parallel.world import World
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.integrity import bytes_read
from raylm.train.checkpoint.policy import Checkpointer
from raylm.train.checkpoint.resume import changes_since, record_config_change
from raylm.train.clock import StepClock, Timeline
from raylm.train.env import LocalEnv, TrainEnv
from raylm.train.feed import BatchFeed
from raylm.train.guarded import GuardedSteps
from raylm.train.hooks import Hook, Run
from raylm.train.lease import RunLease
from raylm.train.observe.metrics import MetricsLogger, peak_flops
from raylm.train.observe.norms import NormsProbe
from raylm.train.observe.profile import ProfileHook
from raylm.train.observe.records import EVENTS_FILE
from raylm.train.optim import apply_lr, build_optimizer, lr_at, step_where
from raylm.train.preflight import preflight
from raylm.train.queued import QueuedStep, rng_state, set_rng_state
from raylm.train.resilience.faults import NonFiniteLoss
from raylm.train.resilience import judge
from raylm.train.resilience.decisions import Action
from raylm.train.resilience.guard import skipped_samples
from raylm.train.resilience.judge import Verdict
from raylm.train.resilience.preemption import stop_for_preemption
from raylm.train.spec import RunSpec, resolve_run
from raylm.train.state import TrainState
from raylm.train.step import LossScaler, build_model, needs_loss_scaling
from raylm.train.validation import TaskScores, ValidationSet


def train(spec: RunSpec, env: TrainEnv, hooks: tuple[Hook, ...] = ()) -> dict:
    """Train `spec` on this process's rank; returns the last step's metrics."""
    return Trainer(spec, env, hooks).train()


def train_local(cfg: Config, run_dir: str, hooks: tuple[Hook, ...] = (), use_gpu: bool = False) -> dict:
    """Train `cfg` in this process, on the process group it is in (or alone), with plain files at
    `run_dir` (tests, benchmarks, debugging): resolved for that world (whatever
    parallel.num_workers says) and checked as a launch does on its driver (`preflight`), then
    `train`."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    spec = resolve_run(cfg, sizes=range(world_size, world_size + 1))
    leader = not dist.is_initialized() or dist.get_rank() == 0  # one lease for the process group
    with RunLease(run_dir, cfg.storage, cfg.run.lease_timeout_s) if leader else contextlib.nullcontext():
        if leader:
            preflight(spec, run_dir)
        if dist.is_initialized():  # the others train once rank 0's checks passed (or fail with them)
            dist.barrier()
        return train(spec, LocalEnv(run_dir, use_gpu=use_gpu), hooks)


class Trainer(BatchFeed, GuardedSteps):
    """One rank's run: the model with its layout, the optimizer, the run state restored from the
    newest checkpoint, the stability guard (`GuardedSteps`), the batches (`BatchFeed`),
    checkpoints, evaluation and the hooks."""

    def __init__(self, spec: RunSpec, env: TrainEnv, hooks: tuple[Hook, ...]):
        cfg = self.cfg = spec.config
        self.spec, self.env = spec, env
        self.events_path = os.path.join(env.run_dir, EVENTS_FILE)
        self.world = world = World.current(env.device())
        self.source = spec.datasets.open_split("train", cfg.data, cfg.storage)
        self.model = build_model(lambda: Transformer(cfg.model), cfg, world, spec.layout(world.world_size),
                                 spec.datasets.manifest.tokenizer.eot_id)
        self.optimizer = build_optimizer(self.model.parts, cfg.optim, cfg.model)
        self.restored_world_size: Optional[int] = None
        self.state = self._restore()
        self._build_guard()
        if needs_loss_scaling(cfg):
            self.state.loss_scale = self.state.loss_scale or cfg.train.loss_scale_initial
        self.scaler = LossScaler(self.state.loss_scale, cfg.train.loss_scale_growth_interval) \
            if self.state.loss_scale else None
        self.evals = ValidationSet(spec, self.model, spec.global_batch, cfg.train.eval_batches) \
            if cfg.train.eval_every > 0 else None
        self.tasks = TaskScores(spec, self.model) if cfg.train.eval_tasks is not None else None
        # What a checkpoint needs besides tensors to be usable on its own (generation, export).
        files = {CONFIG_FILE: config_to_yaml(cfg), TOKENIZER_FILE: spec.tokenizer_json}
        # What a resume compares to know it trains on the same tokens and the same samples.
        self.data_identity = {"tokenizer_sha256": spec.tokenizer_sha256, "data_sha256": spec.data_sha256}
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.storage, env, self.model, self.optimizer, world, files)
        self.clock = StepClock(world)
        self.clock.add("preemption", lambda: True)  # each tick asks the cluster
        if cfg.checkpoint.every_minutes is not None:
            self.clock.add("save", self.checkpointer.minutes_passed)
        if cfg.train.report_every_s > 0:
            self.clock.add("report", lambda: time.monotonic() - self.last_report >= cfg.train.report_every_s)
        self.run = Run(cfg, world, self.model, self.optimizer, self.state, spec.seq_len, spec.global_batch,
                       flops_per_token(cfg.model, spec.seq_len), peak_flops(world.device, cfg.train.peak_tflops),
                       restored_world_size=self.restored_world_size, restore_read_bytes=self.restore_read_bytes)
        if self.run.peak_flops is None and world.rank == 0:
            print(f"raylm: no peak FLOP/s known for {torch.cuda.get_device_name(world.device)!r}: MFU is left out of "
                  "the metrics; set train.peak_tflops (the GPU's dense bf16 peak) to have it", flush=True)
        self.logger = MetricsLogger(cfg, env.run_dir, world)
        probes = (NormsProbe(cfg.guard.norms_every),) if cfg.guard.norms_every else ()
        if cfg.train.profile is not None:  # only then: the other steps pay nothing
            probes += (ProfileHook(cfg.train.profile, env.run_dir, env.checkpoint_root, cfg.storage),)
        if cfg.train.inject_nonfinite:
            probes += (NonFiniteLoss(cfg.train.inject_nonfinite),)
        # The logger after the hooks that add to a step's metrics: it writes out what they added.
        self.hooks = (*(h for h in hooks if not h.after_metrics_written), *probes, self.logger,
                      *(h for h in hooks if h.after_metrics_written))
        self.last = min(cfg.train.steps, cfg.train.stop_at_step or cfg.train.steps)
        # A CPU runs each operation as it is queued: reading every step costs it nothing.
        self.read_every = cfg.train.read_every or (cfg.train.log_every if world.device.type == "cuda" else 1)
        self.read_each_until = 0  # steps before this one are read one by one (after a withheld step)
        self.queued: list[QueuedStep] = []  # queued on the device, not yet read
        self.replay: deque[Batch] = deque()  # batches queued behind a withheld step, to queue again
        self.timeline = Timeline(world.device)
        self.last_mark = self.timeline.mark()  # where the next committed step's time begins
        self.metrics: dict = {}  # the last committed step's
        self.step_lr: Optional[float] = None  # the LR a probe trained its step at, when it cut it
        self.last_report = 0.0  # when progress last went to the cluster
        # Seconds the loop was blocked by checkpointing since the last step's metrics: a save
        # (sync: the whole write; async: staging) and publishing a finished async save.
        self.checkpoint_s = 0.0
        # Seconds of the steps the guard discarded (skipped batches, rollbacks) since the last
        # step's metrics: time no kept step holds, which goodput must not lose track of.
        self.discarded_s = 0.0

    def _restore(self) -> TrainState:
        """The run state of the newest usable checkpoint (model and optimizer loaded), or a fresh one."""
        env, cfg, world = self.env, self.cfg, self.world
        read_before = bytes_read()

        def load(uri: str) -> tuple[str, dict]:
            return uri, checkpoint.load(uri, self.model, self.optimizer, world, self.spec.tokenizer_sha256, cfg.storage)
        restored = env.restore(load, cfg.checkpoint.on_unusable == "start_over")
        state = TrainState()
        if restored is not None:
            uri, saved = restored
            state, self.restored_world_size = TrainState.from_saved(saved), saved["world_size"]
            if self._records_start() and (changes := changes_since(uri, cfg, cfg.storage)):
                record_config_change(env.run_dir, state.step, changes)  # an operator's change mid-flight, as OPT's
        # Every rank's reads of the checkpoint, for the `resumed` event: its share, not the whole.
        self.restore_read_bytes = [bytes_read() - read_before]
        if world.world_size > 1:
            self.restore_read_bytes = [0] * world.world_size
            dist.all_gather_object(self.restore_read_bytes, bytes_read() - read_before)
        return state

    def _records_start(self) -> bool:
        """Whether this process records what a start finds (an operator's config change)."""
        return self.world.rank == 0

    def train(self) -> dict:
        """The steps from the run's current state to its last; returns the last step's metrics."""
        try:
            for hook in self.hooks:
                hook.on_train_start(self.run)
            metrics = self._steps()
            for hook in self.hooks:
                hook.on_train_end(self.run, metrics)
            return metrics
        finally:
            self.logger.close()

    def _steps(self) -> dict:
        self._open_stream()
        self.last_report = time.monotonic()
        self.last_mark = self.timeline.mark()
        wait_start = None  # a new stream on the way to a batch is part of the wait for it
        while True:
            self._measure_cpu_peak()
            wait_start = wait_start or time.perf_counter()
            taken = self._next_batch()
            if taken is None and self.queued:  # what the queued steps decide may send batches back
                self._read()
                continue
            if taken is None:
                break
            data_wait, wait_start = time.perf_counter() - wait_start, None
            queued = self._queue(*taken, data_wait)
            if queued is not None and self._read_due(queued):
                self._read()
        self.checkpointer.wait()
        self.checkpointer.require_final(self.state.step)
        return self.metrics

    def _measure_cpu_peak(self) -> None:
        """A CPU's peak FLOP/s (MFU's denominator) is measured, the first time at start-up while Ray
        was still starting processes on the same cores: keep the best of three, out of step time."""
        if self.state.step in (10, 100) and self.world.device.type == "cpu" and not self.cfg.train.peak_tflops \
                and not self.queued:
            self.run.peak_flops = max(self.run.peak_flops, peak_flops(self.world.device))
            self.last_mark = self.timeline.mark()

    # -- queueing a step --------------------------------------------------------------------------

    def _queue(self, raw: Batch, batch: Batch, data_wait: float) -> Optional[QueuedStep]:
        """One optimizer step on `batch`, queued on the device: forward, backward, clipping, the
        verdict and the update the verdict allows. Nothing here waits for the device. None where
        the step was given up, to be taken again (raylm.train.replica)."""
        for hook in self.hooks:
            hook.on_step_begin(self.run, batch.step)
        lr = self._lr(batch.step)
        apply_lr(self.optimizer, lr)
        rng = rng_state()
        record = self._step(batch)
        self.optimizer.zero_grad(set_to_none=True)
        mark = self.timeline.mark()
        self.checkpointer.step_began()
        due = self.clock.tick(waiting=self.checkpointer.writing())
        notice = None
        if self.clock.ticked:  # the ranks' one collective of this boundary, about a second apart
            poll_start = time.perf_counter()
            self.checkpointer.poll(self.clock.any_waiting)
            self.checkpoint_s += time.perf_counter() - poll_start
            notice = self.env.preemption_notice() if "preemption" in due else None
        queued = QueuedStep(batch, raw, lr, record, rng, data_wait, mark, due - {"preemption"}, notice)
        self.queued.append(queued)
        return queued

    def _lr(self, step: int) -> float:
        """The step's LR: the schedule's, under the guard's scale and cap. Exact when queued ahead of
        reads: the scale and the cap change only where the host acts, or, while the cap recovers,
        at every step, which is then read at once."""
        state = self.state
        lr = lr_at(step, self.cfg.schedule, self.cfg.optim.lr, self.cfg.train.steps) * state.lr_scale
        return lr if state.lr_cap is None else min(lr, state.lr_cap)

    def _step(self, batch: Batch) -> torch.Tensor:
        """Forward and backward, the verdict, and the update where the verdict allows it; the step's
        record (raylm.train.resilience.judge). The gradients stay for a withheld step's probe."""
        return self._judged(batch, *self.forward_backward(batch))

    def _judged(self, batch: Batch, loss: torch.Tensor, grad_norm: torch.Tensor, noise: Optional[torch.Tensor]
                ) -> torch.Tensor:
        """The step's verdict from its loss and gradient norm (and the data check's rows, `noise`),
        and the update where it allows it; the record, followed by `noise` where the check is on."""
        share = None if noise is None else noise.sum() / batch.global_batch
        record, apply = self.judge.judge(loss, grad_norm, self.guard is not None and self.guard.past_unigram,
                                         share, self._masking(batch.step))
        step_where(self.optimizer, apply)
        self._weights_changed()
        return record if noise is None else torch.cat([record, noise.double()])

    def _weights_changed(self) -> None:
        """After every update (taken or withheld) and every restore of the weights: float8's scales
        for FSDP2's float8 all-gather, precomputed from the weights as they now are."""
        after_optimizer_step(self.model.parts)

    def forward_backward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Forward and backward over this rank's rows, gradients unscaled and clipped; returns
        the loss, the gradient norm and, with the data check on, which of the global batch's rows
        are noise (`row_slots` of 0 or 1, each rank's rows in their place, gathered by the loss's
        own all-reduce), on the device. Where the step masks them, the loss and the gradients are
        those of the mean over the rows kept."""
        model, scaler = self.model, self.scaler
        tokens = torch.from_numpy(batch.tokens.astype(np.int64))
        if self.world.device.type == "cuda":
            # From pageable memory a copy waits for the GPU to drain (the last step's optimizer
            # kernels) before this step's forward can be queued; from pinned memory it does not.
            tokens = tokens.pin_memory().to(self.world.device, non_blocking=True)
        else:
            tokens = tokens.to(self.world.device)
        if scaler is not None:
            model.loss_scale = scaler.scale = self.state.loss_scale
        noise = ignore = None
        if self.data_check is not None:
            rows = self.data_check.noise_rows(tokens[:, 1:])
            ignore = rows if self._masking(batch.step) else None
            out = model.forward_backward(tokens, self.cfg.train.micro_batch_size, also=self._in_slots(rows, batch),
                                         ignore=ignore)
            loss, noise = out[0], out[1:]
        else:
            loss = model.forward_backward(tokens, self.cfg.train.micro_batch_size)
        loss, noise = self._across_replicas(loss, noise)
        if noise is not None:
            noise = (noise * self._averaged_over()).round()  # the average of one rank's flag: 0 or 1 again
        if ignore is not None:
            loss = self._over_rows_kept(loss, noise, batch)
        if scaler is not None:
            scaler.unscale(model.parts)
        return loss, model.clip_grad_norm(self.cfg.optim.grad_clip), noise

    def _across_replicas(self, loss: torch.Tensor, noise: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The gradients, loss and noise rows averaged over the replica groups that train the step
        (raylm.train.replica); one group, as here, has them whole already."""
        return loss, noise

    def _read_due(self, queued: QueuedStep) -> bool:
        """Whether the host reads the queued steps once `queued` is: every `read_every` steps, and
        wherever the host needs the model as this step leaves it (a guard check, an evaluation, a
        checkpoint, a timer, a hook) or the next step's LR or loss scale depends on this one's
        verdict (the guard's LR cap recovering, fp16's scale), and one by one for a while after a
        withheld step (a poisoned window: every batch of it suspect)."""
        cfg, step = self.cfg, queued.batch.step
        done = step + 1  # the run's step once this one is trained
        every = lambda n: bool(n) and done % n == 0  # noqa: E731
        guard = self.guard
        return (every(self.read_every) or done >= self.last or bool(queued.due) or queued.notice is not None
                or step < self.read_each_until
                or self.checkpointer.due(done, self.last) or every(cfg.train.eval_every)
                or (self.tasks is not None and every(cfg.train.eval_tasks.every_steps))
                or self.scaler is not None
                or (guard is not None and (every(guard.check_every()) or guard.recovering(self.state)))
                or any(hook.needs_read(step) for hook in self.hooks))

    # -- reading the queued steps -----------------------------------------------------------------

    def _read(self) -> None:
        """The queued steps' records, read in one host sync, taken in order:
        the steps the device applied are committed; the first it withheld is the host's to decide,
        and the batches queued behind it go back to be queued again."""
        queued, self.queued = self.queued, []
        if not queued:
            return
        records = self.timeline.read(torch.stack([q.record for q in queued]))
        now = time.time()
        for i, (q, record) in enumerate(zip(queued, records)):
            later = queued[i + 1:]
            if record[judge.VERDICT] in (Verdict.OK, Verdict.OVERFLOW):
                step_time = self.timeline.seconds(self.last_mark, q.mark)
                self.last_mark = q.mark
                end_time = now - (self.timeline.seconds(q.mark, later[-1].mark) if later else 0.0)
                if self._commit(q, record, step_time, end_time):
                    continue
                self._drop(later)  # rolled back: the model those steps were computed on is gone
                return
            wasted = self.timeline.seconds(q.mark, later[-1].mark) if later else 0.0
            self._drop(later)
            self.discarded_s += wasted
            self._withheld(q, record, [other.raw for other in later], wasted)
            return

    def _drop(self, queued: list[QueuedStep]) -> None:
        """Steps the device did not apply (queued behind a withheld one): their hooks end them."""
        for q in queued:
            for hook in self.hooks:
                hook.on_step_abandoned(self.run, q.batch.step)

    def _commit(self, q: QueuedStep, record: list[float], step_time: float, end_time: float) -> bool:
        """A step the device applied (or skipped for fp16's overflow) becomes the run's; False when
        it turns out to have damaged the model, which is then rolled back."""
        state, batch = self.state, q.batch
        loss, grad_norm = record[judge.LOSS], record[judge.GRAD_NORM]
        if not self._scale_after(q, record):
            return False
        self._advance(batch, record)
        if record[judge.VERDICT] == Verdict.OK and self.decisions is not None and \
                self.decisions.trained(state, loss, grad_norm, self._judged_samples(batch)) is Action.ROLL_BACK:
            self._roll_back(batch.step, state.position, q.lr)  # the canary finds the model drifted since its snapshot
            return False
        self._finish(q, loss, grad_norm, step_time, end_time)
        return True

    def _scale_after(self, q: QueuedStep, record: list[float]) -> bool:
        """fp16's loss scale after the step's verdict: an overflow halves it (the step was skipped on
        the device), a clean step counts toward its growth. A scale below train.loss_scale_min is a
        divergence: rolled back by the guard (False), or the end of a run without it."""
        cfg, scaler, batch = self.cfg, self.scaler, q.batch
        if scaler is None:
            return True
        overflow = record[judge.VERDICT] == Verdict.OVERFLOW
        if overflow or record[judge.VERDICT] == Verdict.OK:
            scaler.update(overflow=overflow)
            self.state.loss_scale = scaler.scale
        if scaler.scale >= cfg.train.loss_scale_min:
            return True
        if self.decisions is None:
            raise DivergedError(f"step {batch.step}: the fp16 loss scale fell to {scaler.scale:g}, below "
                                f"train.loss_scale_min={cfg.train.loss_scale_min:g}: the run diverges")
        if self.decisions.loss_scale_floor(record[judge.LOSS], scaler.scale, cfg.train.loss_scale_min) \
                is Action.ROLL_BACK:
            self._roll_back(batch.step, batch.next_position, q.lr)
        return False

    def _rewind(self, q: QueuedStep) -> None:
        """The RNG and LR as the step `q` found them: the host computes it again from there."""
        set_rng_state(q.rng)
        apply_lr(self.optimizer, q.lr)  # the optimizer holds the last queued step's

    def _advance(self, batch: Batch, record: list[float]) -> None:
        state = self.state
        if self.guard is not None:
            self._left_out(batch, record)
        state.step = batch.step + 1
        if self.quarantine is not None:
            self.quarantine.pass_over(state, batch.step, batch.next_position)
        state.position = batch.next_position
        state.tokens_seen += batch.global_batch * self.spec.seq_len

    def _finish(self, q: QueuedStep, loss: float, grad_norm: float, step_time: float, end_time: float) -> None:
        """A committed step's metrics, evaluation, hooks, checkpoint, report and preemption."""
        self.metrics = self._step_metrics(q, loss, grad_norm, step_time, end_time)
        self._after_step(q.batch.step, self.metrics, q.due)
        if q.notice is not None and self.state.step < self.last:
            stop_for_preemption(q.notice, self.state.step, self.checkpointer, self.world,
                                lambda: self._save(self.metrics))

    def _devices(self) -> int:  # MFU's denominator: the devices that trained the step's whole batch
        return self.world.world_size

    def _step_metrics(self, q: QueuedStep, loss: float, grad_norm: float, step_time: float, end_time: float) -> dict:
        state, run, batch = self.state, self.run, q.batch
        tokens_per_s = batch.global_batch * self.spec.seq_len / step_time
        lr, self.step_lr = self.step_lr or q.lr, None
        # position: where the next step's samples start, so an audit of metrics.jsonl alone
        # can tell which samples each committed step trained on (resume, resize, skip).
        metrics = {"step": state.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                   "global_batch": batch.global_batch,
                   "position": state.position, "tokens": state.tokens_seen, "time": end_time,
                   "step_time": step_time, "data_wait": q.data_wait, "checkpoint_s": self.checkpoint_s,
                   "tokens_per_s": tokens_per_s}
        if run.peak_flops:
            metrics["mfu"] = run.flops_per_token * tokens_per_s / (run.peak_flops * self._devices())
        self.checkpoint_s = 0.0
        if self.scaler is not None:
            metrics["loss_scale"] = self.scaler.scale
        if self.guard is not None:
            metrics["guard_s"] = self.guard.spent()  # within step_time: the guard's cost
            metrics["skipped_samples"] = skipped_samples(state)
            metrics["discarded_s"], self.discarded_s = self.discarded_s, 0.0  # outside step_time
            if state.lr_cap is not None:
                metrics["lr_cap"] = state.lr_cap
            if state.lr_scale != 1.0:
                metrics["lr_scale"] = state.lr_scale
        if self.cfg.train.audit_samples:
            left_out = set(self.masked_samples)
            metrics["samples"] = [i for i in self._step_samples(batch) if i not in left_out]
        return metrics

    def _step_samples(self, batch: Batch) -> list[int]:
        """The global sample indices the whole step trained on (train.audit_samples). Ranks of one
        data-parallel rank's tensor/pipeline group hold the same rows: each dp rank's count once."""
        if not dist.is_initialized():
            return sorted(batch.indices)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.model.dp_rank, batch.indices))
        return sorted(i for rows in dict(gathered).values() for i in rows)

    def _after_step(self, step: int, metrics: dict, due: frozenset[str]) -> None:
        """Evaluation, the hooks, then a checkpoint or a report to the cluster (`due`: the step
        clock's timers due at this boundary)."""
        cfg, state = self.cfg, self.state
        if self.evals is not None and (state.step == self.last or state.step % cfg.train.eval_every == 0):
            metrics["val_loss"] = self.evals.loss(self.model, cfg.train.micro_batch_size)
            metrics["val_bpb"] = self.evals.bits_per_byte(metrics["val_loss"])
            self.last_mark = self.timeline.mark()  # evaluation is not step time
        if self.tasks is not None and (state.step == self.last or state.step % cfg.train.eval_tasks.every_steps == 0):
            metrics.update(self.tasks.scores(state.step))
            self.last_mark = self.timeline.mark()
        if self.checkpointer.failing_since is not None:
            metrics["unprotected_steps"] = state.step - self.checkpointer.failing_since
        for hook in self.hooks:
            hook.on_step_end(self.run, step, metrics)
        self.run.history.append(metrics)
        if self.checkpointer.due(state.step, self.last) or "save" in due:
            self._save(metrics)
        elif "report" in due:
            self.env.report(metrics)
            self.last_report = time.monotonic()
        self.checkpointer.warn_if_failing()

    def _save(self, metrics: dict) -> None:
        save_start = time.perf_counter()
        if self.guard is not None:
            self.guard.save_history(self.state)
        self.checkpointer.save(self.state.step, {**vars(self.state), **self.data_identity}, metrics)
        self.last_mark = self.timeline.mark()
        self.checkpoint_s = time.perf_counter() - save_start  # outside step_time: reported with the next step
        self.last_report = time.monotonic()
