"""The stability guard's decisions, each an `Action` the loop carries out.

The guard (`raylm.train.resilience.guard`) holds the evidence (the rolling history, the canary,
the snapshot) and records what was decided (events, skip ranges, the LR cap); `Decisions` walks
its decision tree, so that the loop only does what an action says:

- A step the device withheld (`withheld`): a non-finite one is computed again (RERUN), and a
  transient fault then passes (`rerun`: COMMIT); a suspect one has its gradients computed again
  for the probe (RECOMPUTE_GRADIENTS), unless the data check judged its batch: that arms the
  masking of noise rows, and the step is computed again without them (MASK; `masked`: COMMIT),
  or, all of its rows noise, skipped without the canary (PROBE).
- The probe (`probe`), by the canary before and after the update: KEEP it, KEEP_AT_CUT (the
  update at the LR cut by guard.lr_factor), SKIP the batch, or ROLL_BACK a damaged model.
- A step trained on (`trained`): COMMIT, or ROLL_BACK where a check finds the model damaged;
  fp16's loss scale below its floor (`loss_scale_floor`): ROLL_BACK.
"""

from __future__ import annotations

import enum
from typing import Optional

from raylm.data.stream import Batch
from raylm.parallel.float8 import after_optimizer_step
from raylm.train.optim import apply_lr
from raylm.train.resilience.guard import Guard
from raylm.train.resilience.judge import GRAD_NORM, LOSS, NOISE, NOISE_ROWS, OFF_DATA, VERDICT, Verdict
from raylm.train.resilience.snapshot import Snapshot
from raylm.train.state import TrainState


class Action(enum.Enum):
    RERUN = "rerun"  # compute the step again from its RNG, judged again
    MASK = "mask"  # compute the step again from its RNG, its noise rows left out of the loss, judged again
    RECOMPUTE_GRADIENTS = "recompute gradients"  # the withheld update's gradients again, for the probe
    PROBE = "probe"  # the canary judges the step (`Decisions.probe`)
    COMMIT = "commit"  # the step is the run's, as any step the device applied
    KEEP = "keep"  # the probed update stands
    KEEP_AT_CUT = "keep at cut"  # the probed update at the cut LR stands; the step's LR is that
    SKIP = "skip"  # the batch is left out: the step trains on the batches after it
    ROLL_BACK = "roll back"  # the model goes back to the guard's snapshot


class Decisions:
    """The guard's decision tree (see the module docstring). Probing takes and undoes updates on
    the guard's model and optimizer; the loop does the rest of what an action says."""

    def __init__(self, guard: Guard):
        self.guard = guard

    def withheld(self, record: list[float], state: TrainState, step: int, masking_steps: int) -> Action:
        """A step the device withheld (its `raylm.train.resilience.judge` record): RERUN, MASK,
        RECOMPUTE_GRADIENTS or PROBE. Data off the dataset's distribution arms the masking of
        noise rows for `masking_steps` (`raylm.train.resilience.datacheck.masking_steps`)."""
        self.guard.withheld(record)
        if record[VERDICT] == Verdict.NONFINITE:
            return Action.RERUN
        if not record[OFF_DATA]:
            return Action.RECOMPUTE_GRADIENTS
        self.guard.mask_noise(step, state, step + masking_steps, record[NOISE_ROWS])
        # A batch of noise alone is skipped without a probe: no gradients needed.
        return Action.PROBE if record[NOISE_ROWS] >= 1.0 else Action.MASK

    def masked(self, again: list[float]) -> Action:
        """A step computed again without its noise rows: COMMIT, or PROBE where it is suspect still
        (the rows kept spike) or not finite."""
        if again[VERDICT] == Verdict.OK:
            return Action.COMMIT
        self.guard.withheld(again)
        return Action.PROBE

    def rerun(self, step: int, first: list[float], again: list[float]) -> Action:
        """A non-finite step computed again: finite then, a transient fault (COMMIT, or PROBE where
        it is suspect); non-finite again, PROBE."""
        if again[VERDICT] != Verdict.NONFINITE:
            self.guard.rerun(step, {"loss": first[LOSS], "grad_norm": first[GRAD_NORM]})
        if again[VERDICT] in (Verdict.SUSPECT, Verdict.NONFINITE):
            self.guard.withheld(again)
            return Action.PROBE
        return Action.COMMIT

    def probe(self, batch: Batch, state: TrainState, lr: float, record: list[float]) -> Action:
        """A suspect (or twice non-finite) step, judged by the canary: KEEP or KEEP_AT_CUT when
        its update is trained on, at the LR or at the cut (not one for the healthy history: a
        strange batch); SKIP when its update damages a sound model at either LR, or when the batch
        is noise to the model and its update hurts the canary at all; ROLL_BACK when the model was
        damaged before it (see raylm.train.resilience.guard). The gradients are the step's."""
        guard, step = self.guard, batch.step
        samples = [state.position, batch.next_position]
        if record[OFF_DATA]:  # the data judged, not the model: no canary
            guard.skip_batch(step, state, samples, noise_share=record[NOISE_ROWS])
            return Action.SKIP
        before = guard.canary_loss()
        if guard.damaged(before) and not guard.learning():
            guard.trigger.update(canary=before, reference=guard.reference)
            return Action.ROLL_BACK
        if record[VERDICT] == Verdict.NONFINITE:
            if guard.nonfinite_in_a_row(step):
                return Action.ROLL_BACK
            guard.skip_batch(step, state, samples, canary=before)
            return Action.SKIP
        held = guard.hold(state)
        self._update()
        after = guard.canary_loss()
        noise = bool(record[NOISE])
        if not guard.damaged(after, before, tolerance=0.0 if noise else None):
            guard.hard_batch(step, samples, before, after)
            return Action.KEEP
        self._undo(held)
        if noise:
            guard.skip_batch(step, state, samples, canary_before=before, canary_after=after, unigram=guard.unigram)
            return Action.SKIP
        self._update(guard.cut_rate(lr))
        cut = guard.canary_loss()
        if guard.helped(cut, before):
            guard.lr_cut(step, state, lr, before, cut)
            return Action.KEEP_AT_CUT
        if not guard.damaged(cut, before):
            guard.hard_batch(step, samples, before, cut, at_cut=True)  # the cut for this step alone
            return Action.KEEP_AT_CUT
        self._undo(held)
        guard.skip_batch(step, state, samples, canary_before=before, canary_after=after, canary_at_lr_cut=cut)
        return Action.SKIP

    def trained(self, state: TrainState, loss: float, grad_norm: float, samples: list[int]) -> Action:
        """A step the device applied as healthy: COMMIT, or ROLL_BACK where the guard's check finds
        the model drifted since its snapshot (`Guard.healthy`)."""
        return Action.COMMIT if self.guard.healthy(state, loss, grad_norm, samples) else Action.ROLL_BACK

    def loss_scale_floor(self, loss: float, scale: float, minimum: float) -> Action:
        """fp16's scale fell below its floor: overflow after overflow is a divergence."""
        self.guard.loss_scale_floor(loss, scale, minimum)
        return Action.ROLL_BACK

    def _update(self, lr: Optional[float] = None) -> None:
        """The step's update, from its gradients (at `lr` where given)."""
        if lr is not None:
            apply_lr(self.guard.optimizer, lr)
        self.guard.optimizer.step()
        after_optimizer_step(self.guard.model.parts)

    def _undo(self, held: Snapshot) -> None:
        self.guard.undo(held)
        after_optimizer_step(self.guard.model.parts)
