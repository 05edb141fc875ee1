"""The loop's side of the stability guard: its parts built for a rank, and its decisions on a step
the device withheld carried out (`raylm.train.resilience.decisions` decides; this acts).

A withheld step is decided from the model as that step found it: the steps queued behind it were
not applied, and their batches go back to be queued again unless the run goes back.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from raylm.data.order import batch_indices
from raylm.data.stream import Batch
from raylm.errors import DivergedError
from raylm.train.queued import QueuedStep
from raylm.train.resilience.datacheck import DataCheck, data_limit, masking_steps
from raylm.train.resilience.decisions import Action, Decisions
from raylm.train.resilience.guard import MASK_UNTIL, Guard
from raylm.train.resilience.judge import GRAD_NORM, LOSS, MASKED, NOISE_ROWS, StepJudge
from raylm.train.resilience.quarantine import Quarantine
from raylm.train.step import needs_loss_scaling
from raylm.train.validation import ValidationSet, unigram_loss


class GuardedSteps:
    """The guard's part of `raylm.train.loop.Trainer` (the model, optimizer, state, stream and
    hooks are the trainer's)."""

    def _build_guard(self) -> None:
        """The guard and its decisions (guard.enabled), the data check, the device's judge of every
        step, and the quarantine; without the guard, the judge alone (finiteness, fp16's overflow)."""
        cfg, spec, world = self.cfg, self.spec, self.world
        self.guard: Optional[Guard] = None
        self.decisions: Optional[Decisions] = None
        self.data_check: Optional[DataCheck] = None
        self.quarantine: Optional[Quarantine] = None
        if cfg.guard.enabled:
            # Whole micro-batches on every data-parallel rank: the canary runs as an evaluation does.
            unit = self.model.dp_size * cfg.train.micro_batch_size
            canary = ValidationSet(spec, self.model, -(-cfg.guard.canary_rows // unit) * unit, 1, across_split=False)
            self.guard = Guard(cfg, self.model, self.optimizer, world, canary, unigram_loss(spec), self.events_path,
                               self.env.checkpoint_root, self.source.rows, self._rows_per_step())
            self.guard.start(self.state)
            self.decisions = Decisions(self.guard)
            limit, why_off = data_limit(spec.datasets.manifests, spec.datasets.uris, cfg.guard.data_deviations)
            self.data_check = DataCheck(limit, world.device) if limit is not None else None
            # The data check's flags of a step's rows: one slot for each row of the largest global batch.
            self.row_slots = max(spec.batch_schedule.sizes())
            if why_off and world.rank == 0:
                print(f"raylm: guard: {why_off}", flush=True)
            if cfg.guard.quarantine:
                self.quarantine = Quarantine(self.source.order, self.events_path, world.rank)
        self.masked_samples: list[int] = []  # the samples the step being committed left out of its loss
        self.judge = StepJudge(world.device, cfg.guard if self.guard is not None else None,
                               self.guard.unigram if self.guard is not None else None,
                               needs_loss_scaling(cfg), data_check=self.data_check is not None)
        if self.guard is not None:
            self.judge.load(*self.guard.history())

    def _withheld(self, q: QueuedStep, record: list[float], later: list[Batch], wasted: float) -> None:
        """The first step the device withheld (suspect or non-finite), the model as it found it:
        what the guard decides, carried out. `later`: the batches queued behind it, queued again
        unless the run goes back."""
        state, batch = self.state, q.batch
        self.read_each_until = batch.step + self.read_every
        self.judge.resume()
        self._rewind(q)
        if self.decisions is None:  # without the guard, only a non-finite step is withheld
            # Nothing is lost: no update was applied since, and the last checkpoint stands.
            raise DivergedError(
                f"step {batch.step}: loss {record[LOSS]} / grad norm {record[GRAD_NORM]} is not finite; "
                f"the weights were not updated. Samples of this step: global positions [{state.position}, "
                f"{batch.next_position}); skip them with data.skip or lower optim.lr and resume.")
        action = self.decisions.withheld(record, state, batch.step, self._masking_steps())
        if action is Action.RERUN:
            again = self.timeline.read(self._step(batch)[None])[0]
            action, record = self.decisions.rerun(batch.step, record, again), again
        elif action is Action.MASK:
            again = self.timeline.read(self._step(batch)[None])[0]
            action, record = self.decisions.masked(again), again
        elif action is Action.RECOMPUTE_GRADIENTS:
            self.forward_backward(batch)
        if action is Action.COMMIT:
            self.judge.resume()
            self.optimizer.zero_grad(set_to_none=True)
            if self._commit(q, record, *self._handled(q, wasted)):
                self._send_back(later)
            return
        # The batch's samples, for a quarantine, before a skip joins its span to the skip ranges.
        indices = self._global_indices(batch) if self.quarantine is not None else []
        action = self.decisions.probe(batch, state, q.lr, record)
        self.judge.resume()
        self.judge.load(*self.guard.history())
        if action is Action.ROLL_BACK:
            self._roll_back(batch.step, batch.next_position, q.lr)
        elif action is Action.SKIP:
            self._skip_batch(batch, indices, later)
        else:
            if action is Action.KEEP_AT_CUT:
                self.step_lr = self.guard.cut_rate(q.lr)
            self.optimizer.zero_grad(set_to_none=True)
            self._advance(batch, record)
            self._finish(q, record[LOSS], record[GRAD_NORM], *self._handled(q, wasted))
            self._send_back(later)

    def _masking(self, step: int) -> bool:
        """Whether the data check's noise rows are left out of this step's loss: armed by a batch
        a third noise, for the rest of its chunk (`raylm.train.resilience.datacheck`)."""
        return self.data_check is not None and step < self.state.guard.get(MASK_UNTIL, 0)

    def _in_slots(self, rows: torch.Tensor, batch: Batch) -> torch.Tensor:
        """This rank's noise flags (`rows`) in their slots of the global batch, zeros elsewhere: the
        loss's all-reduce averages them into the whole batch's (`_averaged_over` ranks')."""
        first = self._first_row(batch)
        slots = torch.zeros(self.row_slots, device=rows.device)
        slots[first:first + len(rows)] = rows.float()
        return slots

    def _over_rows_kept(self, loss: torch.Tensor, noise: torch.Tensor, batch: Batch) -> torch.Tensor:
        """A masked step's loss, and its gradients in place, as means over the rows kept: each rank's
        were its kept targets' sum over all of its targets (`raylm.train.step.cross_entropy_over_all`)."""
        kept = (1 - noise.sum() / batch.global_batch).clamp(min=1 / batch.global_batch)
        self.model.scale_gradients(1 / kept)
        return loss / kept

    def _first_row(self, batch: Batch) -> int:
        """Where this rank's rows begin in the global batch (each data-parallel rank's a contiguous share)."""
        return self.model.dp_rank * len(batch.indices)

    def _rows_per_step(self) -> int:
        """The rows a step trains on this rank."""
        return self.cfg.train.global_batch_size // self.model.dp_size

    def _judged_samples(self, batch: Batch) -> list[int]:
        """The samples of a step whose rows the guard's `learning()` evaluates again on this rank:
        its share (the evaluation averages the data-parallel ranks')."""
        return batch.indices

    def _averaged_over(self) -> int:
        """How many ranks' values the loss's all-reduce averages."""
        return self.model.dp_size

    def _masking_steps(self) -> int:
        return masking_steps(self.cfg.data.chunk_rows, self.spec.batch_schedule.final)

    def _left_out(self, batch: Batch, record: list[float]) -> None:
        """The rows a committed step left out of its loss (the data check's noise rows, masked):
        their samples join the guard's skips, as a skipped batch's do."""
        self.masked_samples = []
        if record[MASKED] and record[NOISE_ROWS] > 0:
            flags = record[MASKED + 1:MASKED + 1 + batch.global_batch]
            self.masked_samples = [i for i, flag in zip(self._global_indices(batch), flags) if flag]
            self.guard.rows_masked(batch.step, self.state, self.masked_samples)

    def _handled(self, q: QueuedStep, wasted: float) -> tuple[float, float]:
        """A withheld step's time, up to the host's decision, less the steps computed in vain behind it."""
        end = self.timeline.mark()
        step_time = self.timeline.seconds(self.last_mark, end) - wasted
        self.last_mark = end
        return step_time, time.time()

    def _skip_batch(self, batch: Batch, indices: list[int], later: list[Batch]) -> None:
        """The step is trained on the batches after it: as if data.skip held its batch (`indices`:
        its samples, for the quarantine)."""
        state = self.state
        if self.quarantine is not None:
            self.quarantine.add(state, indices, batch.next_position, self._remaining_samples(),
                                [*self.cfg.data.skip, *state.skip])
        self._abandon(batch.step)
        self._discard()
        if self._stream_goes_on(batch):
            self.behind += 1
            self._send_back(later)
        else:
            self._restart_stream()

    def _roll_back(self, step: int, consumed_until: int, lr: float) -> None:
        self._abandon(step)
        self.guard.roll_back(step, self.state, consumed_until, lr)
        self._weights_changed()
        self.checkpointer.abandon_after(self.state.step)
        self.judge.resume()
        self.judge.load(*self.guard.history())
        self._discard()
        self._restart_stream()

    def _discard(self) -> None:
        """The time since the last committed step went to steps no kept step holds."""
        now = self.timeline.mark()
        self.discarded_s += self.timeline.seconds(self.last_mark, now)
        self.last_mark = now

    def _global_indices(self, batch: Batch) -> list[int]:
        """Every rank's samples of `batch` (this rank holds its share only)."""
        return batch_indices(self.state.position, batch.global_batch, self._skip())[0]

    def _abandon(self, step: int) -> None:
        """The step ends without metrics; the batches go on from the run's state (and skip ranges)."""
        self.optimizer.zero_grad(set_to_none=True)
        for hook in self.hooks:
            hook.on_step_abandoned(self.run, step)
