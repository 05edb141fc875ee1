"""From the sweep's trial table to fit.json's contents, predictions and the recommended run.

Pure functions (no Ray): rows are dicts with the columns of trials.csv.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from raylm.config import Config, ParallelConfig, config_from_dict, config_to_dict
from raylm.sweep import fit
from raylm.sweep.config import SweepConfig
from raylm.sweep.ladder import Size, schedule_shape, shape_for_params, steps_for
from raylm.train.spec import absolute, resolve_run

COMPLETED, STOPPED, DIVERGED, ERROR = "completed", "stopped_early", "diverged", "error"


def rung_bests(rows: list[dict]) -> list[dict]:
    """Per rung, the best completed trial: its loss, and the best learning rate refined between
    the completed values (at its best batch size when batch sizes were swept). It is at the grid's
    edge when no value tried beyond it, completed or stopped early as worse, brackets it."""
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
        lr, _, _ = fit.best_lr([r["lr"] for r in same_batch], [r["val_loss"] for r in same_batch])
        lrs = {r["lr"] for r in tried if r["batch"] == best["batch"] and r["status"] != ERROR}
        at_edge = len(lrs) > 1 and best["lr"] in (min(lrs), max(lrs))
        out.append({"rung": rung, "budget": best["budget"], "size": best["size"], "params": best["params"],
                    "tokens": best["tokens"], "flops": best["flops"], "loss": best["val_loss"], "lr": lr,
                    "lr_at_grid_edge": at_edge, "batch": best["batch"], "trials": len(trials)})
    return sorted(out, key=lambda r: (r["params"], r["tokens"]))


@dataclass
class Laws:
    """The fitted rules a prediction or recommendation uses."""

    parametric: Optional[fit.Parametric]
    bootstrap: list[fit.Parametric]
    lr_vs_params: Optional[dict]
    batch_vs_flops: Optional[dict]
    flops_per_token: Callable[[float], float]
    confidence: float

    def predict(self, params: float, tokens: float) -> dict:
        loss = float(self.parametric.loss(params, tokens))
        samples = [b.loss(params, tokens) for b in self.bootstrap]
        return {"loss": loss, "interval": fit.interval(samples, self.confidence) if samples else [loss, loss]}


def _safe(f: Callable[[], dict]) -> dict:
    """A fit that cannot be made (too few points, degenerate data) is recorded, not fatal."""
    try:
        return f()
    except (ValueError, np.linalg.LinAlgError) as e:
        return {"error": str(e)}


def analyze(rows: list[dict], sizes: list[Size], sweep: SweepConfig) -> tuple[dict, Laws]:
    """fit.json's fits from the ladder's trials (the held-out rung's trial is not among `rows`)."""
    bests = rung_bests(rows)
    result: dict = {"params_count": sweep.fit.params, "rungs": bests}
    per_size: dict[int, list[dict]] = defaultdict(list)
    for b in bests:
        per_size[b["size"]].append(b)
    size_lr = [{"size": s, "params": v[0]["params"], "lr": float(math.exp(np.mean([math.log(b["lr"]) for b in v])))}
               for s, v in sorted(per_size.items())]
    result["lr"] = {"per_size": size_lr,
                    "lr_vs_params": _safe(lambda: fit.power_law([s["params"] for s in size_lr],
                                                                [s["lr"] for s in size_lr])),
                    "lr_vs_flops": _safe(lambda: fit.power_law([b["flops"] for b in bests], [b["lr"] for b in bests])),
                    "at_grid_edge": [b["rung"] for b in bests if b["lr_at_grid_edge"]]}
    batch_law = None
    if len(sweep.ladder.batch_size) > 1:
        result["batch"] = {"per_rung": [{"rung": b["rung"], "batch": b["batch"]} for b in bests],
                           "batch_vs_params": _safe(lambda: fit.power_law([b["params"] for b in bests],
                                                                          [b["batch"] for b in bests])),
                           "batch_vs_flops": _safe(lambda: fit.power_law([b["flops"] for b in bests],
                                                                         [b["batch"] for b in bests]))}
        batch_law = result["batch"]["batch_vs_flops"] if "coef" in result["batch"]["batch_vs_flops"] else None
    f_law = fit.flops_per_token_law([s.params for s in sizes], [s.flops_per_token for s in sizes])

    parametric, boots = None, []
    if len(bests) >= 5:
        n, d, loss = ([b[k] for b in bests] for k in ("params", "tokens", "loss"))
        p = fit.fit_parametric(n, d, loss, delta=sweep.fit.huber_delta)
        parametric = p.fit
        boots = fit.bootstrap_parametric(n, d, loss, p, sweep.fit.bootstrap, sweep.fit.seed, sweep.fit.huber_delta)
        predicted = parametric.loss(n, d)
        result["parametric"] = {
            "form": "L(N, D) = E + A / N^alpha + B / D^beta", **parametric.to_dict(),
            "interval": {k: fit.interval([getattr(b, k) for b in boots], sweep.fit.confidence) for k in fit.NAMES}
            if boots else {},
            "confidence": sweep.fit.confidence, "bootstrap": len(boots), "huber_delta": sweep.fit.huber_delta,
            "objective": p.objective,
            "residuals": [{"rung": b["rung"], "params": b["params"], "tokens": b["tokens"], "loss": b["loss"],
                           "fitted": float(fl), "relative": float((b["loss"] - fl) / fl)}
                          for b, fl in zip(bests, predicted)]}
    else:
        result["parametric"] = {"error": f"{len(bests)} rungs completed; the fit needs at least 5"}
    laws = Laws(parametric, boots, result["lr"]["lr_vs_params"] if "coef" in result["lr"]["lr_vs_params"] else None,
                batch_law, f_law, sweep.fit.confidence)

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
    if sweep.target.flops:
        n_opt, _, _ = fit.compute_optimal(laws.parametric, sweep.target.flops, laws.flops_per_token)
    else:
        n_opt = sweep.target.params
    size = shape_for_params(n_opt, sweep, sizes, resolved)
    tokens = (sweep.target.flops / size.flops_per_token if sweep.target.flops
              else fit.params_for_tokens_optimal(laws.parametric, size.params, laws.flops_per_token))
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
    dp = parallel.num_workers // (parallel.tp * parallel.pp)
    unit = max(1, dp) * base.train.micro_batch_size  # whole micro-batches on every data-parallel rank
    batch = unit * max(1, round(batch / unit))
    steps = steps_for(tokens, batch, seq_len)
    lr = predicted_lr(laws, size.params, base.optim.lr)
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
    cfg = config_from_dict(tree)
    # Everything `raylm train` checks before starting (shape, layout, batch split, the data), but
    # the shard checksums: the sweep has just read the data.
    resolve_run(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, verify=False)))
    trained = steps * batch * seq_len
    info = {"target": {"flops": sweep.target.flops, "params": sweep.target.params},
            "params": size.params, "params_non_embedding": size.params_non_embedding,
            "params_total": size.params_total, "tokens": trained, "flops": trained * size.flops_per_token,
            "d_model": size.model.d_model, "n_layers": size.model.n_layers, "n_heads": size.model.n_heads,
            "lr": lr, "batch": batch, "steps": steps,
            "extrapolation": trained * size.flops_per_token / largest_flops,  # x the most compute of any trial
            "predicted_loss": laws.predict(size.params, trained)}
    return cfg, info


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
    edge = result.get("lr", {}).get("at_grid_edge", [])
    if edge:
        out.append(f"the best learning rate lies at the edge of the values tried in {', '.join(edge)}: widen the "
                   "learning-rate grid or range there")
    table = result.get("compute_optimal", {}).get("table", [])
    if any(t["params"] < 1.01 * fit.SMALLEST_PARAMS for t in table):
        out.append("the fit puts the compute-optimal N at the smallest size searched: in it, more tokens always "
                   "beat more parameters (beta is small against alpha); N*(C) and the recommendation mean nothing")
    rec = result.get("recommended", {})
    if rec.get("extrapolation", 0) > 100:
        out.append(f"the recommended run has {rec['extrapolation']:.3g}x the compute of the largest trial: a long "
                   "extrapolation; check.relative_error measures a far shorter one")
    return out
