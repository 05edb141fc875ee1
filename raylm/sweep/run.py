"""`raylm sweep`: resolve the ladder, run its trials on Ray Tune, fit, check, recommend.

The sweep directory `<run.storage_path>/<run.name>/` holds everything: `sweep.yaml` (what was
asked), Tune's experiments (`tune-ladder/`, `tune-check/`), the trials' run directories
(`trials/<trial id>/`), and the results: trials.csv, fit.json, recommended.yaml, plots/.
Running the same command again resumes: Tune restores each experiment (`Tuner.restore`),
finished trials are kept as they are, unfinished ones resume from their checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable, Optional

import yaml

from raylm.config import build_dataclass
from raylm.data import storage
from raylm.errors import ConfigError
from raylm.ray_runtime import start_ray
from raylm.sweep import analysis, ladder
from raylm.sweep.analysis import COMPLETED
from raylm.sweep.checks import measure_check, noise_floor, noise_rung, predict_check
from raylm.sweep.config import SweepConfig
from raylm.sweep.phases import check_phase, seeds_phase
from raylm.sweep.plan import Plan, TrialPlan, check_same_sweep, resolve
from raylm.sweep.results import (CHECK_PLAN_FILE, FIT_FILE, RECOMMENDED_FILE, SWEEP_FILE, TRIALS_FILE,
                                 asha_savings, fitted_with, read_trials, recommended_yaml, write_fit, write_trials)
from raylm.sweep.summary import say
from raylm.sweep.transfer import mup_ladder, mup_search
from raylm.sweep.tuner import SweepInterrupted, cluster_share, search, threads
from raylm.train.lease import RunLease


def run_sweep(path: str, overrides: list[str]) -> dict:
    """The whole sweep, holding the sweep directory's lease (`raylm.train.lease`); returns
    fit.json's contents."""
    started = time.time()
    plan = resolve(path, overrides)
    os.makedirs(plan.directory, exist_ok=True)
    with RunLease(plan.directory, None, plan.base.run.lease_timeout_s, owner="raylm sweep"):
        try:
            return _sweep(plan, path, started)
        except KeyboardInterrupt as stop:  # Tune takes a Ctrl-C in its experiments; this came outside them
            raise SweepInterrupted("the sweep was interrupted; run the same command again to resume it (finished "
                                   "trials are kept)") from stop


def _sweep(plan: Plan, path: str, started: float) -> dict:
    sweep = plan.sweep
    check_same_sweep(plan, path)
    base = plan.base
    start_ray(base.run.ray_address, base.run.ray_num_cpus, max(1, int(sweep.trial.cpus)), dashboard=base.run.dashboard)
    kind, per_trial = ("GPU", sweep.trial.gpus) if sweep.trial.gpus > 0 else ("CPU", sweep.trial.cpus)
    concurrency = int(min(cluster_share(per_trial, kind), sweep.trial.max_concurrent or math.inf))
    if sweep.check and sweep.trial.check_cpus:  # now, not after the ladder's hours
        cluster_share(sweep.trial.check_cpus, "CPU", "trial.check_cpus")
    trials = _trial_plan(plan)
    print(f"raylm: sweep {plan.directory}: {len(plan.sizes)} sizes, {len(plan.rungs)} rungs, "
          f"{plan.resolved.train.seq_len}-token sequences, {sweep.parametrization} parametrization", flush=True)
    resources = {"CPU": sweep.trial.cpus, "GPU": sweep.trial.gpus}
    search_rows, transfer = [], None
    if sweep.parametrization == "mup":
        search_rows, transfer = mup_search(plan, trials, resources, concurrency)
        plan = plan.with_output_multiplier(transfer["output_multiplier"])
        trials = _trial_plan(plan)
        rows = mup_ladder(plan, trials, transfer, resources, concurrency)
    else:
        rows = search(plan, "tune-ladder", "ladder", plan.rungs, trials, resources, concurrency)
    completed = [r for r in rows if r["status"] == COMPLETED]
    noisy = noise_rung(completed, ladder.held_out_rung(plan.rungs).budget) if sweep.check else None
    seed_rows = seeds_phase(plan, rows, noisy, trials, concurrency)
    noise = noise_floor(rows, seed_rows, noisy)
    result, laws = analysis.analyze(rows, plan.sizes, sweep, seed_rows, say, noise and noise["relative_spread"])
    result = {"sweep": plan.directory, "asha": asha_savings(rows), **result}
    if transfer is not None:
        result["transfer"] = transfer
    check_rows = []
    if sweep.check and laws.predictors:
        import ray

        cpus = sweep.trial.check_cpus or ray.cluster_resources().get("CPU", 1)
        check, check_rows = check_phase(plan, laws, result["rungs"], trials, cpus)
        result["noise"], result["check"] = noise, measure_check(check, check_rows, noise)
    rows = search_rows + rows + seed_rows + check_rows
    write_trials(plan.directory, rows)
    if (sweep.target.flops or sweep.target.params) and laws.parametric is not None:
        try:
            cfg, info = analysis.recommend(sweep, laws, plan.sizes, base, plan.resolved,
                                           max(r["flops"] for r in rows))
        except ValueError as e:
            print(f"raylm: no recommended run: {e}", flush=True)
            result["recommended"] = {"error": str(e)}
        else:
            result["recommended"] = info
            storage.write_bytes(os.path.join(plan.directory, RECOMMENDED_FILE),
                                recommended_yaml(cfg, info, plan.directory).encode())
    result["fitted_with"] = fitted_with()
    result["warnings"] = analysis.warnings(result)
    result["wall_s"] = time.time() - started
    write_fit(plan.directory, result, rows, laws)
    return result


def _trial_plan(plan: Plan) -> TrialPlan:
    sweep = plan.sweep
    return TrialPlan(sweep, plan.spec.to_dict(), {r.name: r for r in plan.rungs}, os.path.join(plan.directory, "trials"),
                     threads(sweep.trial.cpus), sweep.trial.gpus > 0)


def fit_ladder(directory: str, log: Optional[Callable[[str], None]] = None
               ) -> tuple[list[dict], dict, analysis.Laws, Optional[dict]]:
    """The ladder's fits from the sweep directory alone (sweep.yaml, trials.csv): its trials, the
    fits' record, the laws they make and the noise floor (None without the check's seeds), with no
    data and no Ray; `log` is told how they progress."""
    record_path = os.path.join(directory, SWEEP_FILE)
    if not os.path.exists(record_path):
        raise ConfigError(f"{directory} holds no {SWEEP_FILE}: not a sweep directory")
    with open(record_path) as f:
        sweep = build_dataclass(SweepConfig, yaml.safe_load(f)["sweep"])
    rows = read_trials(directory)
    # The ladder's sizes and the held-out one; the check's other shapes are not the ladder's.
    sizes = {int(r["size"]): ladder.Size(int(r["size"]), TRIALS_FILE, None, r["params"], r["params_non_embedding"],
                                         r["params_total"], r["flops_per_token"])
             for r in rows if r["phase"] != "check-repeats"}
    ladder_rows = [r for r in rows if r["phase"] == "ladder"]
    seed_rows = [r for r in rows if r["phase"] == "seeds"]
    held_out = [r for r in rows if r["phase"] == "check"]
    noise = noise_floor(ladder_rows, seed_rows, noise_rung(ladder_rows, held_out[0]["budget"])) if held_out else None
    if log is not None:
        log(f"fitting {len(ladder_rows)} ladder trials of {len(sizes)} sizes from {os.path.join(directory, TRIALS_FILE)}")
    result, laws = analysis.analyze(ladder_rows, [sizes[i] for i in sorted(sizes)], sweep, seed_rows, log,
                                    noise and noise["relative_spread"])
    return rows, result, laws, noise


def refit(directory: str) -> dict:
    """fit.json again from the sweep directory alone (sweep.yaml, trials.csv, check_plan.json): the
    fits, the choice of predictor, the noise floor and the check, with no data and no Ray. The
    recommendation is carried over as the sweep made it: placing it needs the base run's data."""
    rows, result, laws, noise = fit_ladder(directory, say)
    ladder_rows = [r for r in rows if r["phase"] == "ladder"]
    previous = {}
    if os.path.exists(os.path.join(directory, FIT_FILE)):
        with open(os.path.join(directory, FIT_FILE)) as f:
            previous = json.load(f)
    result = {"sweep": directory, "asha": asha_savings(ladder_rows), **result}
    plan_path = os.path.join(directory, CHECK_PLAN_FILE)
    check_rows = [r for r in rows if r["phase"] in ("check", "check-batch", "check-repeats")]
    if laws.predictors and check_rows and os.path.exists(plan_path):
        with open(plan_path) as f:
            check = json.load(f)
        check.update(predict_check(laws, check))
        result["noise"], result["check"] = noise, measure_check(check, check_rows, noise)
    if "transfer" in previous:  # the search's decision, as the sweep took it
        result["transfer"] = previous["transfer"]
    if "recommended" in previous:
        result["recommended"] = {**previous["recommended"], "refit": "carried over from the sweep: --refit does "
                                 "not place the recommended run again"}
    result["fitted_with"] = fitted_with()
    result["warnings"] = analysis.warnings(result)
    if previous.get("fitted_with", result["fitted_with"]) != result["fitted_with"]:
        result["warnings"].append(
            f"refitted with {_versions(result['fitted_with'])}, where the fit.json it replaces was fitted with "
            f"{_versions(previous['fitted_with'])}: a fit the ladder leaves underdetermined (an alpha or beta in the "
            "tens) can land elsewhere, and the chosen predictor with it")
    result["wall_s"] = previous.get("wall_s")
    write_fit(directory, result, rows, laws)
    return result


def _versions(libraries: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in sorted(libraries.items()))
