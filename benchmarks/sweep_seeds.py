"""Would more seeds per rung make a finished sweep's prediction hold? Measured, not argued.

Repeats every fitted rung of a finished `raylm sweep` at its best learning rate, and the held-out
rung at the picked one, with other seeds (`train.seed`, `data.seed`, as the sweep's noise phase
does), two trials at a time outside Tune but with the sweep's own trial config: seed 0 reproduces
the sweep's trial bit for bit. Then it writes a copy of the sweep directory whose rungs' losses
are the mean over the seeds (each trial of a repeated rung shifted by the mean minus seed 0's
loss, so the LR refinement keeps its shape) and refits it with `raylm sweep --refit`.

    OMP_NUM_THREADS=1 python benchmarks/sweep_seeds.py configs/sweep-cpu.yaml --seeds 1,2 \\
        run.name=sweep-cpu-changelogs data.path=runs/data/debian-changelogs-byte-256

Trials already in <sweep>/seeds-extra/results.jsonl are not run again. The copy is
<sweep>-seed-mean; its summary is printed last (its `noise floor` line is not a measurement:
the noise rung's seed 0 is shifted too; the per-rung spreads printed before it are).

`--beyond 128:8,...` (d_model:n_heads, at the held-out size's depth) also trains sizes past the
held-out one at its budget (tokens per parameter), at the rate the sweep's lr_vs_params gives,
seed 0 and `--seeds`: does the loss go on falling with size as the ladder said, or as the
held-out rung did? It prints the loss along that budget at every size, the log-log slope between
neighbours, and what each predictor of the seed-mean refit says for the sizes past the ladder.
Their trials are kept in <sweep>/seeds-extra/beyond.jsonl.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from multiprocessing import Pool

EXTRA = "seeds-extra"


def beyond_rung(plan, shape: dict):
    """The held-out rung's budget at another size (the held-out size's depth unless `shape` says)."""
    from raylm.sweep import ladder

    held_out = next(r for r in plan.rungs if r.held_out)
    shape = {"n_layers": held_out.size.model.n_layers, **shape}
    sweep = dataclasses.replace(plan.sweep, ladder=dataclasses.replace(plan.sweep.ladder, sizes=[shape]))
    (size,) = ladder.build_sizes(sweep, plan.resolved)
    ratio = ladder.check_tokens_per_param(plan.sweep)
    return ladder.Rung(f"d{shape['d_model']}-check", size, f"tokens_per_param={ratio:g}", ratio * size.params,
                       True, 1.0)


def run_one(job: tuple) -> dict:
    sweep_yaml, overrides, rung_or_shape, lr, seed = job
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    from raylm.sweep import run as sweep_run
    from raylm.sweep.ladder import trial_config
    from raylm.train.env import LocalEnv
    from raylm.train.loop import train
    from raylm.train.observe.records import read_jsonl
    from raylm.train.preflight import preflight

    plan = sweep_run.resolve(sweep_yaml, overrides)
    rung = plan.rung(rung_or_shape) if isinstance(rung_or_shape, str) else beyond_rung(plan, rung_or_shape)
    leaf = f"{rung.name}-lr{lr:.6g}-seed{seed}"
    run_dir = os.path.join(plan.directory, EXTRA, leaf)
    cfg = trial_config(plan.sweep, plan.resolved, rung, lr, 4,
                       run_name=f"{plan.resolved.run.name}/{EXTRA}/{leaf}", seed=seed)
    trial = plan.spec.with_config(cfg)
    started = time.time()
    preflight(trial, run_dir)
    train(trial, LocalEnv(run_dir, use_gpu=False), ())
    last = next(r for r in reversed(read_jsonl(os.path.join(run_dir, "metrics.jsonl"))) if "val_loss" in r)
    return {"rung": rung.name, "lr": lr, "seed": seed, "val_loss": last["val_loss"], "params": rung.size.params,
            "tokens": last["tokens"], "wall_s": time.time() - started}


def seed_mean_copy(directory: str, results: list[dict]) -> str:
    """<directory>-seed-mean: trials.csv with every repeated rung's trials shifted to its seed mean."""
    rows = list(csv.DictReader(open(os.path.join(directory, "trials.csv"))))
    repeats: dict[str, list[float]] = {}
    rates: dict[str, float] = {}
    # The sweep's own noise phase repeated one rung already.
    for rung, lr, loss in [(r["rung"], r["lr"], r["val_loss"]) for r in results] + \
            [(r["rung"], float(r["lr"]), float(r["val_loss"])) for r in rows if r["phase"] == "seeds"]:
        repeats.setdefault(rung, []).append(loss)
        rates[rung] = lr
    offsets = {}
    for rung, losses in repeats.items():
        lr = rates[rung]
        (seed0,) = [float(r["val_loss"]) for r in rows if r["rung"] == rung and r["phase"] in ("ladder", "check")
                    and abs(float(r["lr"]) / lr - 1) < 1e-6 and r["seed"] == "0"]
        values = [seed0, *losses]
        offsets[rung] = statistics.mean(values) - seed0
        print(f"{rung} lr {lr:.4g}: seeds {[round(v, 4) for v in values]}, mean {statistics.mean(values):.4f}, "
              f"spread {(max(values) - min(values)) / min(values):.2%}", flush=True)
    for r in rows:
        if r["phase"] in ("ladder", "check") and r["rung"] in offsets:
            r["val_loss"] = str(float(r["val_loss"]) + offsets[r["rung"]])
    copy = directory.rstrip("/") + "-seed-mean"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("trials", "tune-*", EXTRA, "*.pkl"))
    with open(os.path.join(copy, "trials.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return copy


def shapes(text: str) -> list[dict]:
    out = []
    for item in text.split(","):
        d_model, n_heads = (int(x) for x in item.split(":"))
        out.append({"d_model": d_model, "n_heads": n_heads})
    return out


def trend(directory: str, copy: str, fitted: dict, budget: str, extra: list[dict], beyond: list[dict]) -> None:
    """The loss along the held-out `budget` at every size, and the seed-mean refit's predictions past it."""
    from raylm.sweep import run as sweep_run

    rows = sweep_run.read_trials(directory)
    check = fitted["check"]
    losses: dict[float, list[float]] = {}
    tokens: dict[float, float] = {check["params"]: check["tokens"], **{b["params"]: b["tokens"] for b in beyond}}
    for rung in fitted["rungs"]:
        if rung["budget"] != budget:
            continue
        # The rung's best completed trial (seed 0) and its repeats at that rate.
        best = min((r for r in rows if r["rung"] == rung["rung"] and r["phase"] == "ladder"
                    and r["status"] == "completed"), key=lambda r: float(r["val_loss"]))
        tokens[rung["params"]] = rung["tokens"]
        repeats = [e["val_loss"] for e in extra
                   if e["rung"] == rung["rung"] and abs(e["lr"] / float(best["lr"]) - 1) < 1e-6]
        repeats += [float(r["val_loss"]) for r in rows if r["phase"] == "seeds" and r["rung"] == rung["rung"]]
        losses[rung["params"]] = [float(best["val_loss"]), *repeats]
    (picked,) = [float(r["val_loss"]) for r in rows
                 if r["phase"] == "check" and abs(float(r["lr"]) / check["lr"] - 1) < 1e-6]
    losses[check["params"]] = [picked] + [e["val_loss"] for e in extra if e["rung"] == check["rung"]]
    for b in beyond:
        losses.setdefault(b["params"], []).append(b["val_loss"])
    _, _, laws = sweep_run.fit_ladder(copy)
    print(f"\nalong {budget} (mean of the seeds; slope: -d ln L / d ln N from the size before):")
    previous = None
    for params in sorted(losses):
        values = losses[params]
        mean = statistics.mean(values)
        line = f"  {params:>9,.0f} params: {mean:.4f} over {len(values)} seed(s), spread " \
               f"{(max(values) - min(values)) / min(values):.2%}"
        if previous:
            line += f", slope {math.log(previous[1] / mean) / math.log(params / previous[0]):.3f}"
        if params >= check["params"]:
            predicted = {name: laws.predict(params, tokens[params], name)["loss"] for name in laws.predictors}
            line += "; predicted " + ", ".join(f"{name} {loss:.4f} ({loss / mean - 1:+.2%})"
                                               for name, loss in predicted.items())
        print(line, flush=True)
        previous = (params, mean)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="the sweep's YAML, as given to `raylm sweep`")
    parser.add_argument("overrides", nargs="*", help="the sweep's overrides, as given to `raylm sweep`")
    parser.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
                        help="comma-separated, e.g. 1,2 (seed 0 is the sweep's own trial)")
    parser.add_argument("--beyond", type=shapes, default=[],
                        help="sizes past the held-out one, d_model:n_heads, comma-separated, e.g. 80:5,128:8")
    args = parser.parse_intermixed_args()
    from raylm.sweep import fit as sweep_fit
    from raylm.sweep import run as sweep_run

    plan = sweep_run.resolve(args.sweep, args.overrides)
    if not os.path.exists(os.path.join(plan.directory, "fit.json")):
        sys.exit(f"sweep_seeds: {plan.directory} holds no fit.json: run the sweep to its end first "
                 f"(`raylm sweep {args.sweep} {' '.join(args.overrides)}`)")
    with open(os.path.join(plan.directory, "fit.json")) as f:
        fitted = json.load(f)
    noise = fitted.get("noise") or {}
    # Each rung's best completed trial's own rate (fit.json's is refined between the rates tried).
    ladder = [r for r in csv.DictReader(open(os.path.join(plan.directory, "trials.csv")))
              if r["phase"] == "ladder" and r["status"] == "completed"]
    wanted = [(rung, float(min((r for r in ladder if r["rung"] == rung), key=lambda r: float(r["val_loss"]))["lr"]))
              for rung in sorted({r["rung"] for r in ladder})]
    wanted.append((fitted["check"]["rung"], fitted["check"]["lr"]))
    results_path = os.path.join(plan.directory, EXTRA, "results.jsonl")
    beyond_path = os.path.join(plan.directory, EXTRA, "beyond.jsonl")
    os.makedirs(os.path.dirname(results_path), exist_ok=True)
    done = [json.loads(line) for line in open(results_path)] if os.path.exists(results_path) else []
    past = [json.loads(line) for line in open(beyond_path)] if os.path.exists(beyond_path) else []
    have = {(d["rung"], d["seed"]) for d in done + past} | {(noise.get("rung"), s) for s in noise.get("seeds", [])}
    # The longest trials first: two lanes finish together.
    cost = {r["rung"]: r["params"] * r["tokens"] for r in [*fitted["rungs"], fitted["check"]]}
    jobs = [(args.sweep, args.overrides, rung, lr, seed, cost[rung]) for rung, lr in wanted for seed in args.seeds
            if (rung, seed) not in have]
    ratio = fitted["check"]["tokens"] / fitted["check"]["params"]
    for shape in args.beyond:
        params = beyond_rung(plan, shape).size.params
        lr = sweep_fit.eval_power_law(fitted["lr"]["lr_vs_params"], params)
        jobs += [(args.sweep, args.overrides, shape, lr, seed, ratio * params * params)
                 for seed in sorted({0, *args.seeds}) if (f"d{shape['d_model']}-check", seed) not in have]
    jobs.sort(key=lambda job: -job[-1])
    with Pool(2) as pool:
        for row in pool.imap_unordered(run_one, [job[:-1] for job in jobs]):
            print(json.dumps(row), flush=True)
            into = past if row["rung"].startswith("d") else done
            with open(beyond_path if into is past else results_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            into.append(row)
    copy = seed_mean_copy(plan.directory, done)
    subprocess.run([sys.executable, "-m", "raylm.cli", "sweep", "--refit", copy], check=True)
    if past:
        trend(plan.directory, copy, fitted, next(r for r in plan.rungs if r.held_out).budget, done, past)


if __name__ == "__main__":
    main()
