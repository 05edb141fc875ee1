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
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from multiprocessing import Pool

EXTRA = "seeds-extra"


def run_one(job: tuple) -> dict:
    sweep_yaml, overrides, rung_name, lr, seed = job
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
    leaf = f"{rung_name}-lr{lr:.6g}-seed{seed}"
    run_dir = os.path.join(plan.directory, EXTRA, leaf)
    cfg = trial_config(plan.sweep, plan.resolved, plan.rung(rung_name), lr, 4,
                       run_name=f"{plan.resolved.run.name}/{EXTRA}/{leaf}", seed=seed)
    trial = plan.spec.with_config(cfg)
    started = time.time()
    preflight(trial, run_dir)
    train(trial, LocalEnv(run_dir, use_gpu=False), ())
    last = next(r for r in reversed(read_jsonl(os.path.join(run_dir, "metrics.jsonl"))) if "val_loss" in r)
    return {"rung": rung_name, "lr": lr, "seed": seed, "val_loss": last["val_loss"], "wall_s": time.time() - started}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="the sweep's YAML, as given to `raylm sweep`")
    parser.add_argument("overrides", nargs="*", help="the sweep's overrides, as given to `raylm sweep`")
    parser.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
                        help="comma-separated, e.g. 1,2 (seed 0 is the sweep's own trial)")
    args = parser.parse_intermixed_args()
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
    os.makedirs(os.path.dirname(results_path), exist_ok=True)
    done = [json.loads(line) for line in open(results_path)] if os.path.exists(results_path) else []
    have = {(d["rung"], d["seed"]) for d in done} | {(noise.get("rung"), s) for s in noise.get("seeds", [])}
    # The longest trials first: two lanes finish together.
    cost = {r["rung"]: r["params"] * r["tokens"] for r in [*fitted["rungs"], fitted["check"]]}
    jobs = sorted(((args.sweep, args.overrides, rung, lr, seed) for rung, lr in wanted for seed in args.seeds
                   if (rung, seed) not in have), key=lambda job: -cost[job[2]])
    with Pool(2) as pool:
        for row in pool.imap_unordered(run_one, jobs):
            print(json.dumps(row), flush=True)
            with open(results_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            done.append(row)
    copy = seed_mean_copy(plan.directory, done)
    subprocess.run([sys.executable, "-m", "raylm.cli", "sweep", "--refit", copy], check=True)


if __name__ == "__main__":
    main()
