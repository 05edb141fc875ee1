"""The sweep's checks, from trials.csv rows alone (no Ray): the noise floor its seeds make, the
held-out rung's prediction, and how the trials measured it and the picks of rate and batch."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from raylm.sweep import analysis
from raylm.sweep.analysis import COMPLETED


def noise_rung(fitted: list[dict], held_out_budget: str) -> str:
    """The rung whose seeds make the noise floor: the largest fitted size's, at the held-out rung's
    budget where it has one (else its smallest). `fitted`: rows or rung bests of the ladder."""
    largest = [r for r in fitted if r["params"] == max(x["params"] for x in fitted)]
    return next((r for r in largest if r["budget"] == held_out_budget), min(largest, key=lambda r: r["tokens"]))["rung"]


def relative_spread(losses: list[float]) -> float:
    """(max - min) / mean: how far one configuration's seeds spread, the noise floor's measure."""
    return (max(losses) - min(losses)) / float(np.mean(losses))


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
            "losses": losses, "relative_spread": relative_spread(losses)}


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
