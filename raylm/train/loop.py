"""The training loop, in torchtitan's shape: `Trainer.train` owns the schedule, the hooks,
evaluation and checkpoints; `train_step` is one optimizer step; `forward_backward` runs the
micro-batches (`ParallelModel.forward_backward`) and clips the gradients.

Plain torch: Ray stays at the edges. `TrainEnv` is how the loop reaches storage and the cluster;
`raylm.launch.worker` gives it the Ray Train one, `LocalEnv` plain files. `raylm train`'s
workers, sweeps' trials, benchmarks and tests all run `train` on a `RunSpec` resolved before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Iterator, NoReturn, Optional

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
from raylm.parallel.world import World
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.policy import Checkpointer
from raylm.train.checkpoint.resume import changes_since, record_config_change
from raylm.train.clock import StepClock
from raylm.train.env import LocalEnv, TrainEnv
from raylm.train.hooks import Hook, Run
from raylm.train.lease import RunLease
from raylm.train.observe.metrics import MetricsLogger, peak_flops
from raylm.train.observe.norms import NormsProbe
from raylm.train.observe.profile import ProfileHook
from raylm.train.observe.records import EVENTS_FILE
from raylm.train.optim import apply_lr, build_optimizer, lr_at
from raylm.train.preflight import preflight
from raylm.train.resilience.faults import NonFiniteLoss
from raylm.train.resilience.guard import Guard, skipped_samples
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
        self.optimizer = build_optimizer(self.model.parts, cfg.optim)
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
                       restored_world_size=self.restored_world_size)
        self.logger = MetricsLogger(cfg, env.run_dir, world)
        probes = (NormsProbe(cfg.guard.norms_every),) if cfg.guard.norms_every else ()
        if cfg.train.profile is not None:  # only then: the other steps pay nothing
            probes += (ProfileHook(cfg.train.profile, env.run_dir, env.checkpoint_root, cfg.storage),)
        if cfg.train.inject_nonfinite:
            probes += (NonFiniteLoss(cfg.train.inject_nonfinite),)
        self.hooks = (*hooks, *probes, self.logger)  # the logger last: it writes out what the other hooks added
        self.last = min(cfg.train.steps, cfg.train.stop_at_step or cfg.train.steps)
        self.t0 = 0.0  # when the current step's time began
        self.data_wait = 0.0  # the current step's wait for its batch
        self.lr = 0.0  # the current step's learning rate
        self.last_report = 0.0  # when progress last went to the cluster
        # Seconds the loop was blocked by checkpointing since the last step's metrics: a save
        # (sync: the whole write; async: staging) and publishing a finished async save.
        self.checkpoint_s = 0.0
        # Seconds of the steps the guard discarded (skipped batches, rollbacks) since the last
        # step's metrics: time no kept step holds, which goodput must not lose track of.
        self.discarded_s = 0.0

    def _restore(self) -> TrainState:
        """The run state of the newest usable checkpoint (model and optimizer loaded), or a fresh one."""
        env, cfg = self.env, self.cfg
        with env.restore_dir(cfg.checkpoint.on_unusable == "start_over") as restore:
            if restore is None:
                return TrainState()
            saved = checkpoint.load(restore, self.model, self.optimizer, self.world, self.spec.tokenizer_sha256)
            state, self.restored_world_size = TrainState.from_saved(saved), saved["world_size"]
            if self.world.rank == 0 and (changes := changes_since(restore, cfg)):
                record_config_change(env.run_dir, state.step, changes)  # an operator's change mid-flight, as OPT's
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

    def _batches(self) -> Iterator[Batch]:
        """The run's batches from its current state; the guard's skip ranges grow at each rollback."""
        cfg, state, model = self.cfg, self.state, self.model
        self.stream_skip = [list(r) for r in state.skip]
        if self.quarantine is not None:
            self.quarantine.place(state, self._remaining_samples(), [*cfg.data.skip, *state.skip])
            self.quarantine.stream_started()
        # An auto loader left undecided means no launch onto a cluster decided it: a run in one process.
        stream = TokenStream(self.source, self.spec.batch_schedule, model.dp_rank, model.dp_size,
                             self._skip(), engine="ray" if cfg.data.loader == "ray" else "local",
                             prefetch=cfg.data.prefetch_chunks)
        return stream.batches(state.position, state.step, self.last, state.tokens_seen // self.spec.seq_len)

    def _skip(self) -> list[list[int]]:
        """Every sample range the data order leaves out: data.skip, the guard's, the quarantine's."""
        quarantined = self.quarantine.ranges() if self.quarantine is not None else []
        return [*self.cfg.data.skip, *self.state.skip, *quarantined]

    def _remaining_samples(self) -> int:
        return (self.last - self.state.step) * self.spec.batch_schedule.final

    def _steps(self) -> dict:
        metrics: dict = {}
        batches = self._batches()
        behind = 0  # steps the stream's labels run ahead of the run: batches skipped without a restart
        self.last_report = time.monotonic()
        self.t0 = time.perf_counter()
        wait_start = None  # a new stream on the way to a batch is part of the wait for it
        while True:
            self._measure_cpu_peak()
            wait_start = wait_start or time.perf_counter()
            batch = next(batches, None)
            if batch is None and behind and self.state.step < self.last:  # the steps the skips left
                batches, behind = self._batches(), 0
                continue
            if batch is None:
                break
            if self.quarantine is not None and self.quarantine.stream_stale(batch.next_position):
                batches.close()  # planned before the rows it would reach were quarantined
                batches, behind = self._batches(), 0
                continue
            if behind:
                batch = dataclasses.replace(batch, step=batch.step - behind)
            self.data_wait, wait_start = time.perf_counter() - wait_start, None
            poll_start = time.perf_counter()
            self.checkpointer.poll()
            self.checkpoint_s += time.perf_counter() - poll_start
            step_metrics = self.train_step(batch)
            if step_metrics is None:  # rolled back or skipped: the batches go on from the run's state
                if self._stream_goes_on(batch):
                    behind += 1
                else:
                    batches.close()
                    batches, behind = self._batches(), 0
                now = time.perf_counter()
                self.t0, self.discarded_s = now, self.discarded_s + now - self.t0
                continue
            metrics = step_metrics
            due = self.clock.tick()
            self._after_step(batch.step, metrics, due)
            if "preemption" in due and self.state.step < self.last and (notice := self.env.preemption_notice()):
                self._stop_for_preemption(notice, metrics)
        self.checkpointer.wait()
        return metrics

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

    def _measure_cpu_peak(self) -> None:
        """A CPU's peak FLOP/s (MFU's denominator) is measured, the first time at start-up while Ray
        was still starting processes on the same cores: keep the best of three, out of step time."""
        if self.state.step in (10, 100) and self.world.device.type == "cpu" and not self.cfg.train.peak_tflops:
            start = time.perf_counter()
            self.run.peak_flops = max(self.run.peak_flops, peak_flops(self.world.device))
            self.t0 += time.perf_counter() - start

    def train_step(self, batch: Batch) -> Optional[dict]:
        """One optimizer step on `batch`; its metrics, or None when the guard rolled the run back or
        skipped the batch."""
        cfg, state, step = self.cfg, self.state, batch.step
        for hook in self.hooks:
            hook.on_step_begin(self.run, step)
        self.lr = lr_at(step, cfg.schedule, cfg.optim.lr, cfg.train.steps) * state.lr_scale
        if state.lr_cap is not None:
            self.lr = min(self.lr, state.lr_cap)
        apply_lr(self.optimizer, self.lr)
        loss, grad_norm = self.forward_backward(batch)
        verdict = self._verdict(step, loss, grad_norm)
        if verdict == "nonfinite" and self.guard is not None:
            loss, grad_norm, verdict = self._rerun(batch, loss, grad_norm)
        if verdict == "nonfinite" and self.guard is None:
            # Nothing is lost: the optimizer has not stepped, the last checkpoint stands.
            raise DivergedError(
                f"step {step}: loss {loss} / grad norm {grad_norm} is not finite; the weights were "
                f"not updated. Samples of this step: global positions [{state.position}, "
                f"{batch.next_position}); skip them with data.skip or lower optim.lr and resume.")
        if verdict == "ok":
            self.optimizer.step()
        elif verdict in ("suspect", "nonfinite"):
            # The batch's samples, for a quarantine, before a skip joins its span to the skip ranges.
            indices = self._global_indices(batch) if self.quarantine is not None else []
            verdict = self._probe(batch, verdict, loss)
        if verdict == "rollback":
            return self._roll_back(step, batch.next_position)
        if verdict == "skipped":  # the step is trained on the batches after it: as if data.skip held it
            if self.quarantine is not None:
                self.quarantine.add(state, indices, batch.next_position, self._remaining_samples(),
                                    [*cfg.data.skip, *state.skip])
            return self._abandon(step)
        self.optimizer.zero_grad(set_to_none=True)
        state.step = step + 1
        if self.quarantine is not None:
            self.quarantine.pass_over(state, step, batch.next_position)
        state.position = batch.next_position
        state.tokens_seen += batch.global_batch * self.spec.seq_len
        if verdict == "ok" and self.guard is not None and not self.guard.healthy(state, loss, grad_norm, batch.tokens):
            return self._roll_back(step, state.position)  # the canary finds the model drifted since its snapshot
        return self._step_metrics(batch, loss, grad_norm)

    def _rerun(self, batch: Batch, loss: float, grad_norm: float) -> tuple[float, float, str]:
        """A non-finite step computed again: a transient fault passes, a batch that fails again does not."""
        self.optimizer.zero_grad(set_to_none=True)
        again, again_norm = self.forward_backward(batch)
        verdict = self._verdict(batch.step, again, again_norm)
        if verdict != "nonfinite":
            self.guard.rerun(batch.step, {"loss": loss, "grad_norm": grad_norm})
        return again, again_norm, verdict

    def _probe(self, batch: Batch, verdict: str, loss: float) -> str:
        """A suspect (or twice non-finite) step, judged by the canary: "stepped" when its update is
        trained on, at the LR or at the LR cut (not one for the healthy history: a strange batch);
        "skipped" when its update damages a sound model at either LR, or when the batch is noise to
        the model and its update hurts the canary at all; "rollback" when the model was damaged
        before it (see raylm.train.resilience.guard)."""
        guard, state, step = self.guard, self.state, batch.step
        samples = [state.position, batch.next_position]
        before = guard.canary_loss()
        if guard.damaged(before) and not guard.learning():
            guard.trigger.update(canary=before, reference=guard.reference)
            return "rollback"
        if verdict == "nonfinite":
            if guard.nonfinite_in_a_row(step):
                return "rollback"
            guard.skip_batch(step, state, samples, canary=before)
            return "skipped"
        held = guard.hold(state)
        self.optimizer.step()
        after = guard.canary_loss()
        noise = guard.noise(loss)
        if not guard.damaged(after, before, tolerance=0.0 if noise else None):
            guard.hard_batch(step, samples, before, after)
            return "stepped"
        guard.undo(held)
        if noise:
            guard.skip_batch(step, state, samples, canary_before=before, canary_after=after,
                             unigram=guard.unigram)
            return "skipped"
        apply_lr(self.optimizer, self.lr * self.cfg.guard.lr_factor)
        self.optimizer.step()
        cut = guard.canary_loss()
        if guard.helped(cut, before):
            guard.lr_cut(step, state, self.lr, before, cut)
            self.lr *= self.cfg.guard.lr_factor
            return "stepped"
        if not guard.damaged(cut, before):
            guard.hard_batch(step, samples, before, cut, lr_factor=self.cfg.guard.lr_factor)
            self.lr *= self.cfg.guard.lr_factor  # for this step alone
            return "stepped"
        guard.undo(held)
        guard.skip_batch(step, state, samples, canary_before=before, canary_after=after, canary_at_lr_cut=cut)
        return "skipped"

    def _roll_back(self, step: int, consumed_until: int) -> None:
        self._abandon(step)
        self.guard.roll_back(step, self.state, consumed_until, self.lr)
        self.checkpointer.abandon_after(self.state.step)

    def _global_indices(self, batch: Batch) -> list[int]:
        """Every rank's samples of `batch` (this rank holds its share only)."""
        return batch_indices(self.state.position, batch.global_batch, self._skip())[0]

    def _abandon(self, step: int) -> None:
        """The step ends without metrics; the batches go on from the run's state (and skip ranges)."""
        self.optimizer.zero_grad(set_to_none=True)
        for hook in self.hooks:
            hook.on_step_abandoned(self.run, step)

    def forward_backward(self, batch: Batch) -> tuple[float, float]:
        """Forward and backward over this rank's rows, gradients unscaled and clipped; returns
        the loss and the gradient norm, on the host."""
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
        loss = model.forward_backward(tokens, self.cfg.train.micro_batch_size)
        if scaler is not None:
            scaler.unscale(model.parts)
        grad_norm = model.clip_grad_norm(self.cfg.optim.grad_clip)
        # The step's one host sync: the guard judges every step by these two numbers (and without
        # the guard, a non-finite one must stop the step before the optimizer takes it).
        loss_value, norm_value = torch.stack([loss, grad_norm.to(loss.dtype)]).tolist()
        return loss_value, norm_value

    def _verdict(self, step: int, loss: float, grad_norm: float) -> str:
        """"ok", "suspect" or "nonfinite" (the guard's judgement; always "ok" without it, but for a
        non-finite step), "rollback" (fp16's loss scale fell below train.loss_scale_min: a
        divergence), or "overflow": an fp16 overflow of the gradients (a finite loss), which halves
        the loss scale and skips the step."""
        cfg, guard, scaler = self.cfg, self.guard, self.scaler
        if scaler is not None and math.isfinite(loss) and not math.isfinite(grad_norm):
            scaler.update(overflow=True)
            self.state.loss_scale = scaler.scale
            if scaler.scale >= cfg.train.loss_scale_min:
                return "overflow"
            if guard is None:
                raise DivergedError(f"step {step}: the fp16 loss scale fell to {scaler.scale:g}, below "
                                    f"train.loss_scale_min={cfg.train.loss_scale_min:g}: the run diverges")
            guard.loss_scale_floor(loss, scaler.scale, cfg.train.loss_scale_min)
            return "rollback"
        if guard is not None:
            verdict = guard.judge(loss, grad_norm)
        else:
            verdict = "ok" if math.isfinite(loss) and math.isfinite(grad_norm) else "nonfinite"
        if scaler is not None:
            if verdict == "ok":
                scaler.update(overflow=False)
            self.state.loss_scale = scaler.scale
        return verdict

    def _step_metrics(self, batch: Batch, loss: float, grad_norm: float) -> dict:
        state, run = self.state, self.run
        now = time.perf_counter()
        tokens_per_s = batch.global_batch * self.spec.seq_len / (now - self.t0)
        # position: where the next step's samples start, so an audit of metrics.jsonl alone
        # can tell which samples each committed step trained on (resume, resize, skip).
        metrics = {"step": state.step, "loss": loss, "lr": self.lr, "grad_norm": grad_norm,
                   "global_batch": batch.global_batch,
                   "position": state.position, "tokens": state.tokens_seen, "time": time.time(),
                   "step_time": now - self.t0, "data_wait": self.data_wait, "checkpoint_s": self.checkpoint_s,
                   "tokens_per_s": tokens_per_s,
                   "mfu": run.flops_per_token * tokens_per_s / (run.peak_flops * self.world.world_size)}
        self.t0, self.checkpoint_s = now, 0.0
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
            metrics["samples"] = _samples_of_step(self.model.dp_rank, batch.indices)
        return metrics

    def _after_step(self, step: int, metrics: dict, due: frozenset[str]) -> None:
        """Evaluation, the hooks, then a checkpoint or a report to the cluster (`due`: the step
        clock's timers due at this boundary)."""
        cfg, state = self.cfg, self.state
        if self.evals is not None and (state.step == self.last or state.step % cfg.train.eval_every == 0):
            metrics["val_loss"] = self.evals.loss(self.model, cfg.train.micro_batch_size)
            metrics["val_bpb"] = self.evals.bits_per_byte(metrics["val_loss"])
            self.t0 = time.perf_counter()  # evaluation is not step time
        if self.tasks is not None and (state.step == self.last or state.step % cfg.train.eval_tasks.every_steps == 0):
            metrics.update(self.tasks.scores(state.step))
            self.t0 = time.perf_counter()
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
        self.t0 = time.perf_counter()
        self.checkpoint_s = self.t0 - save_start  # outside step_time: reported with the next step
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
            print(f"WARNING: no checkpoint has been written since step {saver.failing_since} "
                  f"({saver.last_error}): this run is not protected against failures "
                  "(checkpoint.allow_failures=true)", flush=True)


def _samples_of_step(dp_rank: int, indices: list[int]) -> list[int]:
    """The global sample indices the whole step trained on. Ranks of one data-parallel rank's
    tensor/pipeline group hold the same rows, so each dp rank's rows count once."""
    if not dist.is_initialized():
        return sorted(indices)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, indices))
    return sorted(i for rows in dict(gathered).values() for i in rows)
