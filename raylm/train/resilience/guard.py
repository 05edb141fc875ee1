"""The stability guard: what OPT's and PaLM's teams did by hand when a run diverged, deciding by
the model, not by the batch alone.

A loss spike says only that a batch is strange to the model; it cannot tell hard data (a new
domain, a mixture boundary) from a damaged model. So the guard asks the model: the loss of a
fixed canary batch from the validation split (in eval mode, a pure function of the weights), and
whether it still does better on the batches it just trained on than it did before training on
them ("learning": true of a model meeting a new domain, false of a damaged one or of one whose
steps are too large to learn from). `Guard` holds that evidence (the rolling history, the canary,
the snapshot) and records what is decided; `raylm.train.resilience.decisions` walks the decision
tree below and tells the loop what to do.

- A step whose loss and gradient norm are within `sigmas` deviations of recent healthy steps
  trains as usual, unless its batch is noise to the model (below). That judgement is taken on the
  device (`raylm.train.resilience.judge`), which withholds a suspect step's update until the loop
  reads it; what follows is the host's, from the model as the suspect step found it.
- A suspect step (beyond them): the canary before the update, then after it. Sound (the canary
  rose by less than `damage` from before the update): hard data, trained on (`hard_batch`), its
  loss and gradient norm part of the recent steps from then on (a new kind of text soon stops
  looking strange). Damaged: the update is undone and tried again at the LR cut by
  `lr_factor`. If the smaller update helps the canary, it is kept and the LR is capped there
  (`lr_cut`: the update was too large for the model as it was). If it hurts the canary by less
  than `damage`, it is kept for this step alone (hard data, `hard_batch`). Otherwise the data
  damages a sound model: that one batch is skipped (`batch_skipped`). A batch that is noise to a
  model past the unigram level (its loss above the loss of token frequencies alone: random
  bytes, a broken shard) is held to a stricter test: an update that hurts the canary at all is
  undone and the batch skipped, at any LR.
- Before any model can judge: a batch a third of whose rows are noise by the dataset's own
  statistics (`raylm.train.resilience.datacheck`) arms, from step 0 and without the canary, the
  masking of noise rows for the rest of its chunk (`noise_masking`): their samples are left out of
  the loss (`rows_masked`), the clean rows beside them trained on; a batch of noise alone is
  skipped (`batch_skipped`, reason OFF_DATA). At the unigram level the canary cannot tell noise
  from learning, and the noise test above does not apply.
- A non-finite loss or gradient: the step is computed again (the loop does); finite then, it was
  a transient fault (`rerun`). Non-finite again on a sound model: the batch is skipped. When the
  next batch, at the same step, fails twice too, the model or its LR is at fault, not the data
  (at too high an LR every batch fails, and skipping them would feed the guard the dataset): the
  run is rolled back with its LR cut, as below.
- Every `snapshot_every` steps (by default spaced so that their canary passes cost at most 1%
  of the training) a check: a canary that is the best so far becomes the snapshot to return to.
  A model found damaged (its canary `damage` above the snapshot's, at a check or before a
  suspect update), and not learning, is rolled back to the snapshot (`rollback`),
  leaving out the strange batches it trained on since (the prime suspects), or, when there were
  none, with the LR capped at the cut.
  A canary above the snapshot's while the model learns is a shift in the data: trained on
  (`canary_drift`), and the new snapshot. A rollback to the same snapshot as the previous one
  (the run never passed a check in between) is at the same place: it skips all the data since
  the snapshot (PaLM's remedy) and cuts the LR; `max_rollbacks` there in a row stop the run
  (`GuardStopped`, deterministic: no restart replays it), leaving a marker that a resume with the
  same settings respects.
- A run stalled at the unigram level (past its warmup, `window` healthy steps whose training loss
  sits near the loss of token frequencies alone and no longer falls: OPT's divergences, a run at
  too high an LR) is rolled back to its snapshot with its whole LR schedule scaled by `lr_factor`,
  skipping nothing; `max_rollbacks` such stalls stop the run.

Every skipped sample joins the run's skip ranges (`TrainState.skip`, which the data order leaves
out) and an event; a clean run skips nothing. The rows of a skipped batch are quarantined: left out
unjudged when they come round in a later epoch (`raylm.train.resilience.quarantine`). A cut caps the LR below the rate that did the
damage: the schedule runs on beneath the cap, so a decaying schedule soon trains as it would
have. The skip ranges, the LR cap and ceiling, the rollbacks and the rolling history are run
state: checkpoints carry them, so a resumed run takes the decisions the uninterrupted one would
have taken.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from raylm.config import Config
from raylm.data import storage
from raylm.data.order import merge_ranges
from raylm.parallel.world import World
from raylm.train.observe.records import append_event
from raylm.train.optim import unique_parameters
from raylm.train.resilience import judge
from raylm.train.resilience.guard_stop import STOP_MARKER, GuardStopped, intervention_settings
from raylm.train.resilience.snapshot import Evidence, Snapshot, copy_state
from raylm.train.state import TrainState
from raylm.train.step import ParallelModel
from raylm.train.validation import ValidationSet


RECENT_STEPS = 4  # healthy steps whose batches tell whether the model still learns
# A run stalled by too high an LR trains at 89-99% of the unigram loss past its warmup (the nanoGPT
# config at 0.05 and 0.1, `guard.window` steps after the warmup); healthy ones at 77% (at 1e-3 and
# 0.025) and falling; random bytes at 137% (noise, not a stall).
STALL_LEVEL = (0.85, 1.1)
# Checks (guard.snapshot_every=0) every CHECK_STEPS steps, or further apart where their canary
# pass would cost more than CHECK_SHARE of the training compute.
CHECK_STEPS = 25
CHECK_SHARE = 0.01
STALL_PROGRESS = 0.01  # the later half of the window no better than the earlier by this much: stalled
STALLED = "stalled at the unigram level"
NONFINITE_IN_A_ROW = "non-finite on consecutive batches"
OFF_DATA = "noise by the data check"  # a third of its rows beyond the dataset's own (from step 0)
MASK_UNTIL = "mask_noise_until"  # TrainState.guard's: the steps before it leave the data check's noise rows out


class Guard:
    """The guard's evidence and its record of what was decided (see the module docstring)."""

    def __init__(self, run_cfg: Config, model: ParallelModel, optimizer: torch.optim.Optimizer, world: World,
                 canary: ValidationSet, unigram: Optional[float], events_path: str, run_uri: str,
                 read_rows: Callable[[list[int]], np.ndarray], rows_per_step: int):
        """`read_rows`: token rows by global sample index; `rows_per_step`: a step's rows on this rank."""
        self.run_cfg, self.cfg, self.optimizer, self.world = run_cfg, run_cfg.guard, optimizer, world
        self.model, self.canary, self.read_rows = model, canary, read_rows
        self.unigram = unigram  # the data's unigram loss (validation.unigram_loss)
        self.events_path, self.run_uri = events_path, run_uri
        self.params = unique_parameters(model.parts)
        # The z-scores' history: the steps trained on as judged (healthy steps and hard batches).
        self.losses: deque = deque(maxlen=self.cfg.window)
        self.norms: deque = deque(maxlen=self.cfg.window)
        # The healthy steps' losses alone: where the run stands against the unigram level.
        self.healthy_losses: deque = deque(maxlen=self.cfg.window)
        self.snapshot: Optional[Snapshot] = None
        self.reference = math.inf  # the canary loss of the snapshot: the best so far
        # The invocation's start and its canary, kept while the best snapshot is at the unigram level:
        # a run stalled from its warmup on has learned nothing to go back to but its start.
        self.origin: Optional[tuple[Snapshot, float]] = None
        # The samples (global indices) and loss of the last healthy steps: does the model still learn?
        self.recent: deque = deque(maxlen=RECENT_STEPS)
        # Sample ranges of the strange batches trained on since the snapshot: the prime suspects
        # when the model is found damaged.
        self.suspects: list[list[int]] = []
        self.trigger: dict = {}  # why the step in hand is not healthy
        self.nonfinite_skipped_at: Optional[int] = None  # the step whose batch was skipped as non-finite
        self.busy_s = 0.0  # the guard's own work (canary losses, snapshots) since the last `spent()`
        self.checks_by_cost = check_interval(canary, rows_per_step)

    # -- history ------------------------------------------------------------------------------

    def start(self, state: TrainState, peer: Optional[Evidence] = None) -> None:
        """Take up the history a resumed run saved, and keep the starting point as the first
        snapshot; or, in a replica group that heals, the `peer`'s evidence (`evidence()`)."""
        saved = state.guard
        for history, key in zip(self.history(), ("losses", "norms", "healthy_losses")):
            history.clear()
            history.extend(saved.get(key, saved.get("losses", []) if key == "healthy_losses" else []))
        if peer is None:  # the uninterrupted run's reference, so that a resumed run judges as it would have
            snapshot, canary = Snapshot.take(state, self.params, self.optimizer), self.canary_loss()
            reference = saved.get("canary_reference") or canary
            peer = Evidence(snapshot, reference, (snapshot, canary) if self.at_unigram_level(reference) else None, [], [])
        self.snapshot, self.reference, self.origin = peer.snapshot, peer.reference, peer.origin
        self.recent.clear()
        self.recent.extend(peer.recent)
        self.suspects = peer.suspects
        self.busy_s = 0.0  # start-up, not a step's

    def evidence(self) -> Evidence:
        """What a replica group that heals from this one takes (`start`)."""
        return Evidence(self.snapshot, self.reference, self.origin, list(self.recent), self.suspects)

    @contextmanager
    def _working(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - start

    def spent(self) -> float:
        """Seconds of the guard's own work since the last call: its cost, within the step times."""
        spent, self.busy_s = self.busy_s, 0.0
        return spent

    def save_history(self, state: TrainState) -> None:
        """Put the rolling history into `state`, for a checkpoint."""
        state.guard = {**state.guard, "losses": list(self.losses), "norms": list(self.norms),
                       "healthy_losses": list(self.healthy_losses),
                       "canary_reference": self.reference}

    # -- judging ------------------------------------------------------------------------------

    def withheld(self, record: list[float]) -> None:
        """Why the device withheld a step (its `raylm.train.resilience.judge` record): the trigger
        its events name."""
        loss, grad_norm = record[judge.LOSS], record[judge.GRAD_NORM]
        if record[judge.VERDICT] == judge.Verdict.NONFINITE:
            self.trigger = {"reason": "non-finite", "loss": loss, "grad_norm": grad_norm}
        elif record[judge.OFF_DATA]:  # the data check (raylm.train.resilience.datacheck): the model not asked
            self.trigger = {"reason": OFF_DATA, "loss": loss, "grad_norm": grad_norm}
        elif record[judge.NOISE]:  # early in training the spread of falling losses hides it from a z-score
            self.trigger = {"reason": "noise", "loss": loss, "grad_norm": grad_norm, "unigram": self.unigram}
        else:
            scores = {"loss": record[judge.LOSS_SIGMAS], "grad_norm": record[judge.GRAD_NORM_SIGMAS]}
            worst = max(scores, key=scores.get)
            self.trigger = {"reason": f"{worst} spike", "loss": loss, "grad_norm": grad_norm,
                            "sigmas": round(scores[worst], 2)}

    @property
    def past_unigram(self) -> bool:
        """Whether the snapshot's canary says the model has learned more than token frequencies."""
        return not self.at_unigram_level(self.reference)

    def history(self) -> tuple[deque, deque, deque]:
        """The rolling history the device judges against (`StepJudge.load`)."""
        return self.losses, self.norms, self.healthy_losses

    def canary_loss(self) -> float:
        with self._working():
            return self.canary.loss(self.model, self.run_cfg.train.micro_batch_size)

    def damaged(self, canary: float, before: Optional[float] = None, tolerance: Optional[float] = None) -> bool:
        """Whether a canary loss says the model is damaged: `damage` (or `tolerance`) above the
        best snapshot's, or above `before` (the canary before the update being judged: that
        update did the damage).
        A snapshot still at the unigram level holds nothing learned to lose: early training
        spikes and recovers on its own (Adam's first steps), and a run that never leaves that
        level is `at_unigram_level`'s to find."""
        if not math.isfinite(canary):
            return True
        if before is None and self.at_unigram_level(self.reference):
            return False
        bound = self.reference if before is None else before
        return canary > bound * (1 + (self.cfg.damage if tolerance is None else tolerance))

    def learning(self) -> bool:
        """Whether the model does better on the batches of its last healthy steps than it did when
        it trained on them. A model that forgets the canary while it learns new data (a domain, a
        mixture's component) does; a damaged one, or one whose steps are too large to learn from,
        does not. A data-parallel rank evaluates its share of the steps (`healthy`'s samples), the
        evaluation averaging the shares; a replica group, without that collective, the whole steps."""
        if not self.recent:
            return False
        mbs = self.run_cfg.train.micro_batch_size
        device = self.model.world.device
        with self._working():
            self.model.train(False)
            try:
                now = [float(self.model.eval_loss(torch.from_numpy(self.read_rows(samples).astype(np.int64))
                                                  .to(device), mbs)) for samples, _ in self.recent]
            finally:
                self.model.train(True)
        return sum(now) < sum(loss for _, loss in self.recent)

    def at_unigram_level(self, canary: float) -> bool:
        return judge.at_unigram_level(canary, self.unigram)

    def helped(self, canary: float, before: float) -> bool:
        """Whether an update left the canary no worse than `before` it."""
        return math.isfinite(canary) and canary <= before

    def loss_scale_floor(self, loss: float, scale: float, minimum: float) -> None:
        """fp16's scale fell below its floor: overflow after overflow is a divergence."""
        self.trigger = {"reason": "loss-scale floor", "loss": loss, "loss_scale": scale, "loss_scale_min": minimum}

    def hold(self, state: TrainState) -> Snapshot:
        """The state before a suspect update, to undo it."""
        with self._working():
            return Snapshot.take(state, self.params, self.optimizer)

    def undo(self, held: Snapshot) -> None:
        with self._working():
            held.restore(self.params, self.optimizer)

    # -- after each step ----------------------------------------------------------------------

    def healthy(self, state: TrainState, loss: float, grad_norm: float, samples: list[int]) -> bool:
        """A step trained on (`samples`: its rows, for `learning`): its history, the LR's recovery, and
        every `check_every()` steps a check: False when the model is damaged and does not learn (roll
        back then); otherwise a new best, or a canary that drifted while the model learns, becomes the snapshot."""
        self.losses.append(loss)
        self.norms.append(grad_norm)
        self.healthy_losses.append(loss)
        self.recent.append((samples, loss))
        self._recover_lr(state)
        if state.step % self.check_every():
            return True
        canary = self.canary_loss()
        damaged = self.damaged(canary)
        if damaged and not self.learning():
            self.trigger = {"reason": "canary drift", "canary": canary, "reference": self.reference,
                            "unigram": self.unigram}
            return False
        stalled = self.stalled(state)
        if stalled is not None:
            self.trigger = {"reason": STALLED, "canary": canary, "reference": self.reference,
                            "recent_loss": stalled, "unigram": self.unigram}
            return False
        state.guard = {k: v for k, v in state.guard.items() if k != "rolled_back_to"}  # it moved on
        if damaged:  # it learns new data (a domain, a mixture's component) and forgets some of the canary
            self._event("canary_drift", step=state.step, canary=canary, reference=self.reference)
        if damaged or canary <= self.reference:  # the point to return to: the best, or the data's new normal
            with self._working():
                self.snapshot, self.reference = Snapshot.take(state, self.params, self.optimizer), canary
            self.suspects = []
            if not self.at_unigram_level(canary):
                self.origin = None
        return True

    def check_every(self) -> int:
        """Steps between checks: `snapshot_every`, or by default spaced by their cost."""
        return self.cfg.snapshot_every or self.checks_by_cost

    def stalled(self, state: TrainState) -> Optional[float]:
        """The median loss of the last `window` healthy steps when the run has stalled at the
        unigram level: past its warmup (and its last stall), it lies within STALL_LEVEL of the loss
        of token frequencies alone, and the median of their later half is no better than that of
        their earlier one. A run at too high an LR does that for as long as the LR stays high
        (OPT's divergences); a healthy one, or one meeting a new domain, trains well below that
        level or falls. Medians, so that batches of noise among them (random bytes, far above the
        level) do not make a stall; the training losses judge, not the canary: a canary drawn from
        a mixture sits near its unigram level while the model trains on one component. None
        otherwise."""
        window, unigram = self.cfg.window, self.unigram
        start = max(self.run_cfg.schedule.warmup_steps, state.guard.get("stall_from", 0))
        if not unigram or state.step < start + window or len(self.healthy_losses) < window:
            return None
        recent = list(self.healthy_losses)
        half = len(recent) // 2
        level = statistics.median(recent)
        low, high = STALL_LEVEL
        stalled = low * unigram < level <= high * unigram and \
            statistics.median(recent[half:]) >= statistics.median(recent[:half]) * (1 - STALL_PROGRESS)
        return level if stalled else None

    def recovering(self, state: TrainState) -> bool:
        """Whether the LR cap climbs back at each healthy step (guard.lr_recovery_steps): then each
        step's LR depends on the verdict of the step before it."""
        ceiling = state.guard.get("lr_ceiling")
        return state.lr_cap is not None and ceiling is not None and bool(self.cfg.lr_recovery_steps) \
            and state.lr_cap < ceiling

    def _recover_lr(self, state: TrainState) -> None:
        if not self.recovering(state):
            return
        rate = (1 / self.cfg.lr_factor) ** (0.5 / self.cfg.lr_recovery_steps)  # half the cut, in log space
        state.lr_cap = min(state.guard["lr_ceiling"], state.lr_cap * rate)

    # -- actions ------------------------------------------------------------------------------

    def hard_batch(self, step: int, samples: list[int], before: float, after: float, at_cut: bool = False) -> None:
        """A strange batch trained on (`at_cut`: at the LR cut, for this step alone). Unless it
        is noise, its loss and gradient norm join the history the z-scores are taken from: text
        of a new kind is the data's new normal, and judged against the old kind alone every batch
        of it was probed (24% of a contiguous run's step time went to the guard)."""
        self.suspects.append(samples)
        if self.trigger.get("reason") != "noise":
            self.losses.append(self.trigger["loss"])
            self.norms.append(self.trigger["grad_norm"])
        self._event("hard_batch", step=step, samples=samples, canary_before=before, canary_after=after,
                    lr_factor=self.cfg.lr_factor if at_cut else 1.0, **self.trigger)

    def lr_cut(self, step: int, state: TrainState, lr: float, before: float, after: float) -> None:
        """The update at the cut of `lr` helped the model: keep the cut."""
        self._cut(state, lr)
        self._event("lr_cut", step=step, lr_cap=state.lr_cap, canary_before=before, canary_after=after,
                    **self.trigger)

    def rerun(self, step: int, first: dict) -> None:
        self._event("rerun", step=step, first=first)

    def nonfinite_in_a_row(self, step: int) -> bool:
        """Whether the batch before this twice non-finite one was skipped as such at the same step
        (a step does not advance past a skipped batch): then the model is at fault, not the data."""
        if self.nonfinite_skipped_at != step:
            self.nonfinite_skipped_at = step
            return False
        self.trigger["reason"] = NONFINITE_IN_A_ROW
        return True

    def skip_batch(self, step: int, state: TrainState, samples: list[int], **detail: float) -> None:
        """The batch damages a healthy model (or fails twice): its samples are left out."""
        state.skip = merge_ranges([*state.skip, samples])
        self._event("batch_skipped", step=step, samples=samples, skipped_samples=skipped_samples(state),
                    **{**self.trigger, **detail})
        self._say(f"{self.trigger.get('reason')} at step {step}; skipped samples [{samples[0]}, {samples[1]})")

    def mask_noise(self, step: int, state: TrainState, until: int, share: float) -> None:
        """A batch `share` noise by the data check: its noise rows and those of the steps before
        `until` are left out of the loss (what the data is does not roll back)."""
        armed = step < state.guard.get(MASK_UNTIL, 0)
        state.guard[MASK_UNTIL] = max(until, state.guard.get(MASK_UNTIL, 0))
        self._event("noise_masking", step=step, until=state.guard[MASK_UNTIL], noise_share=share)
        if not armed:  # once a window: its batches of noise alone say their skips
            self._say(f"{OFF_DATA} at step {step} ({share:.0%} of the batch): its noise rows and those of the "
                      f"steps before {state.guard[MASK_UNTIL]} are left out of the loss")

    def rows_masked(self, step: int, state: TrainState, samples: list[int]) -> None:
        """A committed step left the rows at these global positions out of its loss."""
        state.skip = merge_ranges([*state.skip, *([i, i + 1] for i in samples)])
        self._event("rows_masked", step=step, samples=samples, skipped_samples=skipped_samples(state))

    def roll_back(self, step: int, state: TrainState, consumed_until: int, lr: float) -> None:
        """Restore the snapshot into `state` (in place) and the model. What is left out: the
        strange batches trained on since the snapshot, if any (the prime suspects); else the LR is
        cut (nothing but the step size to blame). At the same place as the previous rollback (back
        to the same snapshot: the run never passed a check since) both were not enough: the data
        since the snapshot is skipped (PaLM) and the LR cut; `max_rollbacks` there in a row stop
        the run. A run that passes a check has moved on: its next rollback starts afresh.
        A run stalled at the unigram level skips nothing (no data is to blame): its whole schedule
        is scaled by `lr_factor` (OPT's restarts at a lower LR; the warmup and the decay kept),
        and its recent history, trained at the rate that stalled it, is dropped; `max_rollbacks`
        stalls stop it. A run that has not left the unigram level since its start goes back to it."""
        stall = self.trigger.get("reason") == STALLED
        snap = self.snapshot
        if stall and self.origin is not None:  # it never left the unigram level: back to its start
            snap, self.reference = self.origin
        same_place = not stall and bool(state.rollbacks) and state.guard.get("rolled_back_to") == snap.state.step
        streak = state.guard.get("rollback_streak", 0) + 1 if same_place else 1
        stalls = state.guard.get("stalls", 0) + stall
        if streak > self.cfg.max_rollbacks:
            self._stop(step, state, f"{streak - 1} rollback(s) in a row at the same place (at steps "
                                    f"{state.rollbacks[-(streak - 1):]})")
        if stalls > self.cfg.max_rollbacks:
            self._stop(step, state, f"{stalls - 1} rollback(s) of a run stalled at the unigram level, its LR "
                                    f"scaled to {state.lr_scale:.3g} of the schedule")
        left_out = [] if stall else [[snap.state.position, consumed_until]] if same_place else list(self.suspects)
        restored = copy_state(snap.state)
        restored.rollbacks = [*state.rollbacks, step]
        restored.skip = merge_ranges([*state.skip, *left_out])
        restored.quarantine = state.quarantine  # what the data is does not roll back
        restored.lr_cap = min((c for c in (state.lr_cap, snap.state.lr_cap) if c is not None), default=None)
        restored.lr_scale = min(state.lr_scale, snap.state.lr_scale) * (self.cfg.lr_factor if stall else 1.0)
        restored.guard = {**state.guard, "rollback_streak": streak, "rolled_back_to": snap.state.step,
                          "stalls": stalls}
        if stall:
            restored.guard["stall_from"] = snap.state.step
            restored.guard.pop("rolled_back_to")
            self.losses.clear()
            self.norms.clear()
            self.healthy_losses.clear()
        with self._working():
            snap.restore(self.params, self.optimizer)
        self.recent.clear()  # trained on by weights that are gone
        self.suspects = []
        self.nonfinite_skipped_at = None
        for name, value in vars(restored).items():
            setattr(state, name, value)
        cut = stall or same_place or not left_out  # a stall's cut is the schedule's scale
        if cut and not stall:
            self._cut(state, lr)
        self.snapshot = dataclasses.replace(snap, state=copy_state(state))
        self._event("rollback", step=step, to_step=state.step, lr_cap=state.lr_cap, lr_scale=state.lr_scale,
                    lr_cut=cut, skipped=left_out, skipped_samples=skipped_samples(state), **self.trigger)
        cap = f", LR at most {state.lr_cap:.3g}" if state.lr_cap is not None else ""
        cap += f", the LR schedule scaled by {state.lr_scale:.3g}" if stall else ""
        self._say(f"{self.trigger.get('reason')} at step {step}; rolled back to step {state.step}{cap}"
                  + (f", skipping samples {left_out}" if left_out else ""))

    def cut_rate(self, lr: float) -> float:
        """`lr` cut by guard.lr_factor: the rate a probe tries after an update at `lr` damaged the
        model, and the cap a cut sets."""
        return lr * self.cfg.lr_factor

    def _cut(self, state: TrainState, lr: float) -> None:
        """Cap the LR below `lr`, the rate that did the damage: the schedule runs on beneath the cap
        (a decaying schedule soon passes under it), which may climb back to halfway, in log space,
        to `lr` (guard.lr_recovery_steps), never to it."""
        cap = self.cut_rate(lr)
        state.lr_cap = cap if state.lr_cap is None else min(state.lr_cap, cap)
        state.guard = {**state.guard, "lr_ceiling": lr * math.sqrt(self.cfg.lr_factor)}

    def _stop(self, step: int, state: TrainState, after: str) -> None:
        message = (f"the stability guard stopped the run at step {step} ({self.trigger.get('reason')}: loss "
                   f"{self.trigger.get('loss')}, grad norm {self.trigger.get('grad_norm')}) after "
                   f"{after}; skipped "
                   f"sample ranges {state.skip}, LR cap {state.lr_cap} (guard.lr_factor={self.cfg.lr_factor}). "
                   "Tried: judging each strange step by the canary, undoing damaging updates, cutting the LR, "
                   "rolling back to healthy snapshots and skipping the data since. Resume with a lower "
                   "optim.lr, other data.skip ranges, a tighter optim.grad_clip or other guard settings; the "
                   f"run directory holds {STOP_MARKER} until then")
        self._event("guard_stopped", step=step, rollbacks=state.rollbacks, skip=state.skip, message=message,
                    **self.trigger)
        if self.world.rank == 0:
            marker = {"step": step, "message": message, "settings": intervention_settings(self.run_cfg)}
            storage.write_bytes(storage.join(self.run_uri, STOP_MARKER), json.dumps(marker).encode(),
                                self.run_cfg.storage)
        raise GuardStopped(message)

    def _event(self, name: str, **fields) -> None:
        if self.world.rank == 0:
            append_event(self.events_path, {"event": name, "time": time.time(), **fields})

    def _say(self, what: str) -> None:
        if self.world.rank == 0:
            print(f"raylm: guard: {what}", flush=True)


def check_interval(canary: ValidationSet, rows_per_step: int) -> int:
    """Steps between checks by their cost: a check is a forward pass over the canary's rows, a
    step a forward and a backward (about three forwards) over `rows_per_step`, on each rank."""
    rows = sum(len(batch) for batch in canary.batches)
    return max(CHECK_STEPS, math.ceil(rows / (3 * rows_per_step * CHECK_SHARE)))


def skipped_samples(state: TrainState) -> int:
    """Samples the guard has left out so far (its skip ranges; data.skip is the user's)."""
    return sum(end - start for start, end in state.skip)
