"""Ray Tune's side of a sweep: one experiment per phase, restored when the command runs again,
and its results read back as trials.csv rows; the cluster's share of each trial."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
from typing import TYPE_CHECKING, Optional

from raylm.data.storage import StorageError
from raylm.errors import ConfigError, DeterministicError, RunFailedError, RunInterrupted
from raylm.ray_runtime import callers_handlers_kept, setting_while
from raylm.sweep import ladder
from raylm.sweep.analysis import COMPLETED, DIVERGED, ERROR, STOPPED
from raylm.sweep.plan import FINAL_FILE, Plan, TrialPlan, trial_dir
from raylm.sweep.results import ASHA_STATE_FILE

if TYPE_CHECKING:
    from ray.tune import ResultGrid


class TrialFailedError(DeterministicError):
    """A trial failed with an error that no restart cures; the sweep stopped at it (resumable)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class SweepInterrupted(RunInterrupted):
    """Tune stopped before every trial of a phase had finished: a Ctrl-C (Tune's handler ends the
    experiment and keeps its state), so the exit status is a shell's for SIGINT, as `raylm train`'s."""


def threads(cpus: float) -> int:
    """Torch threads of a trial: its whole CPUs (the trial caps them at its node's cores)."""
    return max(1, int(cpus))


def cluster_share(per_trial: float, kind: str, field: str = "") -> int:
    import ray

    total = ray.cluster_resources().get(kind, 0.0)
    if per_trial > total:
        raise ConfigError(f"{field or f'trial.{kind.lower()}s'}={per_trial} but the Ray cluster has {total:g} {kind}s")
    return int(total // per_trial)


class _NoTunerRestoreHint(logging.Filter):
    """An interrupted Tune experiment tells the user to call `Tuner.restore(...)`; a sweep is
    resumed by running its own command again, which raylm says instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        from raylm.sweep.search import ended_by

        message = record.getMessage()
        # raylm's own SIGUSR1 (EndOnDeterministicError) is no stop a user sent, whatever Tune says.
        return "Tuner.restore(" not in message and not (ended_by and "Stop signal received" in message)


_NO_TUNER_RESTORE_HINT = _NoTunerRestoreHint()


def run_trial(config: dict, plan: TrialPlan) -> None:
    """The trainable Tune runs in each trial's process (its name names Tune's trials). It imports
    the training there: the driver, which hands Tune only this function, never loads torch."""
    from raylm.sweep import trial

    trial.run_trial(config, plan)


def run_phase(plan: Plan, name: str, trainable_plan: TrialPlan, resources: dict, searcher, *, scheduler=None,
              num_samples: int = 1, concurrency: int = 1) -> ResultGrid:
    """One Tune experiment in the sweep directory, restored if an earlier run of the command left it."""
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    from raylm.sweep.search import METRIC, MODE, EndOnDeterministicError, ended_by

    trainable = tune.with_resources(tune.with_parameters(run_trial, plan=trainable_plan), resources)
    experiment = os.path.join(plan.directory, name)
    if tune.Tuner.can_restore(experiment):
        print(f"raylm: resuming {experiment} (finished trials are kept)", flush=True)
        tuner = tune.Tuner.restore(experiment, trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(metric=METRIC, mode=MODE, search_alg=searcher, scheduler=scheduler,
                                        num_samples=num_samples, max_concurrent_trials=concurrency,
                                        # a new process per trial costs ~5 s of start and imports,
                                        # more than a small rung's training on 2 cores
                                        reuse_actors=True),
            run_config=tune.RunConfig(name=name, storage_path=plan.directory, verbose=1,
                                      failure_config=tune.FailureConfig(max_failures=plan.sweep.trial.max_failures),
                                      callbacks=[CSVLoggerCallback(), JsonLoggerCallback(),
                                                 EndOnDeterministicError()]))
    logging.getLogger("ray.tune.tune").addFilter(_NO_TUNER_RESTORE_HINT)  # the same filter is added once
    ended_by.clear()
    # Tune's own loggers less its TensorBoard one: tensorboardX imports torch (3 s and 200 MB in the
    # driver, at each start) for events files of the trials' reports, which raylm does not read.
    with callers_handlers_kept(), setting_while("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1"):
        try:
            grid = tuner.fit()
        except Exception as e:  # Tune's controller failed: its TuneError keeps the cause as text and context
            if full := _disk_full(e):
                raise StorageError(f"{plan.directory}: {full}: free space there, then run the same command again to "
                                   "resume the sweep (finished trials are kept)") from e
            raise
    if ended_by:
        config, error = ended_by[0]
        raise TrialFailedError(f"trial {config.get('trial')} ({config.get('rung')}) failed with an error that no "
                               f"retry cures, so the sweep stopped: {error}. Run the same command again to resume "
                               "it once that is fixed (finished trials are kept)", error.exit_code) from error
    return grid


def _disk_full(error: BaseException) -> Optional[OSError]:
    """The full disk or quota among the errors that led to `error`, if one did."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return error
        error = error.__cause__ or error.__context__
    return None


def _trial_config(result) -> Optional[dict]:
    """A Tune result's trial config: from its last report, or, for a trial that had not reported
    yet (a Ctrl-C as it started), from the params.json Tune wrote when it created the trial."""
    if result.config:
        return result.config
    path = os.path.join(result.path, "params.json") if result.path else ""
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def trial_rows(plan: Plan, grid: ResultGrid, phase: str, expected: int) -> list[dict]:
    """trials.csv rows of one experiment's results. Tune returns early when interrupted (Ctrl-C,
    SIGTERM): a trial neither finished, failed nor stopped by ASHA, or a trial not yet created,
    means the phase did not end, and the sweep stops there (the same command resumes it)."""
    from raylm.sweep.search import stopped_by_asha

    seq_len = plan.resolved.train.seq_len
    stopped = stopped_by_asha(os.path.join(plan.directory, ASHA_STATE_FILE))
    rows = []
    for result in grid:
        config, metrics = _trial_config(result), dict(result.metrics or {})
        if config is None:
            raise SweepInterrupted(f"the sweep was interrupted ({os.path.basename(result.path or '?')} of {phase} "
                                   "did not start); run the same command again to resume it (finished trials are kept)")
        trial_id = config["trial"]
        rung = plan.rung(config["rung"])
        final_path = os.path.join(trial_dir(os.path.join(plan.directory, "trials"), trial_id), FINAL_FILE)
        if os.path.exists(final_path):
            with open(final_path) as f:
                metrics = json.load(f)
            status = DIVERGED if metrics.get("diverged") else COMPLETED
        elif result.error:
            status = ERROR
        elif trial_id in stopped:
            status = STOPPED
        elif metrics.get("progress", 0.0) >= 1.0:  # stopped at its last report, before final.json: finished
            status = COMPLETED
        else:
            raise SweepInterrupted(f"the sweep was interrupted ({trial_id} of {phase} did not finish); run the "
                                   "same command again to resume it (finished trials are kept)")
        steps = ladder.steps_for(rung.target_tokens, config["batch"], seq_len)
        tokens = steps * config["batch"] * seq_len
        size = rung.size
        rows.append({"trial_id": trial_id, "phase": phase, "rung": rung.name, "size": size.index,
                     "budget": rung.budget, "params": size.params, "params_non_embedding": size.params_non_embedding,
                     "params_total": size.params_total, "tokens": tokens, "flops_per_token": size.flops_per_token,
                     "flops": tokens * size.flops_per_token, "lr": config["lr"], "batch": config["batch"],
                     "steps": steps, "val_loss": metrics.get("val_loss", math.nan),
                     "progress": metrics.get("progress", 0.0), "tokens_trained": metrics.get("tokens", 0),
                     "status": status, "wall_s": metrics.get("wall_s", metrics.get("time_total_s", math.nan)),
                     "seed": config.get("seed", 0),
                     "output_multiplier": config.get("output_multiplier", size.model.mup_output_multiplier)})
    if len(rows) < expected:
        raise SweepInterrupted(f"the sweep was interrupted ({len(rows)} of {expected} trials of {phase} created); "
                               "run the same command again to resume it (finished trials are kept)")
    return sorted(rows, key=lambda r: (r["phase"] != "ladder", r["params"], r["tokens"], r["lr"]))


def repeats(plan: Plan, name: str, phase: str, slots: list, trials: TrialPlan, resources: dict,
            concurrency: int) -> list[dict]:
    """Trials at decided rates and seeds (RungSlots) as one Tune experiment; their rows."""
    from raylm.sweep.search import RungSearcher

    grid = run_phase(plan, name, trials, resources, RungSearcher(phase, slots, plan.sweep, plan.batches),
                     num_samples=len(slots), concurrency=concurrency)
    return trial_rows(plan, grid, phase, expected=len(slots))


def search(plan: Plan, name: str, phase: str, rungs: list[ladder.Rung], trials: TrialPlan, resources: dict,
           concurrency: int) -> list[dict]:
    """The learning-rate search over `rungs` (lr, search, early_stopping: ASHA within each rung) as
    one Tune experiment; its rows. Raises RunFailedError when none of its trials completed."""
    from raylm.sweep.search import RungASHA, RungSearcher, plan_slots

    sweep = plan.sweep
    cost = {r.name: r.target_tokens * r.size.flops_per_token for r in rungs}
    slots = plan_slots(sweep, rungs, plan.batches, cost)
    print(f"raylm: {phase}: {len(slots)} trials over {len(rungs)} rungs, {concurrency} at a time", flush=True)
    scheduler = RungASHA(sweep.early_stopping.grace_fraction, sweep.early_stopping.reduction_factor,
                         os.path.join(plan.directory, ASHA_STATE_FILE)) if sweep.early_stopping.asha else None
    grid = run_phase(plan, name, trials, resources, RungSearcher(phase, slots, sweep, plan.batches),
                     scheduler=scheduler, num_samples=len(slots), concurrency=concurrency)
    rows = trial_rows(plan, grid, phase, expected=len(slots))
    if not any(r["status"] == COMPLETED for r in rows):
        errors = [str(getattr(r.error, "cause", None) or r.error) for r in grid if r.error]  # the trial's, not Ray's wrapper
        raise RunFailedError(f"no trial of the sweep's {phase} completed; first error: "
                             f"{errors[0] if errors else 'none reported'}")
    return rows
