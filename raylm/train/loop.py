"""The training loop, in torchtitan's shape: `Trainer.train` owns the schedule, the hooks,
evaluation and checkpoints; `_queue` is one optimizer step; `forward_backward` runs the
micro-batches (`ParallelModel.forward_backward`) and clips the gradients.

A step is queued on the device whole, its verdict included (`raylm.train.resilience.judge`: the
update a suspect step must not take is withheld there), and the host reads what the steps did
only every `train.read_every` steps or where it needs the model as a step leaves it (`_read`):
a steady step makes no host sync, so the device never waits for the host's bookkeeping. A step
the device withheld is then decided by the host as the guard always has, from the model as that
step found it, and the batches queued behind it are queued again.

Plain torch: Ray stays at the edges. `TrainEnv` is how the loop reaches storage and the cluster;
`raylm.launch.worker` gives it the Ray Train one, `LocalEnv` plain files. `raylm train`'s
workers, sweeps' trials, benchmarks and tests all run `train` on a `RunSpec` resolved before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import NoReturn, Optional

import numpy as np
import torch
import torch.distributed as dist

from raylm.config import CONFIG_FILE, Config, config_to_yaml
from raylm.data.order import batch_indices
from raylm.data.stream import Batch, TokenStream
from raylm.data.tokenizer import TOKENIZER_FILE
from raylm.errors import DivergedError, Preempted
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
from raylm.train.hooks import Hook, Run
from raylm.train.lease import RunLease
from raylm.train.observe.metrics import MetricsLogger, peak_flops
from raylm.train.observe.norms import NormsProbe
from raylm.train.observe.profile import ProfileHook
from raylm.train.observe.records import EVENTS_FILE
from raylm.train.optim import apply_lr, build_optimizer, lr_at, step_where
from raylm.train.preflight import preflight
from raylm.train.resilience.faults import NonFiniteLoss
from raylm.train.resilience import judge
from raylm.train.resilience.guard import Guard, skipped_samples
from raylm.train.resilience.datacheck import DataCheck, data_limit
from raylm.train.resilience.judge import StepJudge, Verdict
from raylm.train.resilience.preemption import Notice
from raylm.train.resilience.quarantine import Quarantine
from raylm.train.spec import RunSpec, resolve_run
from raylm.train.state import TrainState
from raylm.train.step import LossScaler, build_model, needs_loss_scaling
from raylm.train.validation import TaskScores, ValidationSet, unigram_loss


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


@dataclass
class QueuedStep:
    """A step whose work is queued on the device and whose outcome the host has not read yet."""

    batch: Batch  # as trained: labelled with its step
    raw: Batch  # as the stream gave it: queued again, it is labelled anew
    lr: float
    record: torch.Tensor  # its verdict, loss and gradient norm on the device (raylm.train.resilience.judge)
    rng: tuple[torch.Tensor, Optional[torch.Tensor]]  # the RNG before its forward: the host computes it again from there
    data_wait: float  # seconds the loop waited for its batch
    mark: object  # the device's timeline once its update was queued (Timeline.mark)
    due: frozenset[str]  # the step clock's timers due at its boundary that need the model as it leaves it
    notice: Optional[Notice]  # the cluster takes nodes back: stop after this step


def _rng_state() -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def _set_rng_state(state: tuple[torch.Tensor, Optional[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class Trainer:
    """One rank's run: the model with its layout, the optimizer, the run state restored from the
    newest checkpoint, the stability guard, checkpoints, evaluation and the hooks."""

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
        self.guard: Optional[Guard] = None
        if cfg.guard.enabled:
            # Whole micro-batches on every data-parallel rank: the canary runs as an evaluation does.
            unit = self.model.dp_size * cfg.train.micro_batch_size
            canary = ValidationSet(spec, self.model, -(-cfg.guard.canary_rows // unit) * unit, 1, across_split=False)
            self.guard = Guard(cfg, self.model, self.optimizer, world, canary, unigram_loss(spec), self.events_path,
                               env.checkpoint_root)
            self.guard.start(self.state)
        unigram = self.guard.unigram if self.guard is not None else None
        self.data_check: Optional[DataCheck] = None
        if self.guard is not None:
            limit, why_off = data_limit(spec.datasets.manifests, spec.datasets.uris, cfg.guard.data_deviations)
            self.data_check = DataCheck(limit, world.device) if limit is not None else None
            if why_off and world.rank == 0:
                print(f"raylm: guard: {why_off}", flush=True)
        self.judge = StepJudge(world.device, cfg.guard if self.guard is not None else None, unigram,
                               needs_loss_scaling(cfg), data_check=self.data_check is not None)
        if self.guard is not None:
            self.judge.load(*self.guard.history())
        self.quarantine = Quarantine(self.source.order, self.events_path, world.rank) \
            if cfg.guard.enabled and cfg.guard.quarantine else None
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
        self.hooks = (*hooks, *probes, self.logger)  # the logger last: it writes out what the other hooks added
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
            if world.rank == 0 and (changes := changes_since(uri, cfg, cfg.storage)):
                record_config_change(env.run_dir, state.step, changes)  # an operator's change mid-flight, as OPT's
        # Every rank's reads of the checkpoint, for the `resumed` event: its share, not the whole.
        self.restore_read_bytes = [bytes_read() - read_before]
        if world.world_size > 1:
            self.restore_read_bytes = [0] * world.world_size
            dist.all_gather_object(self.restore_read_bytes, bytes_read() - read_before)
        return state

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

    # -- the stream ------------------------------------------------------------------------------

    def _open_stream(self) -> None:
        """The run's batches from its current state; the guard's skip ranges grow at each rollback."""
        cfg, state, model = self.cfg, self.state, self.model
        self._take_skips()
        # An auto loader left undecided means no launch onto a cluster decided it: a run in one process.
        stream = TokenStream(self.source, self.spec.batch_schedule, model.dp_rank, model.dp_size,
                             self._skip(), engine="ray" if cfg.data.loader == "ray" else "local",
                             prefetch=cfg.data.prefetch_chunks)
        self.batches = stream.batches(state.position, state.step, self.last, state.tokens_seen // self.spec.seq_len)
        self.behind = 0  # steps the stream's labels run ahead of the run: batches skipped without a new stream

    def _take_skips(self) -> None:
        """The skip ranges a stream from the run's state leaves out, as they are now."""
        state = self.state
        self.stream_skip = [list(r) for r in state.skip]
        if self.quarantine is not None:
            self.quarantine.place(state, self._remaining_samples(), [*self.cfg.data.skip, *state.skip])
            self.quarantine.stream_started()

    def _restart_stream(self) -> None:
        self.batches.close()
        self.replay.clear()
        self._open_stream()

    def _skip(self) -> list[list[int]]:
        """Every sample range the data order leaves out: data.skip, the guard's, the quarantine's."""
        quarantined = self.quarantine.ranges() if self.quarantine is not None else []
        return [*self.cfg.data.skip, *self.state.skip, *quarantined]

    def _remaining_samples(self) -> int:
        return (self.last - self.state.step) * self.spec.batch_schedule.final

    def _next_batch(self) -> Optional[tuple[Batch, Batch]]:
        """The next batch to queue, as the stream gave it and labelled with its step (batches sent
        back by a withheld step first); None at the stream's end, or where the queued steps must be
        read before the run knows what comes next."""
        while True:
            raw = self.replay.popleft() if self.replay else next(self.batches, None)
            # Planned before the rows it would reach were quarantined: a new stream, from the run's state.
            stale = raw is not None and self.quarantine is not None and self.quarantine.stream_stale(raw.next_position)
            if raw is not None and not stale:
                return raw, dataclasses.replace(raw, step=raw.step - self.behind) if self.behind else raw
            if self.queued:  # a new stream starts where the run is: the steps in flight are read first
                if stale:
                    self.replay.appendleft(raw)
                return None
            if stale or self.behind and self.state.step < self.last:  # or the steps the skips left at the end
                self._restart_stream()
                continue
            return None

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
        rng = _rng_state()
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
        return self._judged(*self.forward_backward(batch))

    def _judged(self, loss: torch.Tensor, grad_norm: torch.Tensor, noise_share: Optional[torch.Tensor]
                ) -> torch.Tensor:
        """The step's verdict from its loss and gradient norm, and the update where it allows it."""
        record, apply = self.judge.judge(loss, grad_norm, self.guard is not None and self.guard.past_unigram,
                                         noise_share)
        step_where(self.optimizer, apply)
        self._weights_changed()
        return record

    def _weights_changed(self) -> None:
        """After every update (taken or withheld) and every restore of the weights: float8's scales
        for FSDP2's float8 all-gather, precomputed from the weights as they now are."""
        after_optimizer_step(self.model.parts)

    def forward_backward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Forward and backward over this rank's rows, gradients unscaled and clipped; returns
        the loss, the gradient norm and, with the data check on, the share of the batch's rows that
        are noise (averaged across data-parallel ranks with the loss), on the device."""
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
        noise_share = None
        if self.data_check is not None:
            noise_share = self.data_check.noise_share(tokens[:, 1:])
            loss, noise_share = model.forward_backward(tokens, self.cfg.train.micro_batch_size, also=noise_share)
        else:
            loss = model.forward_backward(tokens, self.cfg.train.micro_batch_size)
        loss, noise_share = self._across_replicas(loss, noise_share)
        if scaler is not None:
            scaler.unscale(model.parts)
        return loss, model.clip_grad_norm(self.cfg.optim.grad_clip), noise_share

    def _across_replicas(self, loss: torch.Tensor, noise_share: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The gradients, loss and noise share averaged over the replica groups that train the step
        (raylm.train.replica); one group, as here, has them whole already."""
        return loss, noise_share

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
        """The queued steps' records, read at once (the one host sync of the window), taken in order:
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
        self._advance(batch)
        if record[judge.VERDICT] == Verdict.OK and self.guard is not None and \
                not self.guard.healthy(state, loss, grad_norm, batch.tokens):
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
        if self.guard is None:
            raise DivergedError(f"step {batch.step}: the fp16 loss scale fell to {scaler.scale:g}, below "
                                f"train.loss_scale_min={cfg.train.loss_scale_min:g}: the run diverges")
        self.guard.loss_scale_floor(record[judge.LOSS], scaler.scale, cfg.train.loss_scale_min)
        self._roll_back(batch.step, batch.next_position, q.lr)
        return False

    def _advance(self, batch: Batch) -> None:
        state = self.state
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
            self._stop_for_preemption(q.notice, self.metrics)

    # -- a withheld step: the host decides ----------------------------------------------------------

    def _withheld(self, q: QueuedStep, record: list[float], later: list[Batch], wasted: float) -> None:
        """The first step the device withheld (suspect or non-finite), the model as it found it: its
        gradients computed again from its RNG, then the guard's decision as it always was: a
        non-finite step computed once more (a transient fault passes), a suspect one judged by the
        canary. `later`: the batches queued behind it, queued again unless the run goes back."""
        cfg, state, batch = self.cfg, self.state, q.batch
        self.read_each_until = batch.step + self.read_every
        self.judge.resume()
        _set_rng_state(q.rng)
        apply_lr(self.optimizer, q.lr)  # the optimizer holds the last queued step's
        nonfinite = record[judge.VERDICT] == Verdict.NONFINITE
        if nonfinite and self.guard is None:
            # Nothing is lost: no update was applied since, and the last checkpoint stands.
            raise DivergedError(
                f"step {batch.step}: loss {record[judge.LOSS]} / grad norm {record[judge.GRAD_NORM]} is not finite; "
                f"the weights were not updated. Samples of this step: global positions [{state.position}, "
                f"{batch.next_position}); skip them with data.skip or lower optim.lr and resume.")
        self.guard.withheld(record)
        if nonfinite:  # computed again: its verdict decides
            first = {"loss": record[judge.LOSS], "grad_norm": record[judge.GRAD_NORM]}
            record = self.timeline.read(self._step(batch)[None])[0]
            if record[judge.VERDICT] != Verdict.NONFINITE:
                self.guard.rerun(batch.step, first)
            if record[judge.VERDICT] in (Verdict.SUSPECT, Verdict.NONFINITE):
                self.guard.withheld(record)
        elif not record[judge.OFF_DATA]:  # the gradients of a withheld update, for the probe (data off
            self.forward_backward(batch)  # the dataset's distribution is skipped without one)
        verdict = Verdict(int(record[judge.VERDICT]))
        if verdict in (Verdict.OK, Verdict.OVERFLOW):
            self.judge.resume()
            self.optimizer.zero_grad(set_to_none=True)
            if self._commit(q, record, *self._handled(q, wasted)):
                self._send_back(later)
            return
        # The batch's samples, for a quarantine, before a skip joins its span to the skip ranges.
        indices = self._global_indices(batch) if self.quarantine is not None else []
        outcome = self._probe(batch, q.lr, verdict, record)
        self.judge.resume()
        self.judge.load(*self.guard.history())
        if outcome == "rollback":
            self._roll_back(batch.step, batch.next_position, q.lr)
            return
        if outcome == "skipped":  # the step is trained on the batches after it: as if data.skip held it
            if self.quarantine is not None:
                self.quarantine.add(state, indices, batch.next_position, self._remaining_samples(),
                                    [*cfg.data.skip, *state.skip])
            self._abandon(batch.step)
            self.discarded_s += self.timeline.seconds(self.last_mark, self.timeline.mark())
            self.last_mark = self.timeline.mark()
            if self._stream_goes_on(batch):
                self.behind += 1
                self._send_back(later)
            else:
                self._restart_stream()
            return
        self.optimizer.zero_grad(set_to_none=True)
        self._advance(batch)
        self._finish(q, record[judge.LOSS], record[judge.GRAD_NORM], *self._handled(q, wasted))
        self._send_back(later)

    def _handled(self, q: QueuedStep, wasted: float) -> tuple[float, float]:
        """A withheld step's time, up to the host's decision, less the steps computed in vain behind it."""
        end = self.timeline.mark()
        step_time = self.timeline.seconds(self.last_mark, end) - wasted
        self.last_mark = end
        return step_time, time.time()

    def _send_back(self, later: list[Batch]) -> None:
        self.replay.extendleft(reversed(later))

    def _probe(self, batch: Batch, lr: float, verdict: Verdict, record: list[float]) -> str:
        """A suspect (or twice non-finite) step, judged by the canary: "stepped" when its update is
        trained on, at the LR or at the LR cut (not one for the healthy history: a strange batch);
        "skipped" when its update damages a sound model at either LR, or when the batch is noise to
        the model and its update hurts the canary at all; "rollback" when the model was damaged
        before it (see raylm.train.resilience.guard)."""
        guard, state, step = self.guard, self.state, batch.step
        samples = [state.position, batch.next_position]
        if record[judge.OFF_DATA]:  # the data judged, not the model: no canary
            guard.skip_batch(step, state, samples, noise_share=record[judge.NOISE_ROWS])
            return "skipped"
        before = guard.canary_loss()
        if guard.damaged(before) and not guard.learning():
            guard.trigger.update(canary=before, reference=guard.reference)
            return "rollback"
        if verdict == Verdict.NONFINITE:
            if guard.nonfinite_in_a_row(step):
                return "rollback"
            guard.skip_batch(step, state, samples, canary=before)
            return "skipped"
        held = guard.hold(state)
        self.optimizer.step()
        self._weights_changed()
        after = guard.canary_loss()
        noise = bool(record[judge.NOISE])
        if not guard.damaged(after, before, tolerance=0.0 if noise else None):
            guard.hard_batch(step, samples, before, after)
            return "stepped"
        guard.undo(held)
        self._weights_changed()
        if noise:
            guard.skip_batch(step, state, samples, canary_before=before, canary_after=after,
                             unigram=guard.unigram)
            return "skipped"
        apply_lr(self.optimizer, lr * self.cfg.guard.lr_factor)
        self.optimizer.step()
        self._weights_changed()
        cut = guard.canary_loss()
        if guard.helped(cut, before):
            guard.lr_cut(step, state, lr, before, cut)
            self.step_lr = lr * self.cfg.guard.lr_factor
            return "stepped"
        if not guard.damaged(cut, before):
            guard.hard_batch(step, samples, before, cut, lr_factor=self.cfg.guard.lr_factor)
            self.step_lr = lr * self.cfg.guard.lr_factor  # for this step alone
            return "stepped"
        guard.undo(held)
        self._weights_changed()
        guard.skip_batch(step, state, samples, canary_before=before, canary_after=after, canary_at_lr_cut=cut)
        return "skipped"

    def _stream_goes_on(self, batch: Batch) -> bool:
        """Whether the batches in flight are those a stream restarted from the run's state would
        give, one step behind their labels: after a skipped batch, at a constant batch size, when
        the skip ranges added since the stream began all end where the batch ends. A restart
        costs seconds with the ray loader (a new reader actor), and a poisoned window skips batch after batch."""
        state, schedule = self.state, self.spec.batch_schedule
        if state.step != batch.step or schedule.start is not None and \
                state.tokens_seen // self.spec.seq_len < schedule.ramp_samples:
            return False
        if any(end > batch.next_position for start, end in state.skip if [start, end] not in self.stream_skip):
            return False
        skip = self._skip()
        return batch_indices(state.position, 1, skip)[0] == batch_indices(batch.next_position, 1, skip)[0]

    def _roll_back(self, step: int, consumed_until: int, lr: float) -> None:
        self._abandon(step)
        self.guard.roll_back(step, self.state, consumed_until, lr)
        self._weights_changed()
        self.checkpointer.abandon_after(self.state.step)
        self.judge.resume()
        self.judge.load(*self.guard.history())
        now = self.timeline.mark()
        self.discarded_s += self.timeline.seconds(self.last_mark, now)
        self.last_mark = now
        self._restart_stream()

    def _global_indices(self, batch: Batch) -> list[int]:
        """Every rank's samples of `batch` (this rank holds its share only)."""
        return batch_indices(self.state.position, batch.global_batch, self._skip())[0]

    def _abandon(self, step: int) -> None:
        """The step ends without metrics; the batches go on from the run's state (and skip ranges)."""
        self.optimizer.zero_grad(set_to_none=True)
        for hook in self.hooks:
            hook.on_step_abandoned(self.run, step)

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
            metrics["mfu"] = run.flops_per_token * tokens_per_s / (run.peak_flops * self.world.world_size)
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
            metrics["samples"] = self._step_samples(batch)
        return metrics

    def _step_samples(self, batch: Batch) -> list[int]:
        """The global sample indices the whole step trained on (train.audit_samples)."""
        return _samples_of_step(self.model.dp_rank, batch.indices)

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
        self._checkpoint_health()

    def _save(self, metrics: dict) -> None:
        save_start = time.perf_counter()
        if self.guard is not None:
            self.guard.save_history(self.state)
        self.checkpointer.save(self.state.step, {**vars(self.state), **self.data_identity}, metrics)
        self.last_mark = self.timeline.mark()
        self.checkpoint_s = time.perf_counter() - save_start  # outside step_time: reported with the next step
        self.last_report = time.monotonic()

    def _stop_for_preemption(self, notice: Notice, metrics: dict) -> NoReturn:
        """Nodes of the run are being taken back: a checkpoint of this step boundary (unless this
        step's own is already written, or the deadline has passed), then every rank stops with
        `Preempted`, for Ray Train to restart the run from it without those nodes. Stopping, not
        training on until the node goes: a step after the save would be trained again."""
        step = self.state.step
        self.checkpointer.wait()
        # Rank 0's clock decides for all: the save is collective.
        if self.world.agree(self.checkpointer.published_step != step and not notice.passed(), "rank0"):
            self._save(metrics)
            self.checkpointer.wait()
        # Also a barrier: rank 0 gets here only once it has finalized the checkpoint, which a rank
        # stopping sooner could otherwise have Ray Train tear down half-written.
        saved = self.world.agree(self.checkpointer.published_step == step, "all")
        raise Preempted(notice.node_ranks, notice.deadline, step, saved)

    def _checkpoint_health(self) -> None:
        """Loud while no checkpoint can be written (checkpoint.allow_failures): a warning every step
        besides each step's `unprotected_steps` metric (the checkpointer records the events)."""
        saver = self.checkpointer
        if saver.failing_since is not None and self.world.rank == 0:
            print(f"WARNING: no checkpoint could be written since step {saver.failing_since} ({saver.last_error}): "
                  f"a failure now loses {saver.unsaved}; this run is not protected against failures "
                  "(checkpoint.allow_failures=true)", flush=True)


def _samples_of_step(dp_rank: int, indices: list[int]) -> list[int]:
    """The global sample indices the whole step trained on. Ranks of one data-parallel rank's
    tensor/pipeline group hold the same rows, so each dp rank's rows count once."""
    if not dist.is_initialized():
        return sorted(indices)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, indices))
    return sorted(i for rows in dict(gathered).values() for i in rows)
