"""Ray Tune's search and early stopping, per rung.

Learning rates only compete within a rung (one size at one budget): a smaller model at the same
point of its budget is worse whatever its learning rate, so one ASHA over all trials would stop
the small sizes. `RungASHA` keeps one ASHA per rung. `RungSearcher` hands out the trials: the
k-th candidate of every rung before the (k+1)-th of any (so ASHA and Optuna see earlier results
of a rung when its later candidates run), costliest rungs first within a round.
`EndOnDeterministicError` ends a phase at the first trial error that no retry cures.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
from dataclasses import dataclass
from typing import Optional

import numpy as np
import ray.cloudpickle as cloudpickle
from ray import tune
from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler
from ray.tune.search import Searcher

from raylm.errors import DeterministicError
from raylm.sweep.config import SweepConfig
from raylm.sweep.ladder import Rung, lr_values

METRIC, MODE = "val_loss", "min"
PROGRESS = "progress"  # fraction of the trial's budget trained: ASHA's time axis, the same for every rung


@dataclass(frozen=True)
class RungSlot:
    rung: str
    lr_scale: float
    lr: Optional[float] = None  # grid and random: decided up front; bayes: by Optuna
    batch: Optional[int] = None
    seed: int = 0  # > 0: a repeat of the rung at a decided rate (`ladder.seeds`, the check's shapes)
    output_multiplier: Optional[float] = None  # µP's searched at the base width; None: the rung's model's


def plan_slots(sweep: SweepConfig, rungs: list[Rung], batches: list[int], cost: dict[str, float]) -> list[RungSlot]:
    """Every trial of the search, in the order it is handed out."""
    fitted = sorted((r for r in rungs if not r.held_out), key=lambda r: -cost[r.name])
    rng = np.random.default_rng(sweep.search.seed)
    multipliers = sweep.mup_output_multiplier or [None]
    per_rung: dict[str, list[RungSlot]] = {}
    for rung in fitted:
        if sweep.search.algorithm == "grid":
            slots = [RungSlot(rung.name, rung.lr_scale, lr, b, output_multiplier=m)
                     for lr in lr_values(sweep, rung) for m in multipliers for b in batches]
        elif sweep.search.algorithm == "random":
            lows, highs = np.log(sweep.lr.low), np.log(sweep.lr.high)
            slots = [RungSlot(rung.name, rung.lr_scale, float(np.exp(rng.uniform(lows, highs))) * rung.lr_scale,
                              int(rng.choice(batches)),
                              # drawn only when searched: a standard sweep's draws stay those of its seed
                              output_multiplier=float(rng.choice(multipliers)) if sweep.mup_output_multiplier else None)
                     for _ in range(sweep.search.samples)]
        else:
            slots = [RungSlot(rung.name, rung.lr_scale) for _ in range(sweep.search.samples)]
        per_rung[rung.name] = slots
    rounds = max(len(s) for s in per_rung.values())
    return [per_rung[r.name][k] for k in range(rounds) for r in fitted if k < len(per_rung[r.name])]


def trial_name(phase: str, index: int, config: dict) -> str:
    """A trial's id in trials.csv, and its run directory's name: its phase, its place in the
    phase's plan and a digest of its settings. Unlike Tune's random trial id it is the same each
    time the plan suggests the trial, so a resumed sweep's trial finds its own directory (its
    final result or checkpoints) even where Tune's state, saved at most every 10 s, did not hold
    it. The digest keeps out a trial whose settings differ the second time (an Optuna study that
    has seen more results)."""
    digest = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:6]
    return f"{phase}-{index:03d}-{digest}"


class RungSearcher(Searcher):
    """Suggests {"trial", "rung", "lr", "batch"} (and "seed" for a repeat, "output_multiplier"
    for µP's search) from a fixed plan; for bayes, each rung's learning rate (batch, output
    multiplier) comes from that rung's own Optuna TPE study."""

    def __init__(self, phase: str, slots: list[RungSlot], sweep: SweepConfig, batches: list[int]):
        super().__init__(metric=METRIC, mode=MODE)
        self.phase, self.slots, self.next = phase, slots, 0
        self.trial_rung: dict[str, str] = {}
        self.studies: dict = {}
        rungs = list(dict.fromkeys(s.rung for s in slots if s.lr is None))  # each its own study and seed
        if rungs:
            from ray.tune.search.optuna import OptunaSearch

            space = {"lr_mult": tune.loguniform(sweep.lr.low, sweep.lr.high)}
            if len(batches) > 1:
                space["batch"] = tune.choice(batches)
            if sweep.mup_output_multiplier:
                space["output_multiplier"] = tune.choice(sweep.mup_output_multiplier)
            self.studies = {rung: OptunaSearch(space, metric=METRIC, mode=MODE, seed=sweep.search.seed + i)
                            for i, rung in enumerate(rungs)}
        self.batch = batches[0]

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True

    def suggest(self, trial_id: str):
        if self.next >= len(self.slots):
            return Searcher.FINISHED
        slot = self.slots[self.next]
        self.next += 1
        self.trial_rung[trial_id] = slot.rung
        if slot.lr is not None:
            config = {"rung": slot.rung, "lr": slot.lr, "batch": slot.batch, "output_multiplier": slot.output_multiplier,
                      "seed": slot.seed}
        else:
            suggested = self.studies[slot.rung].suggest(trial_id)
            config = {"rung": slot.rung, "lr": suggested["lr_mult"] * slot.lr_scale,
                      "batch": suggested.get("batch", self.batch),
                      "output_multiplier": suggested.get("output_multiplier")}
        # Absent, a seed is 0 and the multiplier the rung's model's (`trial_config`).
        config = {k: v for k, v in config.items() if v or k in ("rung", "lr", "batch")}
        return {"trial": trial_name(self.phase, self.next - 1, config), **config}

    def on_trial_complete(self, trial_id: str, result: Optional[dict] = None, error: bool = False) -> None:
        rung = self.trial_rung.get(trial_id)
        if rung in self.studies:
            self.studies[rung].on_trial_complete(trial_id, result, error)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))


class RungASHA(FIFOScheduler):
    """One ASHA (AsyncHyperBandScheduler) per rung, on validation loss against the fraction of
    the budget trained. A trial that has trained its whole budget is never stopped: its last
    report is its final validation loss.

    Tune saves its searcher but not its scheduler when the driver dies; the losses ASHA recorded
    at each milestone are therefore kept in `state_path` after every result, and read back by the
    restored scheduler, so that a resumed sweep stops hopeless trials as the first run would."""

    def __init__(self, grace_fraction: float, reduction_factor: float, state_path: str):
        super().__init__()
        self.grace, self.reduction, self.state_path = grace_fraction, reduction_factor, state_path
        self.per_rung: dict[str, AsyncHyperBandScheduler] = {}
        self.stopped: set[str] = set()  # trial ids (`trial_name`) ASHA stopped: the sweep tells them from interrupted ones
        self.loaded = False

    def _save(self) -> None:
        tmp = f"{self.state_path}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"per_rung": self.per_rung, "stopped": self.stopped}, f)
        os.replace(tmp, self.state_path)

    def _of(self, trial) -> AsyncHyperBandScheduler:
        if not self.loaded:
            self.loaded = True
            if os.path.exists(self.state_path):
                with open(self.state_path, "rb") as f:
                    state = pickle.load(f)
                self.per_rung, self.stopped = state["per_rung"], state["stopped"]
        rung = trial.config["rung"]
        if rung not in self.per_rung:
            self.per_rung[rung] = AsyncHyperBandScheduler(
                time_attr=PROGRESS, metric=METRIC, mode=MODE, max_t=1.0, grace_period=self.grace,
                reduction_factor=self.reduction, stop_last_trials=False)
        return self.per_rung[rung]

    def set_search_properties(self, metric, mode, **spec) -> bool:
        return metric in (None, METRIC) and mode in (None, MODE)

    def on_trial_add(self, tune_controller, trial) -> None:
        self._of(trial).on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        action = self._of(trial).on_trial_result(tune_controller, trial, result)
        if result.get(PROGRESS, 0.0) >= 1.0:  # nothing left to save: let it write its final result
            action = FIFOScheduler.CONTINUE
        if action == FIFOScheduler.STOP:
            self.stopped.add(trial.config["trial"])
        self._save()
        return action

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        self._of(trial).on_trial_complete(tune_controller, trial, result)
        self._save()

    def on_trial_remove(self, tune_controller, trial) -> None:
        self._of(trial).on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return f"ASHA per rung ({len(self.per_rung)} rungs): {len(self.stopped)} trials stopped early"


def stopped_by_asha(state_path: str) -> set[str]:
    """The trial ids (`trial_name`) a RungASHA with this state file stopped."""
    if not os.path.exists(state_path):
        return set()
    with open(state_path, "rb") as f:
        return pickle.load(f)["stopped"]


# The error that ended the phase running in this process (`EndOnDeterministicError`). A module's
# list, not the callback's: Tune restores a resumed experiment's callbacks from its saved state.
ended_by: list[tuple[dict, DeterministicError]] = []


class EndOnDeterministicError(tune.Callback):
    """A trial that fails with an error no restart cures (a full disk under its checkpoints, a
    damaged shard, a setting its model refuses) ends the phase at once, as it ends `raylm train`:
    Tune would retry it `trial.max_failures` times and go on to the next trials, which meet the
    same. It ends by Tune's own interrupt (SIGUSR1, which Tune handles as Ctrl-C): the experiment's
    state is saved with the trial unfinished, and the same command resumes it."""

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        self._end_if_deterministic(trial)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self._end_if_deterministic(trial)

    def _end_if_deterministic(self, trial) -> None:
        # Tune pickled the error into the trial's local directory just now (`Trial.handle_error`);
        # `get_pickled_error` reads the synced copy in storage, an error behind, or none.
        path = trial.pickled_error_file
        if not path or not os.path.exists(path):
            return
        with open(path, "rb") as f:
            error = cloudpickle.load(f)
        cause = getattr(error, "cause", None) or error  # a RayTaskError carries the trial's own
        if isinstance(cause, DeterministicError) and not ended_by:
            ended_by.append((dict(trial.config), cause))
            # Only to Tune's handler: Tune installs none off the main thread, where the signal's
            # default would end the process (the phase then runs on and the error ends the sweep after).
            if callable(signal.getsignal(signal.SIGUSR1)):
                os.kill(os.getpid(), signal.SIGUSR1)

