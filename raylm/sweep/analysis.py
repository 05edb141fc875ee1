"""From the sweep's trial table to fit.json's contents, predictions and the recommended run.

Pure functions (no Ray): rows are dicts with the columns of trials.csv.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np

from raylm.config import Config, ParallelConfig, config_from_dict, config_to_dict
from raylm.parallel.layout import ParallelDims
from raylm.progress import Progress
from raylm.sweep import fit
from raylm.sweep.config import SweepConfig
from raylm.sweep.ladder import Size, build_rungs, schedule_shape, shape_for_params, steps_for
from raylm.train.spec import absolute, resolve_run

COMPLETED, STOPPED, DIVERGED, ERROR = "completed", "stopped_early", "diverged", "error"
LR_SEARCH = "lr-search"  # sweep.parametrization=mup: the phase that searches the rate at the base width
CHINCHILLA, LOCAL = "chinchilla", "local"
PREDICTORS = (CHINCHILLA, LOCAL)
CONSTANTS = {CHINCHILLA: 5, LOCAL: 3}
CHINCHILLA_FORM, LOCAL_FORM = "L(N, D) = E + A / N^alpha + B / D^beta", "L(N, D) = K / (N^a D^b)"
DISAGREEMENT = 0.01  # predictors further apart than this (or the noise floor, when measured) are flagged


def rung_bests(rows: list[dict], repeats: list[dict] = ()) -> list[dict]:
    """Per rung, the best learning rate and its loss, both refined by the parabola through the
    best completed trial and its neighbours in log lr (at its best batch size when batch sizes
    were swept): one trial's loss alone carries its seed's noise. The best is at the grid's edge
    when no value tried beyond it, completed or stopped early as worse, brackets it. `repeats`
    (`ladder.seeds`) trained the best trial again with other seeds: the loss is moved by their
    mean's distance from the best trial's, so the refinement keeps its shape and the seed its
    place."""
    by_rung: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_rung[row["rung"]].append(row)
    out = []
    for rung, tried in by_rung.items():
        trials = [r for r in tried if r["status"] == COMPLETED]
        if not trials:
            continue
        best = min(trials, key=lambda r: r["val_loss"])
        same_batch = [r for r in trials if r["batch"] == best["batch"]]
        lr, loss, _ = fit.best_lr([r["lr"] for r in same_batch], [r["val_loss"] for r in same_batch])
        lrs = {r["lr"] for r in tried if r["batch"] == best["batch"] and r["status"] != ERROR}
        at_edge = len(lrs) > 1 and best["lr"] in (min(lrs), max(lrs))
        entry = {"rung": rung, "budget": best["budget"], "size": best["size"], "params": best["params"],
                 "tokens": best["tokens"], "flops": best["flops"], "loss": loss,
                 "best_trial_loss": best["val_loss"], "lr": lr,
                 "lr_at_grid_edge": at_edge, "batch": best["batch"], "trials": len(trials)}
        seeds = [r["val_loss"] for r in repeats if r["rung"] == rung and r["status"] == COMPLETED
                 and r["batch"] == best["batch"] and math.isclose(r["lr"], best["lr"], rel_tol=1e-9)]
        if seeds:
            entry["seed_losses"] = [best["val_loss"], *seeds]
            entry["loss"] = loss + float(np.mean(entry["seed_losses"])) - best["val_loss"]
        out.append(entry)
    return sorted(out, key=lambda r: (r["params"], r["tokens"]))


@dataclass(frozen=True)
class Predictor:
    """One form of L(N, D) fitted to the ladder, with its bootstrap refits."""

    name: str
    form: str
    fit: Union[fit.Parametric, fit.LocalPowerLaw]
    bootstrap: list

    def predict(self, params: float, tokens: float, confidence: float) -> dict:
        """The loss, and the interval of the bootstrap refits' predictions. A refit gone degenerate
        (a constant past float range) predicts no finite loss: it is counted in `bootstrap_failed`
        and left out of the interval, which one NaN would make NaN at both ends."""
        loss = float(self.fit.loss(params, tokens))
        samples = np.array([b.loss(params, tokens) for b in self.bootstrap], float)
        finite = samples[np.isfinite(samples)]
        return {"loss": loss, "interval": fit.interval(finite, confidence) if finite.size else [loss, loss],
                "bootstrap_failed": int(samples.size - finite.size)}


@dataclass
class Laws:
    """The fitted rules a prediction or recommendation uses. `parametric` (Chinchilla's form) places
    the compute-optimal N and D; a loss is predicted by the `chosen` one of `predictors`."""

    parametric: Optional[fit.Parametric]
    bootstrap: list[fit.Parametric]
    lr_vs_params: Optional[dict]
    batch_vs_flops: Optional[dict]
    flops_per_token: Callable[[float], float]
    confidence: float
    predictors: dict[str, Predictor] = field(default_factory=dict)
    chosen: str = CHINCHILLA

    def predict(self, params: float, tokens: float, predictor: Optional[str] = None) -> dict:
        name = predictor or self.chosen
        if name in self.predictors:
            return self.predictors[name].predict(params, tokens, self.confidence)
        return Predictor(CHINCHILLA, CHINCHILLA_FORM, self.parametric, self.bootstrap).predict(
            params, tokens, self.confidence)


def local_rungs(bests: list[dict], sweep: SweepConfig) -> list[dict]:
    """The rungs the local form is fitted on: those of the largest `fit.local_sizes` sizes (0: all)."""
    sizes = sorted({b["params"] for b in bests})
    return [b for b in bests if b["params"] in (sizes[-sweep.fit.local_sizes:] if sweep.fit.local_sizes else sizes)]


def fit_predictor(name: str, bests: list[dict], sweep: SweepConfig, resamples: int,
                  log: Optional[Callable[[str], None]] = None) -> Predictor:
    """`name`'s form fitted to these rungs (ValueError when they cannot determine it). The local
    form takes the rungs of the largest `fit.local_sizes` sizes (0, the default: every size).
    `log` is told how the Chinchilla form's bootstrap refits progress (minutes on a small machine)."""
    if name == CHINCHILLA:
        if len(bests) < 5:
            raise ValueError(f"{len(bests)} rungs; the Chinchilla form has 5 constants and needs at least 5")
        n, d, loss = ([b[k] for b in bests] for k in ("params", "tokens", "loss"))
        p = fit.fit_parametric(n, d, loss, delta=sweep.fit.huber_delta)
        boots = fit.bootstrap_parametric(n, d, loss, p, resamples, sweep.fit.seed, sweep.fit.huber_delta,
                                         _progress(f"fit: {name}: bootstrap refits", resamples, log)) \
            if resamples else []
        return Predictor(name, CHINCHILLA_FORM, p.fit, boots)
    points = local_rungs(bests, sweep)
    n, d, loss = ([b[k] for b in points] for k in ("params", "tokens", "loss"))
    local = fit.fit_local(n, d, loss)
    return Predictor(name, LOCAL_FORM, local, fit.bootstrap_local(n, d, loss, resamples, sweep.fit.seed))


def _progress(what: str, total: int, log: Optional[Callable[[str], None]]) -> Optional[Callable[[int], None]]:
    """A counter's reporter (`raylm.progress`: a bar on a terminal, else lines through `log`) told
    how many of `total` are done; None without a `log`."""
    if log is None:
        return None
    progress = Progress(what, total, say=log)

    def report(done: int) -> None:
        progress.update(done - progress.done)
        if done == total:
            progress.close()
    return report


def cross_validate(bests: list[dict], sweep: SweepConfig) -> dict[str, dict]:
    """Each predictor's error inside the ladder: fitted without the largest size's rungs, it
    predicts them. The held-out rung plays no part."""
    largest = max(b["params"] for b in bests)
    kept, left_out = [b for b in bests if b["params"] < largest], [b for b in bests if b["params"] == largest]
    out = {}
    kept_sizes = len({b["params"] for b in kept})
    for name in PREDICTORS:
        if name == CHINCHILLA and kept_sizes < 3:
            # Over k sizes the rungs fix only k offsets E + A/N^alpha: with k < 3 every alpha fits them
            # equally well (E and A follow), and each predicts the largest size differently, so the
            # error is wherever L-BFGS stopped, and moves with the scipy it runs on.
            out[name] = {"error": f"fitted on the {kept_sizes} smaller sizes, E + A/N^alpha fits them equally well "
                                  "at every alpha, each predicting the largest differently: checking this form needs a "
                                  "ladder of at least 4 sizes"}
            continue
        try:
            predictor = fit_predictor(name, kept, sweep, resamples=0)
        except (ValueError, np.linalg.LinAlgError) as e:
            out[name] = {"error": str(e)}
            continue
        out[name] = validation_entry(predictor.fit, left_out)
    return out


def validation_entry(law: Union[fit.Parametric, fit.LocalPowerLaw], left_out: list[dict]) -> dict:
    """A law's cross-validation: its relative errors on the left-out size's rungs, or why it has none."""
    errors = [float((law.loss(b["params"], b["tokens"]) - b["loss"]) / b["loss"]) for b in left_out]
    if not all(map(math.isfinite, errors)):  # NaN would win or lose every comparison at random
        constants = ", ".join(f"{k} {v:.3g}" for k, v in law.to_dict().items())
        return {"error": f"fitted without the largest size it is degenerate ({constants}): its "
                         "prediction of that size is not a number"}
    return {"left_out_params": left_out[0]["params"], "relative_errors": errors,
            "mean_abs_error": float(np.mean(np.abs(errors)))}


def choose_predictor(validation: dict[str, dict], noise_floor: Optional[float] = None) -> tuple[str, str]:
    """(the predictor with the smallest cross-validated error, why); Chinchilla's form when none
    could be checked. One with fewer constants whose error is within `noise_floor` of the smallest
    is chosen instead (the one-standard-error rule, Hastie et al., "The Elements of Statistical
    Learning", 7.10): a difference smaller than the seeds alone move a rung's loss is no evidence
    for the form that extrapolates on more constants."""
    checked = {name: v["mean_abs_error"] for name, v in validation.items() if "mean_abs_error" in v}
    if not checked:
        return CHINCHILLA, "no predictor could be cross-validated inside the ladder; Chinchilla's form by default"
    best = min(checked, key=lambda k: (checked[k], k != CHINCHILLA))
    name = min((k for k in checked if checked[k] <= checked[best] + (noise_floor or 0)),
               key=lambda k: (CONSTANTS[k], checked[k]))
    others = [f"{k} {100 * v:.2f}%" for k, v in checked.items() if k != name]
    others += [f"{k} could not be checked: {v['error']}" for k, v in validation.items() if k not in checked]
    against = f" (against {'; '.join(others)})" if others else ""
    error = f"{100 * checked[name]:.2f}%"
    if name == best:
        return name, f"smallest error predicting the largest fitted size from the smaller ones: {error}{against}"
    return name, (f"fewer constants, and its error predicting the largest fitted size from the smaller ones, {error}, "
                  f"is within the noise floor ({100 * noise_floor:.2f}%) of the smallest{against}")


def _safe(f: Callable[[], dict]) -> dict:
    """A fit that cannot be made (too few points, degenerate data) is recorded, not fatal."""
    try:
        return f()
    except (ValueError, np.linalg.LinAlgError) as e:
        return {"error": str(e)}


def _lr_fits(bests: list[dict], sweep: SweepConfig) -> dict:
    """fit.json's "lr": each size's best LR (the geometric mean over its rungs), the LR's power laws
    in parameters and in FLOPs, and the rungs whose best LR lies at the edge of the grid."""
    per_size: dict[int, list[dict]] = defaultdict(list)
    for b in bests:
        per_size[b["size"]].append(b)
    size_lr = [{"size": s, "params": v[0]["params"], "lr": float(math.exp(np.mean([math.log(b["lr"]) for b in v])))}
               for s, v in sorted(per_size.items())]
    if sweep.parametrization == "mup":  # every size trained at the one rate transferred from the base width
        lr_law = {"coef": bests[0]["lr"], "exponent": 0.0}
    else:
        lr_law = _safe(lambda: fit.power_law([s["params"] for s in size_lr], [s["lr"] for s in size_lr]))
    return {"per_size": size_lr, "lr_vs_params": lr_law,
            "lr_vs_flops": _safe(lambda: fit.power_law([b["flops"] for b in bests], [b["lr"] for b in bests])),
            "at_grid_edge": [b["rung"] for b in bests if b["lr_at_grid_edge"]]}


def _batch_fits(bests: list[dict]) -> dict:
    """fit.json's "batch" (a ladder of several batch sizes): each rung's best batch size, and its
    power laws in parameters and in FLOPs."""
    batches = [b["batch"] for b in bests]
    return {"per_rung": [{"rung": b["rung"], "batch": b["batch"]} for b in bests],
            "batch_vs_params": _safe(lambda: fit.power_law([b["params"] for b in bests], batches)),
            "batch_vs_flops": _safe(lambda: fit.power_law([b["flops"] for b in bests], batches))}


def analyze(rows: list[dict], sizes: list[Size], sweep: SweepConfig, repeats: list[dict] = (),
            log: Optional[Callable[[str], None]] = None, noise_floor: Optional[float] = None) -> tuple[dict, Laws]:
    """fit.json's fits from the ladder's trials (the held-out rung's trial is not among `rows`);
    with ladder.seeds > 1, on the mean over each rung's seeds (`repeats`: the "seeds" phase).
    `log` is told how the slow fits progress; `noise_floor` (relative) is the margin within which
    the predictor with fewer constants is chosen."""
    bests = rung_bests(rows, repeats if sweep.ladder.seeds > 1 else ())
    result: dict = {"params_count": sweep.fit.params, "parametrization": sweep.parametrization, "rungs": bests,
                    "lr": _lr_fits(bests, sweep)}
    batch_law = None
    if len(sweep.ladder.batch_size) > 1:
        result["batch"] = _batch_fits(bests)
        batch_law = result["batch"]["batch_vs_flops"] if "coef" in result["batch"]["batch_vs_flops"] else None
    f_law = fit.flops_per_token_law([s.params for s in sizes], [s.flops_per_token for s in sizes])

    parametric, boots, predictors = None, [], {}
    for name in PREDICTORS:
        try:
            predictors[name] = fit_predictor(name, bests, sweep, sweep.fit.bootstrap, log)
        except (ValueError, np.linalg.LinAlgError) as e:
            result.setdefault("predictors", {})[name] = {"error": str(e)}
    if CHINCHILLA in predictors:
        parametric, boots = predictors[CHINCHILLA].fit, predictors[CHINCHILLA].bootstrap
        predicted = parametric.loss([b["params"] for b in bests], [b["tokens"] for b in bests])
        result["parametric"] = {
            "form": CHINCHILLA_FORM, **parametric.to_dict(),
            "interval": {k: fit.interval([getattr(b, k) for b in boots], sweep.fit.confidence) for k in fit.NAMES}
            if boots else {},
            "confidence": sweep.fit.confidence, "bootstrap": len(boots), "huber_delta": sweep.fit.huber_delta,
            "residuals": [{"rung": b["rung"], "params": b["params"], "tokens": b["tokens"], "loss": b["loss"],
                           "fitted": float(fl), "relative": float((b["loss"] - fl) / fl)}
                          for b, fl in zip(bests, predicted)]}
    else:
        result["parametric"] = {"error": f"{len(bests)} rungs completed; the fit needs at least 5"}
    validation = cross_validate(bests, sweep) if len({b["params"] for b in bests}) >= 3 else {}
    chosen, why = choose_predictor({k: v for k, v in validation.items() if k in predictors}, noise_floor)
    if chosen not in predictors and predictors:
        chosen, why = next(iter(predictors)), f"the only predictor the ladder determines ({why})"
    for name, predictor in predictors.items():
        result.setdefault("predictors", {})[name] = {
            "form": predictor.form, **predictor.fit.to_dict(),
            "cross_validation": validation.get(name, {"error": "fewer than 3 sizes: nothing to leave out"})}
    result["predictor"] = {"chosen": chosen, "why": why}
    laws = Laws(parametric, boots, result["lr"]["lr_vs_params"] if "coef" in result["lr"]["lr_vs_params"] else None,
                batch_law, f_law, sweep.fit.confidence, predictors, chosen)

    iso_points: dict[float, list[tuple[float, float]]] = defaultdict(list)
    for b in bests:
        if b["budget"].startswith("flops="):
            iso_points[float(b["budget"].split("=", 1)[1])].append((b["params"], b["loss"]))
    if iso_points:
        result["isoflop"] = _safe(lambda: fit.isoflop_fit(dict(iso_points), f_law))
    if parametric is not None:
        result["compute_optimal"] = _compute_optimal(laws, bests, boots)
    return result, laws


def _compute_optimal(laws: Laws, bests: list[dict], boots: list[fit.Parametric]) -> dict:
    """N*(C), D*(C) from the parametric fit with the real FLOPs per token, over the ladder's compute
    range and two decades beyond; power laws through them; and the closed-form exponents of the
    C = 6ND approximation (beta/(alpha+beta), alpha/(alpha+beta)) with bootstrap intervals."""
    low, high = min(b["flops"] for b in bests), max(b["flops"] for b in bests) * 100
    table = []
    for c in np.geomspace(low, high, 7):
        n, d, loss = fit.compute_optimal(laws.parametric, float(c), laws.flops_per_token)
        table.append({"flops": float(c), "params": n, "tokens": d, "tokens_per_param": d / n, "loss": loss})
    p = laws.parametric
    out = {"table": table,
           "params_vs_flops": fit.power_law([t["flops"] for t in table], [t["params"] for t in table]),
           "tokens_vs_flops": fit.power_law([t["flops"] for t in table], [t["tokens"] for t in table]),
           "closed_form_6nd": {"params_exponent": p.beta / (p.alpha + p.beta),
                               "tokens_exponent": p.alpha / (p.alpha + p.beta)}}
    if boots:
        out["closed_form_6nd"]["params_exponent_interval"] = fit.interval(
            [b.beta / (b.alpha + b.beta) for b in boots], laws.confidence)
    return out


def predicted_lr(laws: Laws, params: float, fallback: float) -> float:
    return fit.eval_power_law(laws.lr_vs_params, params) if laws.lr_vs_params else fallback


def recommend(sweep: SweepConfig, laws: Laws, sizes: list[Size], base: Config, resolved: Config,
              largest_flops: float) -> tuple[Config, dict]:
    """A complete `raylm train` config for target.flops or target.params, and its prediction.

    `base` is the user's base run (its parallel layout, checkpointing, data); `resolved` the same
    resolved against the data (vocabulary, seq_len). Raises ValueError when the fit cannot place
    the target (a size the fit never makes compute-optimal)."""
    seq_len = resolved.train.seq_len
    size, tokens, allocation, (low, high) = _place_target(sweep, laws, sizes, resolved)
    if laws.batch_vs_flops:
        batch = fit.eval_power_law(laws.batch_vs_flops, tokens * size.flops_per_token)
    else:
        t = resolved.train
        batch = t.global_batch_size if t.global_batch_size is not None else t.global_batch_tokens // seq_len
    if sweep.target.gpus:  # at least one micro-batch per GPU; the layout may then need a larger batch
        parallel = _cluster_layout(sweep, size, max(batch, sweep.target.gpus * base.train.micro_batch_size) * seq_len,
                                   seq_len, base)
    else:
        parallel = base.parallel
    dp = ParallelDims.of(parallel, parallel.num_workers).dp
    unit = dp * base.train.micro_batch_size  # whole micro-batches on every data-parallel rank
    batch = unit * max(1, round(batch / unit))
    steps = steps_for(tokens, batch, seq_len)
    lr = predicted_lr(laws, size.params, base.optim.lr)
    cfg = _recommended_config(base, resolved, size, parallel, lr, batch, steps)
    # Everything `raylm train` checks before starting (shape, layout, batch split, the data), but
    # the shard checksums: the sweep has just read the data.
    resolve_run(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, verify=False)))
    trained = steps * batch * seq_len
    info = {"target": {"flops": sweep.target.flops, "params": sweep.target.params},
            "params": size.params, "params_non_embedding": size.params_non_embedding,
            "params_total": size.params_total, "tokens": trained, "flops": trained * size.flops_per_token,
            "d_model": size.model.d_model, "n_layers": size.model.n_layers, "n_heads": size.model.n_heads,
            "lr": lr, "batch": batch, "steps": steps,
            "tokens_per_param": trained / size.params,
            "extrapolation": trained * size.flops_per_token / largest_flops,  # x the most compute of any trial
            # Chinchilla's form, whatever predicted the check: the recommendation is a far
            # extrapolation, where a local power law has nothing to stand on.
            "predicted_loss": laws.predict(size.params, trained, CHINCHILLA)}
    if allocation is not None:
        info["allocation"] = {"fit_tokens_per_param": allocation, "ladder_tokens_per_param": [low, high]}
    return cfg, info


def _place_target(sweep: SweepConfig, laws: Laws, sizes: list[Size], resolved: Config
                  ) -> tuple[Size, float, Optional[float], tuple[float, float]]:
    """The target's model size and tokens; the tokens per parameter the fit asked for where the run
    is kept inside the ladder's range instead (else None), and that range."""
    # The fit's balance of N and D is measured only across the ladder's tokens per parameter:
    # an optimum it puts outside them (a far or degenerate extrapolation: thousands of tokens per
    # parameter) is not placed; the run stays at the nearest ratio the ladder trained.
    trained_ratios = [r.target_tokens / r.size.params for r in build_rungs(sweep, sizes) if not r.held_out]
    low, high = min(trained_ratios), max(trained_ratios)
    allocation = None
    if sweep.target.flops:
        n_opt, d_opt, _ = fit.compute_optimal(laws.parametric, sweep.target.flops, laws.flops_per_token)
        if not low <= d_opt / n_opt <= high:
            allocation = d_opt / n_opt
            n_opt = fit.params_for_tokens_per_param(sweep.target.flops, min(max(allocation, low), high),
                                                    laws.flops_per_token)
    else:
        n_opt = sweep.target.params
    size = shape_for_params(n_opt, sweep, sizes, resolved)
    if sweep.target.flops:
        tokens = sweep.target.flops / size.flops_per_token
    else:
        tokens = fit.params_for_tokens_optimal(laws.parametric, size.params, laws.flops_per_token)
        if not low <= tokens / size.params <= high:
            allocation = tokens / size.params
            tokens = min(max(allocation, low), high) * size.params
    return size, tokens, allocation, (low, high)


def _recommended_config(base: Config, resolved: Config, size: Size, parallel: ParallelConfig, lr: float,
                        batch: int, steps: int) -> Config:
    """The user's base run with the recommended model, LR, schedule, batch, steps and layout."""
    warmup_fraction, min_lr_fraction = schedule_shape(base)
    tree = config_to_dict(base)
    tree["model"] = {**config_to_dict(size.model), "size": None, "vocab_size": base.model.vocab_size}
    tree["data"]["path"] = absolute(base.data.path)  # the file runs from any directory
    for component in tree["data"]["mixture"]:
        component["path"] = absolute(component["path"])
    tree["optim"]["lr"] = lr
    tree["schedule"].update(warmup_steps=round(warmup_fraction * steps), min_lr=lr * min_lr_fraction)
    tree["train"].update(steps=steps, global_batch_size=batch, global_batch_tokens=None, stop_at_step=None,
                         eval_every=min(base.train.eval_every, steps) if base.train.eval_every else 0)
    tree["checkpoint"]["every_steps"] = min(base.checkpoint.every_steps, steps)
    tree["run"]["name"] = f"{base.run.name}-recommended"
    tree["run"]["storage_path"] = resolved.run.storage_path
    tree["parallel"] = config_to_dict(parallel)
    return config_from_dict(tree)


def _cluster_layout(sweep: SweepConfig, size: Size, batch_tokens: int, seq_len: int, base: Config):
    """`raylm plan`'s best feasible layout of the recommended model on target.gpus GPUs."""
    from raylm.parallel.planner.plan import parallel_settings, parse_memory, plan

    t = sweep.target
    rows = plan(size.model, t.gpus, t.gpus_per_node, parse_memory(t.gpu_memory), seq_len=seq_len,
                global_batch_tokens=batch_tokens, micro_batch_size=base.train.micro_batch_size,
                activation_checkpointing="auto")
    feasible = [r for r in rows if r.feasible]
    if not feasible:
        raise ValueError(f"no parallel layout of the recommended model fits target.gpus={t.gpus} of "
                         f"{t.gpu_memory}: {rows[0].reason}")
    return ParallelConfig(**{**config_to_dict(base.parallel), **parallel_settings(feasible[0].layout)})


# A size slope that grows by more than this (relative, and absolute) is more than noise.
STEEPENING_RELATIVE, STEEPENING_ABSOLUTE = 0.25, 0.02


def size_slopes(bests: list[dict]) -> dict[str, list[float]]:
    """Per token budget with 3+ sizes: -d log L / d log N between consecutive sizes, smallest first.

    Along one tokens-per-parameter ratio L(N, D) = E + A/N^alpha + B/D^beta can only flatten
    (the slope tends to min(alpha, beta), and to 0 with E > 0). A slope that grows with N means
    the ladder's smaller sizes sit before the power-law regime (an early plateau of the loss),
    and the fit will overpredict the loss of larger models."""
    by_budget: dict[str, list[dict]] = defaultdict(list)
    for b in bests:
        by_budget[b["budget"]].append(b)
    out = {}
    for budget, rungs in by_budget.items():
        rungs = sorted(rungs, key=lambda r: r["params"])
        if len(rungs) >= 3:
            out[budget] = [-(math.log(b["loss"]) - math.log(a["loss"])) / (math.log(b["params"]) - math.log(a["params"]))
                           for a, b in zip(rungs, rungs[1:])]
    return out


def warnings(result: dict) -> list[str]:
    """What in fit.json a reader should not trust, said plainly."""
    out = []
    steepening = {budget: slopes for budget, slopes in size_slopes(result.get("rungs", [])).items()
                  if slopes[-1] - slopes[0] > max(STEEPENING_ABSOLUTE, STEEPENING_RELATIVE * abs(slopes[0]))}
    if steepening:
        listed = "; ".join(f"{b}: {', '.join(f'{s:.3f}' for s in slopes)}" for b, slopes in steepening.items())
        out.append(f"the loss falls faster with N at the larger sizes (log-log slopes, smallest sizes first: {listed}); "
                   "L(N, D) can only flatten along a budget, so the ladder is short of the power-law regime and the "
                   "fit will overpredict the loss of larger models: add larger sizes or more tokens per parameter")
    p = result.get("parametric", {})
    for name, more in (("alpha", "sizes"), ("beta", "token budgets")):
        if name in p and not 0.05 <= p[name] <= 1.5:
            out.append(f"parametric fit: {name} = {p[name]:.3g} lies outside [0.05, 1.5]: the ladder does not "
                       f"determine it; add {more}")
    transfer = result.get("transfer", {})
    if edge := transfer.get("at_grid_edge"):
        out.append(f"the best learning rate at µP's base width lies at the edge of the values tried in "
                   f"{', '.join(edge)}, and every size trained at it: widen the learning-rate grid or range")
    if transfer.get("multiplier_at_grid_edge"):  # every size trained at it
        out.append(f"µP's best output multiplier {transfer['output_multiplier']:g} is the edge of those tried: widen them")
    edge = result.get("lr", {}).get("at_grid_edge", [])
    if edge:
        out.append(f"the best learning rate lies at the edge of the values tried in {', '.join(edge)}: widen the "
                   "learning-rate grid or range there")
    table = result.get("compute_optimal", {}).get("table", [])
    if any(t["params"] < 1.01 * fit.SMALLEST_PARAMS for t in table):
        out.append("the fit puts the compute-optimal N at the smallest size searched: in it, more tokens always "
                   "beat more parameters (beta is small against alpha); N*(C) and the recommendation mean nothing")
    check = result.get("check", {})
    spread = [v for v in check.get("by_predictor", {}).values()]
    floor = check.get("noise_floor") or DISAGREEMENT
    if len(spread) > 1 and (max(spread) - min(spread)) / min(spread) > floor:
        listed = ", ".join(f"{k} {v:.4f}" for k, v in check["by_predictor"].items())
        out.append(f"the predictors disagree on the held-out rung by more than the noise floor ({100 * floor:.2f}%): "
                   f"{listed}; {check['predictor']} was chosen by cross-validation inside the ladder")
    if failed := check.get("bootstrap_failed"):
        out.append(f"{failed} of the {check['predictor']} fit's bootstrap refits predicted no finite loss for the "
                   "held-out rung (degenerate: a constant past float range); its interval is of the others only")
    pick = check.get("lr_pick")
    if pick and pick.get("good") is False:
        mup = result.get("parametrization") == "mup"
        out.append(f"the {'transferred' if mup else 'extrapolated'} learning rate {pick['picked_lr']:.3g} lost "
                   f"{100 * pick['relative_gap']:.2f}% against {pick['best_lr']:.3g}, more than the noise floor: "
                   + ("µP's transfer from the base width did not hold at the held-out size" if mup else
                      "lr_vs_params does not extrapolate well"))
    pick = check.get("batch_pick")
    if pick and pick.get("good") is False:
        out.append(f"the batch size {pick['picked_batch']:g} (the largest fitted size's best) lost "
                   f"{100 * pick['relative_gap']:.2f}% against {pick['best_batch']:g}, more than the noise floor: the "
                   "best batch size moves with the model's size")
    rec = result.get("recommended", {})
    if allocation := rec.get("allocation"):
        low, high = allocation["ladder_tokens_per_param"]
        out.append(f"the fit puts the compute-optimal run at {allocation['fit_tokens_per_param']:,.3g} tokens per "
                   f"parameter, outside the {low:g} to {high:g} the ladder trained: the recommended run stays at "
                   f"{rec['tokens_per_param']:.3g}, the nearest the ladder measured; widen ladder.tokens_per_param to "
                   "place the optimum")
    if rec.get("extrapolation", 0) > 100:
        out.append(f"the recommended run has {rec['extrapolation']:.3g}x the compute of the largest trial: a long "
                   "extrapolation; check.relative_error measures a far shorter one")
    return out
