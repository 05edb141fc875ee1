"""sweep.parametrization=mup: the learning rate (and, with sweep.mup_output_multiplier, the output
multiplier) searched at µP's base width, the ladder's smallest (where the µP model is the
standard one at that multiplier), and every size of the ladder trained at them.

The search is the standard sweep's (lr, search, early_stopping), on the base width's rungs only
(phase `lr-search`), every learning rate at every multiplier. The multiplier is the one whose
rungs' best losses have the lowest geometric mean (a grid value: 8 and 16 sat within 0.7% of
each other in benchmarks/RESULTS.md, nothing to refine between them); the transferred rate is
the geometric mean over those rungs of each one's best at it, refined as the standard ladder's
are (`analysis.rung_bests`). The ladder is then one trial per rung at them (phase `ladder`,
seed 0); the seeds and the check follow as in a standard sweep, at the transferred rate and
multiplier (`lr_vs_params` is that constant).
"""

from __future__ import annotations

import math

import numpy as np

from raylm.sweep import analysis
from raylm.sweep.analysis import COMPLETED, LR_SEARCH
from raylm.sweep.plan import Plan, TrialPlan
from raylm.sweep.results import asha_savings
from raylm.sweep.tuner import repeats, search


def _geometric_mean(values: list[float]) -> float:
    # To 12 digits: the mean of equal rates is that rate, not one a rounding error off it.
    return float(f"{math.exp(np.mean([math.log(v) for v in values])):.12g}")


def transferred(search_rows: list[dict], base_width: int) -> dict:
    """fit.json's `transfer`: the rate and output multiplier every size trains at, and the search at
    the base width they came from (per multiplier tried, its rate and mean best loss)."""
    rungs = {r["rung"] for r in search_rows}
    tried = sorted({r["output_multiplier"] for r in search_rows})
    candidates = []
    for multiplier in tried:
        bests = analysis.rung_bests([r for r in search_rows if r["output_multiplier"] == multiplier])
        if {b["rung"] for b in bests} == rungs:  # a multiplier is judged on every rung or not at all
            candidates.append({"output_multiplier": multiplier, "lr": _geometric_mean([b["lr"] for b in bests]),
                               "loss": _geometric_mean([b["loss"] for b in bests]), "bests": bests})
    if not candidates:
        raise RuntimeError("no output multiplier completed a trial on every rung of the base width: each of its "
                           "trials diverged, failed or was stopped (their logs are under trials/)")
    best = min(candidates, key=lambda c: c["loss"])
    bests = best["bests"]
    return {"base_width": base_width, "lr": best["lr"], "output_multiplier": best["output_multiplier"],
            "multipliers": [{k: c[k] for k in ("output_multiplier", "lr", "loss")} for c in candidates],
            "multiplier_at_grid_edge": len(tried) > 1 and best["output_multiplier"] in (tried[0], tried[-1]),
            "search": [{k: b[k] for k in ("rung", "lr", "loss", "best_trial_loss", "lr_at_grid_edge", "trials")}
                       for b in bests],
            "at_grid_edge": [b["rung"] for b in bests if b["lr_at_grid_edge"]], "asha": asha_savings(search_rows)}


def mup_search(plan: Plan, trials: TrialPlan, resources: dict, concurrency: int) -> tuple[list[dict], dict]:
    """The search at the base width: (its rows, fit.json's `transfer`)."""
    base = plan.sizes[0]
    at_base = [r for r in plan.rungs if r.size.index == base.index and not r.held_out]
    search_rows = search(plan, "tune-lr-search", LR_SEARCH, at_base, trials, resources, concurrency)
    return search_rows, transferred(search_rows, base.model.d_model)


def mup_ladder(plan: Plan, trials: TrialPlan, transfer: dict, resources: dict, concurrency: int) -> list[dict]:
    """The ladder at the transferred rate, `plan` and `trials` at its multiplier: its rows."""
    from raylm.sweep.search import RungSlot

    fitted = sorted((r for r in plan.rungs if not r.held_out), key=lambda r: -r.target_tokens * r.size.flops_per_token)
    print(f"raylm: µP: lr {transfer['lr']:.4g}, output multiplier {transfer['output_multiplier']:g}, found at the "
          f"base width {transfer['base_width']}; {len(fitted)} rungs train at them", flush=True)
    slots = [RungSlot(r.name, 1.0, transfer["lr"], plan.batches[0]) for r in fitted]
    rows = repeats(plan, "tune-ladder", "ladder", slots, trials, resources, concurrency)
    if not any(r["status"] == COMPLETED for r in rows):
        raise RuntimeError(f"no ladder trial completed at the transferred lr {transfer['lr']:.4g}: each diverged or "
                           "failed (their logs are under trials/); a lower lr.grid moves the rate down")
    return rows
