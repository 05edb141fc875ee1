"""Where a sweep rung's seed noise comes from: the initialization, the data order, and how coarsely
the order is shuffled (`data.chunk_rows`) (issue 64).

A sweep's repeat (`sweep.ladder.seeds`) moves both `train.seed` and `data.seed`. This trains one
rung of a sweep config, at one learning rate (and µP output multiplier), as the sweep's trials do
(`ladder.trial_config`, `raylm.train.loop.train_local`, no Ray), with:

- `both`: `--seeds` seeds moving both, at each of `--chunk-rows` (the validation rows are drawn in
  chunks of the same size: `raylm.train.validation`);
- `init`, `data`: at the first `--chunk-rows`, the initialization's seed alone, then the data
  order's alone (seeds 1.., seed 0 being `both`'s first).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sweep_seed_noise.py --json-out FILE --rung s2-tpp5 \\
        --lr 2.97e-3 --output-multiplier 16 [--sweep configs/sweep-cpu.yaml] [--seeds 3] \\
        [--chunk-rows 64,1] [--jobs 2] [OVERRIDE ...]

OVERRIDEs go to the sweep as on `raylm sweep`'s command line (`sweep.parametrization=mup`,
`data.path=...`). JSON: `val_loss` ({variant: {chunk_rows: [loss per seed]}}), `spread` (the same,
(max - min) / mean), `mean`, the rung, its steps, the rate, the multiplier, and the machine's load.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import load_average  # noqa: E402
from raylm.sweep.checks import relative_spread  # noqa: E402  (the noise floor's measure)

CPU_SWEEP = str(Path(__file__).resolve().parents[1] / "configs" / "sweep-cpu.yaml")


def run(sweep_path: str, overrides: list[str], workdir: str, rung: str, lr: float, output_multiplier: float,
        train_seed: int, data_seed: int, chunk_rows: int) -> tuple[float, int]:
    """One trial's final validation loss and its steps."""
    import torch

    from raylm.config import config_from_dict, config_to_dict
    from raylm.sweep import ladder
    from raylm.sweep.plan import resolve
    from raylm.train.loop import train_local
    from raylm.train.observe.records import read_jsonl

    torch.set_num_threads(1)
    name = f"c{chunk_rows}-t{train_seed}-d{data_seed}"
    plan = resolve(sweep_path, [*overrides, f"run.storage_path={workdir}", f"run.name=probe-{name}"])
    if plan.sweep.parametrization == "mup":
        plan = plan.with_output_multiplier(output_multiplier)
    tree = config_to_dict(ladder.trial_config(plan.sweep, plan.resolved, plan.rung(rung), lr, plan.batches[0], name))
    tree["train"]["seed"] += train_seed
    tree["data"]["seed"] += data_seed
    tree["data"]["chunk_rows"] = chunk_rows
    tree["checkpoint"]["every_steps"] = 0  # nothing here resumes
    run_dir = os.path.join(workdir, name)
    train_local(config_from_dict(tree), run_dir)
    last = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "val_loss" in r][-1]
    shutil.rmtree(run_dir, ignore_errors=True)
    return last["val_loss"], last["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out", required=True)
    parser.add_argument("--sweep", default=CPU_SWEEP, help="the sweep config (default configs/sweep-cpu.yaml)")
    parser.add_argument("--rung", required=True, help="a rung's name as trials.csv writes it (s2-tpp5)")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--output-multiplier", type=float, default=1.0, help="µP's output multiplier (default 1)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--chunk-rows", default="64,1", help="data.chunk_rows values, the first also for init/data")
    parser.add_argument("--jobs", type=int, default=2, help="trials at once, each in a process of its own")
    parser.add_argument("overrides", nargs="*", help="sweep and base-run overrides, as on raylm sweep's command line")
    args = parser.parse_args()
    if args.seeds < 2:
        parser.error(f"--seeds must be at least 2 to show a spread, got {args.seeds}")
    chunks = [int(c) for c in args.chunk_rows.split(",")]
    seeds = range(args.seeds)
    runs = {("both", c, k): (k, k, c) for c in chunks for k in seeds}
    runs.update({("init", chunks[0], k): (k, 0, chunks[0]) for k in seeds})
    runs.update({("data", chunks[0], k): (0, k, chunks[0]) for k in seeds})
    same = {key: ("both", chunks[0], 0) for key in runs if key[0] != "both" and key[2] == 0}  # seed 0 is one trial
    workdir = tempfile.mkdtemp(prefix="raylm-seed-noise-")
    started = time.time()
    losses, steps = {}, 0
    try:
        # Processes started afresh (spawn): each resolves the sweep's plan as `raylm sweep` does.
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run, args.sweep, args.overrides, workdir, args.rung, args.lr,
                                   args.output_multiplier, *how): key for key, how in runs.items() if key not in same}
            for future in concurrent.futures.as_completed(futures):
                key = futures[future]
                losses[key], steps = future.result()
                print(f"{key[0]:4} chunk_rows {key[1]:3} seed {key[2]}: val {losses[key]:.4f}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    losses.update({key: losses[first] for key, first in same.items()})
    table: dict = {}
    for (variant, chunk, k), loss in sorted(losses.items()):
        table.setdefault(variant, {}).setdefault(chunk, []).append(loss)
    spread = {v: {c: relative_spread(x) for c, x in by.items()} for v, by in table.items()}
    mean = {v: {c: sum(x) / len(x) for c, x in by.items()} for v, by in table.items()}
    result = {"val_loss": table, "spread": spread, "mean": mean, "rung": args.rung, "steps": steps, "lr": args.lr,
              "output_multiplier": args.output_multiplier, "overrides": args.overrides,
              "seconds": time.time() - started, "load_average": load_average()}
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=1)
    for variant, by in table.items():
        for chunk, values in by.items():
            print(f"{variant:4} chunk_rows {chunk:3}: mean {mean[variant][chunk]:.4f}, spread "
                  f"{spread[variant][chunk]:.1%} ({', '.join(f'{v:.4f}' for v in values)})")


if __name__ == "__main__":
    main()
