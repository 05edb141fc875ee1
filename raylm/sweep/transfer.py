"""sweep.parametrization=mup: the learning rate searched at µP's base width, the ladder's smallest
(where the µP model is the standard one), and every size of the ladder trained at it.

The search is the standard sweep's (lr, search, early_stopping), on the base width's rungs only
(phase `lr-search`). The transferred rate is the geometric mean over those rungs of each one's
best, refined as the standard ladder's are (`analysis.rung_bests`). The ladder is then one trial
per rung at that rate (phase `ladder`, seed 0); the seeds and the check follow as in a standard
sweep, the check at the transferred rate (`lr_vs_params` is that constant).
"""

from __future__ import annotations

import math

import numpy as np

from raylm.sweep import analysis
from raylm.sweep.analysis import COMPLETED, LR_SEARCH
from raylm.sweep.plan import Plan
from raylm.sweep.results import asha_savings
from raylm.sweep.trial import TrialPlan
from raylm.sweep.tuner import repeats, search


def transferred(search_rows: list[dict], base_width: int) -> dict:
    """fit.json's `transfer`: the rate every size trains at, and the search at the base width it
    came from."""
    bests = analysis.rung_bests(search_rows)
    # To 12 digits: the mean of equal rates is that rate, not one a rounding error off it.
    lr = float(f"{math.exp(np.mean([math.log(b['lr']) for b in bests])):.12g}")
    return {"base_width": base_width, "lr": lr,
            "search": [{k: b[k] for k in ("rung", "lr", "loss", "best_trial_loss", "lr_at_grid_edge", "trials")}
                       for b in bests],
            "at_grid_edge": [b["rung"] for b in bests if b["lr_at_grid_edge"]], "asha": asha_savings(search_rows)}


def mup_ladder(plan: Plan, trials: TrialPlan, resources: dict, concurrency: int) -> tuple[list[dict], list[dict], dict]:
    """The search at the base width, then the ladder at its rate: (the search's rows, the ladder's,
    fit.json's `transfer`)."""
    from raylm.sweep.search import RungSlot

    base = plan.sizes[0]
    at_base = [r for r in plan.rungs if r.size.index == base.index and not r.held_out]
    search_rows = search(plan, "tune-lr-search", LR_SEARCH, at_base, trials, resources, concurrency)
    transfer = transferred(search_rows, base.model.d_model)
    fitted = sorted((r for r in plan.rungs if not r.held_out), key=lambda r: -r.target_tokens * r.size.flops_per_token)
    print(f"raylm: µP: lr {transfer['lr']:.4g} found at the base width {base.model.d_model}; {len(fitted)} rungs "
          f"train at it", flush=True)
    slots = [RungSlot(r.name, 1.0, transfer["lr"], plan.batches[0]) for r in fitted]
    rows = repeats(plan, "tune-ladder", "ladder", slots, trials, resources, concurrency)
    if not any(r["status"] == COMPLETED for r in rows):
        raise RuntimeError(f"no ladder trial completed at the transferred lr {transfer['lr']:.4g}: each diverged or "
                           "failed (their logs are under trials/); a lower lr.grid moves the rate down")
    return search_rows, rows, transfer
