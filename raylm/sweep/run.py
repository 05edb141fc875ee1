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
import io
import json
import logging
import math
import os
import time
from typing import Callable, Optional

import numpy as np
import yaml

from raylm.config import Config, ParallelConfig, build_dataclass, config_to_dict
from raylm.data import storage
from raylm.errors import ConfigError, RunInterrupted
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
           "wall_s", "seed")
NOISE_SEEDS = 2  # the largest fitted rung's extra seeds
LR_PICK_FACTORS = (2 ** -0.5, 1.0, 2 ** 0.5)  # the held-out rung's learning rates, x the predicted one


class SweepInterrupted(RunInterrupted):
    """Tune stopped before every trial of a phase had finished: a Ctrl-C (Tune's handler ends the
    experiment and keeps its state), so the exit status is a shell's for SIGINT, as `raylm train`'s."""


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
    shapes = ladder.build_check_shapes(sweep, spec.config, sizes) if sweep.check else []
    rungs = ladder.build_rungs(sweep, sizes, shapes)
    ladder.check_budgets(sweep, spec.config, rungs)
    unique_tokens = sum(m.splits["train"].unique_tokens for m in spec.datasets.manifests)
    for line in ladder.check_repetition(sweep, rungs, unique_tokens):
        _say(line)
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


def _trials_began(directory: str) -> bool:
    """Whether a phase of the sweep in `directory` was handed to Tune: its experiment or a trial's
    run directory exists."""
    return any(name == "trials" or name.startswith("tune-") for name in os.listdir(directory))


def _check_same_sweep(plan: Plan, path: str) -> None:
    """A sweep directory belongs to one sweep: resuming it with other settings would mix results.
    One refused before any trial began (a trial larger than the cluster) holds nothing to mix:
    the corrected command takes it over."""
    record = {"sweep": sweep_to_dict(plan.sweep), "base": config_to_dict(plan.base)}
    os.makedirs(plan.directory, exist_ok=True)
    target = os.path.join(plan.directory, SWEEP_FILE)
    if os.path.exists(target) and _trials_began(plan.directory):
        with open(target) as f:
            previous = yaml.safe_load(f)
        changed = [key for key, cls in (("sweep", SweepConfig), ("base", Config))
                   if _effective(cls, previous.get(key)) != record[key]]
        if changed:
            raise ConfigError(f"{plan.directory} holds a sweep started with different settings ({', '.join(changed)} "
                              f"differ from {path} and the overrides; see {target}): resume it with the same "
                              "command, or choose another run.name")
        return
    storage.write_bytes(target, yaml.safe_dump(record, sort_keys=False).encode())  # whole or not at all


def _threads(cpus: float) -> int:
    """Torch threads of a trial: its whole CPUs (the trial caps them at its node's cores)."""
    return max(1, int(cpus))


def _cluster_share(per_trial: float, kind: str, field: str = "") -> int:
    import ray

    total = ray.cluster_resources().get(kind, 0.0)
    if per_trial > total:
        raise ConfigError(f"{field or f'trial.{kind.lower()}s'}={per_trial} but the Ray cluster has {total:g} {kind}s")
    return int(total // per_trial)


class _NoTunerRestoreHint(logging.Filter):
    """An interrupted Tune experiment tells the user to call `Tuner.restore(...)`; a sweep is
    resumed by running its own command again, which raylm says instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tuner.restore(" not in record.getMessage()


_NO_TUNER_RESTORE_HINT = _NoTunerRestoreHint()


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
                                        num_samples=num_samples, max_concurrent_trials=concurrency,
                                        # a new process per trial costs ~5 s of start and imports,
                                        # more than a small rung's training on 2 cores
                                        reuse_actors=True),
            run_config=tune.RunConfig(name=name, storage_path=plan.directory, verbose=1,
                                      failure_config=tune.FailureConfig(max_failures=plan.sweep.trial.max_failures)))
    logging.getLogger("ray.tune.tune").addFilter(_NO_TUNER_RESTORE_HINT)  # the same filter is added once
    return tuner.fit()


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


def _rows(plan: Plan, grid, phase: str, expected: int) -> list[dict]:
    """trials.csv rows of one experiment's results. Tune returns early when interrupted (Ctrl-C,
    SIGTERM): a trial neither finished, failed nor stopped by ASHA, or a trial not yet created,
    means the phase did not end, and the sweep stops there (the same command resumes it)."""
    from raylm.sweep.search import stopped_by_asha

    seq_len = plan.resolved.train.seq_len
    stopped = stopped_by_asha(os.path.join(plan.directory, ASHA_STATE_FILE))
    rows = []
    for result in grid:
        config, metrics = _trial_config(result), dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or os.path.basename(result.path or "?")
        if config is None:
            raise SweepInterrupted(f"the sweep was interrupted ({trial_id} of {phase} did not start); run the same "
                                   "command again to resume it (finished trials are kept)")
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
                     "seed": config.get("seed", 0)})
    if len(rows) < expected:
        raise SweepInterrupted(f"the sweep was interrupted ({len(rows)} of {expected} trials of {phase} created); "
                               "run the same command again to resume it (finished trials are kept)")
    return sorted(rows, key=lambda r: (r["phase"] != "ladder", r["params"], r["tokens"], r["lr"]))


def noise_rung(fitted: list[dict], held_out_budget: str) -> str:
    """The rung whose seeds make the noise floor: the largest fitted size's, at the held-out rung's
    budget where it has one (else its smallest). `fitted`: rows or rung bests of the ladder."""
    largest = [r for r in fitted if r["params"] == max(x["params"] for x in fitted)]
    return next((r for r in largest if r["budget"] == held_out_budget), min(largest, key=lambda r: r["tokens"]))["rung"]


def _repeats(plan: Plan, name: str, phase: str, slots: list, trials: TrialPlan, resources: dict,
             concurrency: int) -> list[dict]:
    """Trials at decided rates and seeds (RungSlots) as one Tune experiment; their rows."""
    from raylm.sweep.search import RungSearcher

    grid = _run_phase(plan, name, trials, resources, searcher=RungSearcher(slots, plan.sweep, plan.batches),
                      num_samples=len(slots), concurrency=concurrency)
    return _rows(plan, grid, phase, expected=len(slots))


def _seeds_phase(plan: Plan, rows: list[dict], noisy: Optional[str], trials: TrialPlan,
                 concurrency: int) -> list[dict]:
    """Fitted rungs trained again at their best trial's learning rate with other seeds
    (`train.seed`, `data.seed`): every rung ladder.seeds - 1 times (the fits take the mean), and
    the noise rung `noisy` (with `check`) at least NOISE_SEEDS times (the spread of its losses is
    the noise floor a prediction is judged by)."""
    from raylm.sweep.search import RungSlot

    repeats = {rung: plan.sweep.ladder.seeds - 1 for rung in {r["rung"] for r in rows if r["status"] == COMPLETED}}
    if noisy is not None:
        repeats[noisy] = max(repeats[noisy], NOISE_SEEDS)
    slots = []
    for rung in sorted(repeats, key=lambda name: -plan.rung(name).target_tokens * plan.rung(name).size.flops_per_token):
        best = min((r for r in rows if r["rung"] == rung and r["status"] == COMPLETED), key=lambda r: r["val_loss"])
        slots += [RungSlot(rung, 1.0, best["lr"], best["batch"], seed) for seed in range(1, repeats[rung] + 1)]
    if not slots:
        return []
    resources = {"CPU": plan.sweep.trial.cpus, "GPU": plan.sweep.trial.gpus}
    return _repeats(plan, "tune-seeds", "seeds", slots, trials, resources, concurrency)


def noise_floor(ladder_rows: list[dict], seed_rows: list[dict], rung: str) -> Optional[dict]:
    """The noise rung's repeats beside the ladder trial they repeat, and the relative spread of
    their losses ((max - min) / mean): None without two completed losses."""
    seed_rows = [r for r in seed_rows if r["rung"] == rung]
    if not seed_rows:
        return None
    first = seed_rows[0]
    original = [r for r in ladder_rows if r["rung"] == first["rung"] and r["status"] == COMPLETED
                and r["batch"] == first["batch"] and math.isclose(r["lr"], first["lr"], rel_tol=1e-9)]
    repeats = sorted((r for r in seed_rows if r["status"] == COMPLETED), key=lambda r: r.get("seed", 0))
    losses = [r["val_loss"] for r in original[:1] + repeats]
    if len(losses) < 2:
        return None
    return {"rung": first["rung"], "lr": first["lr"], "seeds": [int(r.get("seed", 0)) for r in original[:1] + repeats],
            "losses": losses, "relative_spread": (max(losses) - min(losses)) / float(np.mean(losses))}


def _grid_search(values: list):
    from ray import tune

    return tune.grid_search(values)


def _check_phase(plan: Plan, laws: analysis.Laws, bests: list[dict], trials: TrialPlan, cpus: float):
    """Predict the held-out rung from the chosen predictor, then train it at the predicted
    learning rate and at that rate x 2^-1/2 and x 2^1/2: the loss at the picked rate is the
    check, and the best of the three says whether the pick was good. Then the check's repeats:
    the picked rate with ladder.seeds - 1 other seeds, and each of check_shapes with every seed."""
    from raylm.sweep.search import RungSlot

    rung = ladder.held_out_rung(plan.rungs)
    path = os.path.join(plan.directory, CHECK_PLAN_FILE)
    if os.path.exists(path):  # the prediction made before an interruption stands
        with open(path) as f:
            check = json.load(f)
    else:
        largest = max(bests, key=lambda b: b["params"])
        lr = analysis.predicted_lr(laws, rung.size.params, fallback=largest["lr"])
        batch = largest["batch"]  # the largest fitted size's best (batch sizes are not extrapolated here)
        seq_len = plan.resolved.train.seq_len

        def tokens(r: ladder.Rung) -> int:
            return ladder.steps_for(r.target_tokens, batch, seq_len) * batch * seq_len

        check = {"rung": rung.name, "params": rung.size.params, "tokens": tokens(rung), "lr": lr, "batch": batch,
                 "shapes": [{"rung": r.name, "params": r.size.params, "tokens": tokens(r),
                             "lr": analysis.predicted_lr(laws, r.size.params, fallback=lr),
                             **{k: getattr(r.size.model, k) for k in ("d_model", "n_layers", "n_heads")}}
                            for r in plan.rungs if r.held_out and r is not rung]}
        with open(path, "w") as f:
            json.dump(check, f, indent=1)
    check.update(predict_check(laws, check))
    print(f"raylm: check: {rung.size.params:,} parameters x {check['tokens']:,} tokens, predicted val loss "
          f"{check['predicted_loss']:.4f} {check['interval']} ({check['predictor']}), training it at lr "
          f"{check['lr']:.3g} and x 2^-1/2, x 2^1/2", flush=True)
    trial = plan.sweep.trial
    resources = {"CPU": cpus, "GPU": trial.gpus}
    # As many at once as the cluster holds: one at a time when each takes every CPU (the default).
    concurrency = min(_cluster_share(cpus, "CPU", "trial.check_cpus"),
                      _cluster_share(trial.gpus, "GPU") if trial.gpus else math.inf,
                      trial.max_concurrent or math.inf)
    lrs = [check["lr"] * factor for factor in LR_PICK_FACTORS]
    trials = dataclasses.replace(trials, threads=_threads(cpus))
    grid = _run_phase(plan, "tune-check", trials, resources, concurrency=int(concurrency),
                      param_space={"rung": rung.name, "lr": _grid_search(lrs), "batch": check["batch"]})
    rows = _rows(plan, grid, "check", expected=len(lrs))
    others = [b for b in plan.batches if b != check["batch"]]
    if others:  # batch sizes were swept: the batch picked is checked against them, at the picked rate
        print(f"raylm: check: batch {check['batch']} against {others} at lr {check['lr']:.3g}", flush=True)
        grid = _run_phase(plan, "tune-check-batch", trials, resources, concurrency=int(concurrency),
                          param_space={"rung": rung.name, "lr": check["lr"], "batch": _grid_search(others)})
        rows += _rows(plan, grid, "check-batch", expected=len(others))
    seeds = plan.sweep.ladder.seeds
    slots = [RungSlot(rung.name, 1.0, check["lr"], check["batch"], seed) for seed in range(1, seeds)]
    slots += [RungSlot(shape["rung"], 1.0, shape["lr"], check["batch"], seed)
              for shape in check.get("shapes", []) for seed in range(seeds)]
    if slots:
        print(f"raylm: check: {len(slots)} repeats ({seeds} seed(s) of the held-out size in "
              f"{1 + len(check.get('shapes', []))} shape(s))", flush=True)
        rows += _repeats(plan, "tune-check-repeats", "check-repeats", slots, trials, resources, int(concurrency))
    return check, rows


def predict_check(laws: analysis.Laws, check: dict) -> dict:
    """The held-out rung's prediction by the chosen predictor, and by each of them; the same for
    each of the check's other shapes."""
    chosen = laws.predict(check["params"], check["tokens"])
    by_predictor = {name: laws.predict(check["params"], check["tokens"], name)["loss"] for name in laws.predictors}
    shapes = [dict(shape, predicted_loss=laws.predict(shape["params"], shape["tokens"])["loss"],
                   by_predictor={name: laws.predict(shape["params"], shape["tokens"], name)["loss"]
                                 for name in laws.predictors})
              for shape in check.get("shapes", [])]
    return {"predictor": laws.chosen, "predicted_loss": chosen["loss"], "interval": chosen["interval"],
            "bootstrap_failed": chosen["bootstrap_failed"], "by_predictor": by_predictor, "shapes": shapes}


def _averaged(check: dict, check_rows: list[dict]) -> Optional[dict]:
    """The check's error averaged over seeds and shapes: per shape (the held-out one at the picked
    rate, then check_shapes), the mean loss of its seeds against its prediction; then the mean of
    those errors. None when the check was not repeated."""
    repeats = [r for r in check_rows if r["phase"] == "check-repeats"]
    if not repeats:
        return None
    held_out = {k: check[k] for k in ("rung", "params", "tokens", "lr", "predicted_loss", "by_predictor")}
    by_shape = []
    for shape in [held_out, *check["shapes"]]:
        losses = [r["val_loss"] for r in check_rows if r["rung"] == shape["rung"] and r["status"] == COMPLETED
                  and (r["phase"] == "check-repeats" or (r["phase"] == "check" and
                                                          math.isclose(r["lr"], shape["lr"], rel_tol=1e-9)))]
        entry = dict(shape, losses=losses)
        if losses:
            mean = float(np.mean(losses))
            entry.update(measured_loss=mean, relative_error=(shape["predicted_loss"] - mean) / mean,
                         errors_by_predictor={k: (v - mean) / mean for k, v in shape["by_predictor"].items()})
        by_shape.append(entry)
    measured = [e for e in by_shape if "relative_error" in e]
    out = {"shapes": by_shape, "measured_shapes": len(measured)}
    if measured:
        out["relative_error"] = float(np.mean([e["relative_error"] for e in measured]))
        out["errors_by_predictor"] = {k: float(np.mean([e["errors_by_predictor"][k] for e in measured]))
                                      for k in measured[0]["errors_by_predictor"]}
    return out


def measure_check(check: dict, check_rows: list[dict], noise: Optional[dict]) -> dict:
    """The check's measured side from its trials: the loss at the picked learning rate (and
    batch), its error, and each pick against the best of the values tried for it: the learning
    rates ("check" trials) and, when batch sizes were swept, the other batch sizes at the picked
    rate ("check-batch")."""
    lr_rows = [r for r in check_rows if r["phase"] == "check"]
    done = [r for r in lr_rows if r["status"] == COMPLETED]
    picked = next((r for r in done if math.isclose(r["lr"], check["lr"], rel_tol=1e-9)), None)
    out = dict(check, measured_loss=picked["val_loss"] if picked else None,
               noise_floor=noise["relative_spread"] if noise else None)
    if picked:
        measured = picked["val_loss"]
        out["relative_error"] = (check["predicted_loss"] - measured) / measured
        out["within_interval"] = check["interval"][0] <= measured <= check["interval"][1]
        out["errors_by_predictor"] = {k: (v - measured) / measured for k, v in check["by_predictor"].items()}
    if picked:
        out["lr_pick"] = _pick("lr", picked, lr_rows, noise)
        batch_rows = [r for r in check_rows if r["phase"] == "check-batch"]
        if batch_rows:
            out["batch_pick"] = _pick("batch", picked, [picked, *batch_rows], noise)
    if averaged := _averaged(check, check_rows):
        out["averaged"] = averaged
    return out


def _pick(knob: str, picked: dict, tried: list[dict], noise: Optional[dict]) -> dict:
    """The picked trial's loss against the best of those tried for `knob`: good when within the
    noise floor."""
    best = min((r for r in tried if r["status"] == COMPLETED), key=lambda r: r["val_loss"])
    gap = (picked["val_loss"] - best["val_loss"]) / best["val_loss"]
    return {f"picked_{knob}": picked[knob], "picked_loss": picked["val_loss"], f"best_{knob}": best[knob],
            "best_loss": best["val_loss"], "relative_gap": gap,
            "tried": {f"{r[knob]:.6g}": r["val_loss"] for r in tried},
            "good": None if noise is None else gap <= noise["relative_spread"]}


def write_trials(directory: str, rows: list[dict]) -> None:
    # Whole or not at all: a sweep run again over its directory rewrites it, and --refit needs it.
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    storage.write_bytes(os.path.join(directory, TRIALS_FILE), text.getvalue().encode())


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
    if allocation := info.get("allocation"):
        low, high = allocation["ladder_tokens_per_param"]
        header += (f"# {info['tokens_per_param']:.3g} tokens per parameter, not the fit's optimum "
                   f"({allocation['fit_tokens_per_param']:,.3g}): outside the {low:g} to {high:g} the ladder trained.\n")
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
    from raylm.sweep.search import RungASHA, RungSearcher, plan_slots

    sweep = plan.sweep
    _check_same_sweep(plan, path)
    base = plan.base
    start_ray(base.run.ray_address, base.run.ray_num_cpus, max(1, int(sweep.trial.cpus)), dashboard=base.run.dashboard)
    kind, per_trial = ("GPU", sweep.trial.gpus) if sweep.trial.gpus > 0 else ("CPU", sweep.trial.cpus)
    concurrency = min(_cluster_share(per_trial, kind), sweep.trial.max_concurrent or math.inf)
    if sweep.check and sweep.trial.check_cpus:  # now, not after the ladder's hours
        _cluster_share(sweep.trial.check_cpus, "CPU", "trial.check_cpus")
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
    completed = [r for r in rows if r["status"] == COMPLETED]
    noisy = noise_rung(completed, ladder.held_out_rung(plan.rungs).budget) if sweep.check else None
    seed_rows = _seeds_phase(plan, rows, noisy, trials, int(concurrency))
    result, laws = analysis.analyze(rows, plan.sizes, sweep, seed_rows, log=_say)
    result = {"sweep": plan.directory, "asha": _asha_savings(rows), **result}
    check_rows = []
    if sweep.check and laws.predictors:
        import ray

        noise = noise_floor(rows, seed_rows, noisy)
        cpus = sweep.trial.check_cpus or ray.cluster_resources().get("CPU", 1)
        check, check_rows = _check_phase(plan, laws, result["rungs"], trials, cpus)
        result["noise"], result["check"] = noise, measure_check(check, check_rows, noise)
    rows += seed_rows + check_rows
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
                                _recommended_yaml(cfg, info, plan.directory).encode())
    result["fitted_with"] = fitted_with()
    result["warnings"] = analysis.warnings(result)
    result["wall_s"] = time.time() - started
    _write_fit(plan.directory, result, rows, laws)
    return result


def fitted_with() -> dict[str, str]:
    """The libraries the fits ran on. Where the ladder leaves the Chinchilla form underdetermined,
    L-BFGS stops at another alpha on another scipy or numpy (benchmarks/RESULTS.md: a record's chosen
    predictor changed), so a refit must be able to tell that its numbers may not be the sweep's."""
    import scipy

    return {"scipy": scipy.__version__, "numpy": np.__version__}


def _write_fit(directory: str, result: dict, rows: list[dict], laws: analysis.Laws) -> None:
    from raylm.sweep import plots

    storage.write_bytes(os.path.join(directory, FIT_FILE), json.dumps(result, indent=1).encode())  # whole or not at all
    plots.write_all(os.path.join(directory, "plots"), rows, result, laws)


def read_trials(directory: str) -> list[dict]:
    """trials.csv's rows with their numbers as numbers (a column a sweep of an earlier raylm did not
    write takes its default)."""
    path = os.path.join(directory, TRIALS_FILE)
    if not os.path.exists(path):
        raise ConfigError(f"{directory} holds no {TRIALS_FILE}: not a finished sweep directory")
    text = ("trial_id", "phase", "rung", "budget", "status")
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            parsed = {}
            for k, v in {"seed": "0", **row}.items():
                if k not in COLUMNS:
                    continue
                try:
                    parsed[k] = v if k in text and v is not None else float(v)
                except (TypeError, ValueError):
                    what = f"has no {k}: the line is cut short" if v is None else f"{k}={v!r} is not a number"
                    raise ConfigError(f"{path} line {reader.line_num}: {what}; a sweep writes this file whole, so "
                                      "it was edited or copied in part") from None
            rows.append(parsed)
    return rows


def _say(line: str) -> None:
    print(f"raylm: {line}", flush=True)


def fit_ladder(directory: str, log: Optional[Callable[[str], None]] = None) -> tuple[list[dict], dict, analysis.Laws]:
    """The ladder's fits from the sweep directory alone (sweep.yaml, trials.csv): its trials, the
    fits' record and the laws they make, with no data and no Ray; `log` is told how they progress."""
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
    if log is not None:
        log(f"fitting {len(ladder_rows)} ladder trials of {len(sizes)} sizes from {os.path.join(directory, TRIALS_FILE)}")
    result, laws = analysis.analyze(ladder_rows, [sizes[i] for i in sorted(sizes)], sweep,
                                    [r for r in rows if r["phase"] == "seeds"], log)
    return rows, result, laws


def refit(directory: str) -> dict:
    """fit.json again from the sweep directory alone (sweep.yaml, trials.csv, check_plan.json): the
    fits, the choice of predictor, the noise floor and the check, with no data and no Ray. The
    recommendation is carried over as the sweep made it: placing it needs the base run's data."""
    rows, result, laws = fit_ladder(directory, _say)
    ladder_rows = [r for r in rows if r["phase"] == "ladder"]
    previous = {}
    if os.path.exists(os.path.join(directory, FIT_FILE)):
        with open(os.path.join(directory, FIT_FILE)) as f:
            previous = json.load(f)
    result = {"sweep": directory, "asha": _asha_savings(ladder_rows), **result}
    plan_path = os.path.join(directory, CHECK_PLAN_FILE)
    check_rows = [r for r in rows if r["phase"] in ("check", "check-batch", "check-repeats")]
    if laws.predictors and check_rows and os.path.exists(plan_path):
        with open(plan_path) as f:
            check = json.load(f)
        check.update(predict_check(laws, check))
        held_out_budget = next(r["budget"] for r in check_rows if r["rung"] == check["rung"])
        noise = noise_floor(ladder_rows, [r for r in rows if r["phase"] == "seeds"],
                            noise_rung(result["rungs"], held_out_budget))
        result["noise"], result["check"] = noise, measure_check(check, check_rows, noise)
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
    _write_fit(directory, result, rows, laws)
    return result


def _versions(libraries: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in sorted(libraries.items()))


def summary(result: dict) -> str:
    """What `raylm sweep` prints at the end."""
    asha = result["asha"]
    took = f", {result['wall_s'] / 60:.1f} min" if result.get("wall_s") is not None else ""
    lines = [f"sweep {result['sweep']}: {asha['trials']} ladder trials, {asha['stopped_early']} stopped early by ASHA "
             f"({100 * asha['saved_fraction']:.0f}% of the planned compute saved){took}"]
    p = result.get("parametric", {})
    if "E" in p:
        lines.append(f"fit: L(N, D) = {p['E']:.3f} + {p['A']:.3g}/N^{p['alpha']:.3f} + {p['B']:.3g}/D^{p['beta']:.3f}")
    else:
        lines.append(f"fit: none ({p.get('error')})")
    law = result["lr"].get("lr_vs_params", {})
    if "coef" in law:
        lines.append(f"best lr: {law['coef']:.3g} * N^{law['exponent']:.3f}")
    chosen = result.get("predictor")
    if chosen:
        lines.append(f"predictor: {chosen['chosen']} ({chosen['why']})")
    noise = result.get("noise")
    if noise:
        losses = ", ".join(f"{x:.4f}" for x in noise["losses"])
        lines.append(f"noise floor: {100 * noise['relative_spread']:.2f}% (losses {losses} "
                     f"of {noise['rung']} with seeds {noise['seeds']})")
    check = result.get("check")
    if check and check.get("measured_loss") is not None:
        others = ", ".join(f"{k} {100 * v:+.2f}%" for k, v in check["errors_by_predictor"].items())
        lines.append(f"check: {check['params']:,} parameters, {check['tokens']:,} tokens: "
                     f"predicted {check['predicted_loss']:.4f} "
                     f"[{check['interval'][0]:.4f}, {check['interval'][1]:.4f}], measured {check['measured_loss']:.4f} "
                     f"({100 * check['relative_error']:+.2f}%; by predictor: {others})")
    averaged = (check or {}).get("averaged")
    if averaged and "relative_error" in averaged:
        shapes = "; ".join(f"{e['rung']} {e['params']:,} params {e['measured_loss']:.4f} over {len(e['losses'])} "
                           f"seed(s) ({100 * e['relative_error']:+.2f}%)" for e in averaged["shapes"] if e["losses"])
        others = ", ".join(f"{k} {100 * v:+.2f}%" for k, v in averaged["errors_by_predictor"].items())
        lines.append(f"check over {averaged['measured_shapes']} shape(s) and their seeds: mean error "
                     f"{100 * averaged['relative_error']:+.2f}% (by predictor: {others}; {shapes})")
    for knob, shown in (("lr", ".3g"), ("batch", "g")):
        pick = (check or {}).get(f"{knob}_pick")
        if pick:
            lines.append(f"{knob} pick: {pick[f'picked_{knob}']:{shown}} -> {pick['picked_loss']:.4f}; best of the "
                         f"{len(pick['tried'])} {pick[f'best_{knob}']:{shown}} -> {pick['best_loss']:.4f} "
                         f"({100 * pick['relative_gap']:+.2f}%"
                         + ("" if pick["good"] is None else f", {'within' if pick['good'] else 'beyond'} the noise floor")
                         + ")")
    rec = result.get("recommended")
    if rec and "error" not in rec:
        # A refit keeps the sweep's recommendation: say so, or its loss reads as the refit's prediction.
        lines.append(f"recommended: {rec['params']:,} parameters, {rec['tokens']:,} tokens, lr {rec['lr']:.3g}, "
                     f"predicted loss {rec['predicted_loss']['loss']:.4f} -> {result['sweep']}/{RECOMMENDED_FILE}"
                     + (f" ({rec['refit']})" if "refit" in rec else ""))
    lines += [f"warning: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines)
