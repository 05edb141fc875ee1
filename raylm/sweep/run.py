"""`raylm sweep`: resolve the ladder, run its trials on Ray Tune, fit, check, recommend.

The sweep directory `<run.storage_path>/<run.name>/` holds everything: `sweep.yaml` (what was
asked), Tune's experiments (`tune-ladder/`, `tune-check/`), the trials' run directories
(`trials/<trial id>/`), and the results: trials.csv, fit.json, recommended.yaml, plots/.
Running the same command again resumes: Tune restores each experiment (`Tuner.restore`),
finished trials are kept as they are, unfinished ones resume from their checkpoints.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import time
from typing import Optional

import yaml

from raylm.config import Config, ParallelConfig, build_dataclass, config_to_dict
from raylm.data import storage
from raylm.errors import ConfigError
from raylm.ray_runtime import start_ray
from raylm.sweep import analysis, ladder
from raylm.sweep.analysis import COMPLETED, DIVERGED, ERROR, STOPPED
from raylm.sweep.config import SweepConfig, load_sweep, sweep_to_dict
from raylm.sweep.trial import FINAL_FILE, TrialPlan, trial_dir
from raylm.train.lease import RunLease
from raylm.train.spec import absolute, resolve_run

SWEEP_FILE, TRIALS_FILE, FIT_FILE, RECOMMENDED_FILE = "sweep.yaml", "trials.csv", "fit.json", "recommended.yaml"
CHECK_PLAN_FILE, ASHA_STATE_FILE = "check_plan.json", "asha_state.pkl"
COLUMNS = ("trial_id", "phase", "rung", "size", "budget", "params", "params_non_embedding", "params_total", "tokens",
           "flops_per_token", "flops", "lr", "batch", "steps", "val_loss", "progress", "tokens_trained", "status",
           "wall_s")


class SweepInterrupted(RuntimeError):
    """Tune stopped before every trial of a phase had finished."""


@dataclasses.dataclass
class Plan:
    """The sweep resolved on the driver, before any trial: every rule checked."""

    sweep: SweepConfig
    base: Config  # the user's base run
    spec: object  # RunSpec of the trials' base (one in-process worker, local reader), resolved against the data
    sizes: list[ladder.Size]
    rungs: list[ladder.Rung]
    batches: list[int]
    directory: str

    @property
    def resolved(self) -> Config:
        return self.spec.config

    def rung(self, name: str) -> ladder.Rung:
        return next(r for r in self.rungs if r.name == name)


def resolve(path: str, overrides: list[str]) -> Plan:
    """Load and check everything a sweep needs, reading the data once; no Ray yet."""
    sweep, base = load_sweep(path, overrides)
    directory = storage.join(absolute(base.run.storage_path), base.run.name)
    if storage.is_s3(directory):
        raise ConfigError(f"run.storage_path={base.run.storage_path}: a sweep directory must be a local or shared "
                          "file system path (trials checkpoint into it); s3:// is not supported for sweeps")
    trials_base = dataclasses.replace(
        base, parallel=ParallelConfig(num_workers=1, use_gpu=sweep.trial.gpus > 0),
        data=dataclasses.replace(base.data, loader="local"))  # in-process trials read with pyarrow
    spec = resolve_run(trials_base, announce=True)
    sizes = ladder.build_sizes(sweep, spec.config)
    rungs = ladder.build_rungs(sweep, sizes)
    ladder.check_budgets(sweep, spec.config, rungs)
    ladder.check_fittable(sweep, rungs)
    batches = ladder.batch_sizes(sweep, spec.config)
    probe_lr = sweep.lr.grid[0] if sweep.lr.grid else sweep.lr.low
    for rung in rungs:  # every trial's complete config, built and validated now
        for batch in batches:
            ladder.trial_config(sweep, spec.config, rung, probe_lr * rung.lr_scale, batch, "probe")
    return Plan(sweep, base, spec, sizes, rungs, batches, directory)


def _effective(cls: type, tree) -> Optional[dict]:
    """A recorded config as it reads today: keys added to raylm since take their defaults."""
    try:
        return dataclasses.asdict(build_dataclass(cls, tree))
    except (ConfigError, TypeError):
        return None


def _check_same_sweep(plan: Plan, path: str) -> None:
    """A sweep directory belongs to one sweep: resuming it with other settings would mix results."""
    record = {"sweep": sweep_to_dict(plan.sweep), "base": config_to_dict(plan.base)}
    os.makedirs(plan.directory, exist_ok=True)
    target = os.path.join(plan.directory, SWEEP_FILE)
    if os.path.exists(target):
        with open(target) as f:
            previous = yaml.safe_load(f)
        changed = [key for key, cls in (("sweep", SweepConfig), ("base", Config))
                   if _effective(cls, previous.get(key)) != record[key]]
        if changed:
            raise ConfigError(f"{plan.directory} holds a sweep started with different settings ({', '.join(changed)} "
                              f"differ from {path} and the overrides; see {target}): resume it with the same "
                              "command, or choose another run.name")
        return
    with open(target, "w") as f:
        yaml.safe_dump(record, f, sort_keys=False)


def _threads(cpus: float) -> int:
    """Torch threads of a trial: its whole CPUs (the trial caps them at its node's cores)."""
    return max(1, int(cpus))


def _cluster_share(per_trial: float, kind: str) -> int:
    import ray

    total = ray.cluster_resources().get(kind, 0.0)
    if per_trial > total:
        raise ConfigError(f"trial.{kind.lower()}s={per_trial} but the Ray cluster has {total:g} {kind}s")
    return int(total // per_trial)


def _run_phase(plan: Plan, name: str, trainable_plan: TrialPlan, resources: dict, *, searcher=None,
               scheduler=None, param_space: Optional[dict] = None, num_samples: int = 1, concurrency: int = 1):
    """One Tune experiment in the sweep directory, restored if an earlier run of the command left it."""
    from ray import tune

    from raylm.sweep.search import METRIC, MODE
    from raylm.sweep.trial import run_trial

    trainable = tune.with_resources(tune.with_parameters(run_trial, plan=trainable_plan), resources)
    experiment = os.path.join(plan.directory, name)
    if tune.Tuner.can_restore(experiment):
        print(f"raylm: resuming {experiment} (finished trials are kept)", flush=True)
        tuner = tune.Tuner.restore(experiment, trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable, param_space=param_space or {},
            tune_config=tune.TuneConfig(metric=METRIC, mode=MODE, search_alg=searcher, scheduler=scheduler,
                                        num_samples=num_samples, max_concurrent_trials=concurrency),
            run_config=tune.RunConfig(name=name, storage_path=plan.directory, verbose=1,
                                      failure_config=tune.FailureConfig(max_failures=plan.sweep.trial.max_failures)))
    return tuner.fit()


def _rows(plan: Plan, grid, phase: str, expected: int) -> list[dict]:
    """trials.csv rows of one experiment's results. Tune returns early when interrupted (Ctrl-C,
    SIGTERM): a trial neither finished, failed nor stopped by ASHA, or a trial not yet created,
    means the phase did not end, and the sweep stops there (the same command resumes it)."""
    from raylm.sweep.search import stopped_by_asha

    seq_len = plan.resolved.train.seq_len
    stopped = stopped_by_asha(os.path.join(plan.directory, ASHA_STATE_FILE))
    rows = []
    for result in grid:
        config, metrics = result.config, dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or os.path.basename(result.path or "?")
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
                     "status": status, "wall_s": metrics.get("wall_s", metrics.get("time_total_s", math.nan))})
    if len(rows) < expected:
        raise SweepInterrupted(f"the sweep was interrupted ({len(rows)} of {expected} trials of {phase} created); "
                               "run the same command again to resume it (finished trials are kept)")
    return sorted(rows, key=lambda r: (r["phase"] != "ladder", r["params"], r["tokens"], r["lr"]))


def _check_phase(plan: Plan, laws: analysis.Laws, bests: list[dict], trials: TrialPlan, cpus: float):
    """Predict the held-out rung from the fit, then train it once at the predicted learning rate."""
    rung = next(r for r in plan.rungs if r.held_out)
    path = os.path.join(plan.directory, CHECK_PLAN_FILE)
    if os.path.exists(path):  # the prediction made before an interruption stands
        with open(path) as f:
            check = json.load(f)
    else:
        largest = max(bests, key=lambda b: b["params"])
        lr = analysis.predicted_lr(laws, rung.size.params, fallback=largest["lr"])
        batch = largest["batch"]  # the largest fitted size's best (batch sizes are not extrapolated here)
        seq_len = plan.resolved.train.seq_len
        tokens = ladder.steps_for(rung.target_tokens, batch, seq_len) * batch * seq_len
        prediction = laws.predict(rung.size.params, tokens)
        check = {"rung": rung.name, "params": rung.size.params, "tokens": tokens, "lr": lr, "batch": batch,
                 "predicted_loss": prediction["loss"], "interval": prediction["interval"]}
        with open(path, "w") as f:
            json.dump(check, f, indent=1)
    print(f"raylm: check: {rung.size.params:,} parameters x {check['tokens']:,} tokens, predicted val loss "
          f"{check['predicted_loss']:.4f} {check['interval']}, training it at lr {check['lr']:.3g}", flush=True)
    resources = {"CPU": cpus, "GPU": plan.sweep.trial.gpus}
    grid = _run_phase(plan, "tune-check", dataclasses.replace(trials, threads=_threads(cpus)), resources,
                      param_space={"rung": rung.name, "lr": check["lr"], "batch": check["batch"]})
    rows = _rows(plan, grid, "check", expected=1)
    measured = rows[0]["val_loss"] if rows[0]["status"] == COMPLETED else None
    check["measured_loss"] = measured
    if measured is not None:
        check["relative_error"] = (check["predicted_loss"] - measured) / measured
        check["within_interval"] = check["interval"][0] <= measured <= check["interval"][1]
    return check, rows


def write_trials(directory: str, rows: list[dict]) -> None:
    with open(os.path.join(directory, TRIALS_FILE), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _asha_savings(rows: list[dict]) -> dict:
    planned = sum(r["flops"] for r in rows)
    trained = sum(r["tokens_trained"] * r["flops_per_token"] for r in rows)
    return {"trials": len(rows), "stopped_early": sum(r["status"] == STOPPED for r in rows),
            "planned_flops": planned, "trained_flops": trained, "saved_fraction": 1 - trained / planned}


def _recommended_yaml(cfg: Config, info: dict, sweep_dir: str) -> str:
    p = info["predicted_loss"]
    header = (f"# Recommended by `raylm sweep` ({sweep_dir}):\n"
              f"# {info['params']:,} parameters, {info['tokens']:,} tokens, {info['flops']:.3g} FLOPs, "
              f"lr {info['lr']:.3g}, batch {info['batch']}.\n"
              f"# Predicted final val loss: {p['loss']:.4f} "
              f"(interval {p['interval'][0]:.4f} - {p['interval'][1]:.4f}).\n")
    return header + yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def run_sweep(path: str, overrides: list[str]) -> dict:
    """The whole sweep, holding the sweep directory's lease (`raylm.train.lease`); returns
    fit.json's contents."""
    started = time.time()
    plan = resolve(path, overrides)
    os.makedirs(plan.directory, exist_ok=True)
    with RunLease(plan.directory, None, plan.base.run.lease_timeout_s, owner="raylm sweep"):
        return _sweep(plan, path, started)


def _sweep(plan: Plan, path: str, started: float) -> dict:
    from raylm.sweep import plots
    from raylm.sweep.search import RungASHA, RungSearcher, plan_slots

    sweep = plan.sweep
    _check_same_sweep(plan, path)
    base = plan.base
    start_ray(base.run.ray_address, base.run.ray_num_cpus, max(1, int(sweep.trial.cpus)), dashboard=base.run.dashboard)
    kind, per_trial = ("GPU", sweep.trial.gpus) if sweep.trial.gpus > 0 else ("CPU", sweep.trial.cpus)
    concurrency = min(_cluster_share(per_trial, kind), sweep.trial.max_concurrent or math.inf)
    trials = TrialPlan(sweep, plan.spec.to_dict(), {r.name: r for r in plan.rungs},
                       os.path.join(plan.directory, "trials"), _threads(sweep.trial.cpus), sweep.trial.gpus > 0)
    seq_len = plan.resolved.train.seq_len
    cost = {r.name: r.target_tokens * r.size.flops_per_token for r in plan.rungs}
    slots = plan_slots(sweep, plan.rungs, plan.batches, cost)
    print(f"raylm: sweep {plan.directory}: {len(plan.sizes)} sizes, {len(plan.rungs)} rungs, {len(slots)} trials, "
          f"{concurrency} at a time, {seq_len}-token sequences", flush=True)
    scheduler = RungASHA(sweep.early_stopping.grace_fraction, sweep.early_stopping.reduction_factor,
                         os.path.join(plan.directory, ASHA_STATE_FILE)) if sweep.early_stopping.asha else None
    grid = _run_phase(plan, "tune-ladder", trials, {"CPU": sweep.trial.cpus, "GPU": sweep.trial.gpus},
                      searcher=RungSearcher(slots, sweep, plan.batches), scheduler=scheduler,
                      num_samples=len(slots), concurrency=int(concurrency))
    rows = _rows(plan, grid, "ladder", expected=len(slots))
    if not any(r["status"] == COMPLETED for r in rows):
        errors = [str(r.error) for r in grid if r.error]
        raise RuntimeError(f"no trial of the sweep completed; first error: {errors[0] if errors else 'none reported'}")
    result, laws = analysis.analyze(rows, plan.sizes, sweep)
    result = {"sweep": plan.directory, "asha": _asha_savings(rows), **result}
    if sweep.check and laws.parametric is not None:
        import ray

        cpus = sweep.trial.check_cpus or ray.cluster_resources().get("CPU", 1)
        result["check"], check_rows = _check_phase(plan, laws, result["rungs"], trials, cpus)
        rows += check_rows
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
            with open(os.path.join(plan.directory, RECOMMENDED_FILE), "w") as f:
                f.write(_recommended_yaml(cfg, info, plan.directory))
    result["warnings"] = analysis.warnings(result)
    result["wall_s"] = time.time() - started
    with open(os.path.join(plan.directory, FIT_FILE), "w") as f:
        json.dump(result, f, indent=1)
    plots.write_all(os.path.join(plan.directory, "plots"), rows, result, laws)
    return result


def summary(result: dict) -> str:
    """What `raylm sweep` prints at the end."""
    asha = result["asha"]
    lines = [f"sweep {result['sweep']}: {asha['trials']} trials, {asha['stopped_early']} stopped early by ASHA "
             f"({100 * asha['saved_fraction']:.0f}% of the planned compute saved), {result['wall_s'] / 60:.1f} min"]
    p = result.get("parametric", {})
    if "E" in p:
        lines.append(f"fit: L(N, D) = {p['E']:.3f} + {p['A']:.3g}/N^{p['alpha']:.3f} + {p['B']:.3g}/D^{p['beta']:.3f}")
    else:
        lines.append(f"fit: none ({p.get('error')})")
    law = result["lr"].get("lr_vs_params", {})
    if "coef" in law:
        lines.append(f"best lr: {law['coef']:.3g} * N^{law['exponent']:.3f}")
    check = result.get("check")
    if check and check.get("measured_loss") is not None:
        lines.append(f"check: {check['params']:,} parameters, {check['tokens']:,} tokens: "
                     f"predicted {check['predicted_loss']:.4f} "
                     f"[{check['interval'][0]:.4f}, {check['interval'][1]:.4f}], measured {check['measured_loss']:.4f} "
                     f"({100 * check['relative_error']:+.2f}%)")
    rec = result.get("recommended")
    if rec and "error" not in rec:
        lines.append(f"recommended: {rec['params']:,} parameters, {rec['tokens']:,} tokens, lr {rec['lr']:.3g}, "
                     f"predicted loss {rec['predicted_loss']['loss']:.4f} -> {result['sweep']}/{RECOMMENDED_FILE}")
    lines += [f"warning: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines)
