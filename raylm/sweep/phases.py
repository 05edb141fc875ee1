"""The phases after the ladder: its rungs again with other seeds, and the check of the held-out
rung (its predicted rate and batch against their neighbours, then its repeats)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

from raylm.sweep import analysis, ladder
from raylm.sweep.analysis import COMPLETED
from raylm.sweep.checks import predict_check
from raylm.sweep.plan import Plan, TrialPlan
from raylm.sweep.results import CHECK_PLAN_FILE
from raylm.sweep.tuner import cluster_share, repeats, threads

NOISE_SEEDS = 2  # the largest fitted rung's extra seeds
LR_PICK_FACTORS = (2 ** -0.5, 1.0, 2 ** 0.5)  # the held-out rung's learning rates, x the predicted one


def seeds_phase(plan: Plan, rows: list[dict], noisy: Optional[str], trials: TrialPlan,
                concurrency: int) -> list[dict]:
    """Fitted rungs trained again at their best trial's learning rate with other seeds
    (`train.seed`, `data.seed`): every rung ladder.seeds - 1 times (the fits take the mean), and
    the noise rung `noisy` (with `check`) at least NOISE_SEEDS times (the spread of its losses is
    the noise floor a prediction is judged by)."""
    from raylm.sweep.search import RungSlot

    times = {rung: plan.sweep.ladder.seeds - 1 for rung in {r["rung"] for r in rows if r["status"] == COMPLETED}}
    if noisy is not None:
        times[noisy] = max(times[noisy], NOISE_SEEDS)
    slots = []
    for rung in sorted(times, key=lambda name: -plan.rung(name).target_tokens * plan.rung(name).size.flops_per_token):
        best = min((r for r in rows if r["rung"] == rung and r["status"] == COMPLETED), key=lambda r: r["val_loss"])
        slots += [RungSlot(rung, 1.0, best["lr"], best["batch"], seed) for seed in range(1, times[rung] + 1)]
    if not slots:
        return []
    resources = {"CPU": plan.sweep.trial.cpus, "GPU": plan.sweep.trial.gpus}
    return repeats(plan, "tune-seeds", "seeds", slots, trials, resources, concurrency)


def _check_plan(plan: Plan, laws: analysis.Laws, bests: list[dict], rung: ladder.Rung) -> dict:
    """The held-out rung's check as planned before any of its trials (check_plan.json): its rate
    and batch, and each of check_shapes; a plan made before an interruption stands."""
    path = os.path.join(plan.directory, CHECK_PLAN_FILE)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
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
    return check


def check_phase(plan: Plan, laws: analysis.Laws, bests: list[dict], trials: TrialPlan,
                cpus: float) -> tuple[dict, list[dict]]:
    """Predict the held-out rung from the chosen predictor, then train it at the predicted
    learning rate and at that rate x 2^-1/2 and x 2^1/2: the loss at the picked rate is the
    check, and the best of the three says whether the pick was good. Then the check's repeats:
    the picked rate with ladder.seeds - 1 other seeds, and each of check_shapes with every seed."""
    from raylm.sweep.search import RungSlot

    rung = ladder.held_out_rung(plan.rungs)
    check = _check_plan(plan, laws, bests, rung)
    check.update(predict_check(laws, check))
    print(f"raylm: check: {rung.size.params:,} parameters x {check['tokens']:,} tokens, predicted val loss "
          f"{check['predicted_loss']:.4f} {check['interval']} ({check['predictor']}), training it at lr "
          f"{check['lr']:.3g} and x 2^-1/2, x 2^1/2", flush=True)
    trial = plan.sweep.trial
    resources = {"CPU": cpus, "GPU": trial.gpus}
    # As many at once as the cluster holds: one at a time when each takes every CPU (the default).
    concurrency = min(cluster_share(cpus, "CPU", "trial.check_cpus"),
                      cluster_share(trial.gpus, "GPU") if trial.gpus else math.inf,
                      trial.max_concurrent or math.inf)
    lrs = [check["lr"] * factor for factor in LR_PICK_FACTORS]
    trials = dataclasses.replace(trials, threads=threads(cpus))
    rows = repeats(plan, "tune-check", "check", [RungSlot(rung.name, 1.0, lr, check["batch"]) for lr in lrs],
                   trials, resources, int(concurrency))
    others = [b for b in plan.batches if b != check["batch"]]
    if others:  # batch sizes were swept: the batch picked is checked against them, at the picked rate
        print(f"raylm: check: batch {check['batch']} against {others} at lr {check['lr']:.3g}", flush=True)
        rows += repeats(plan, "tune-check-batch", "check-batch", [RungSlot(rung.name, 1.0, check["lr"], b) for b in others],
                        trials, resources, int(concurrency))
    seeds = plan.sweep.ladder.seeds
    slots = [RungSlot(rung.name, 1.0, check["lr"], check["batch"], seed) for seed in range(1, seeds)]
    slots += [RungSlot(shape["rung"], 1.0, shape["lr"], check["batch"], seed)
              for shape in check.get("shapes", []) for seed in range(seeds)]
    if slots:
        print(f"raylm: check: {len(slots)} repeats ({seeds} seed(s) of the held-out size in "
              f"{1 + len(check.get('shapes', []))} shape(s))", flush=True)
        rows += repeats(plan, "tune-check-repeats", "check-repeats", slots, trials, resources, int(concurrency))
    return check, rows
