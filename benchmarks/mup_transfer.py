"""Does the best learning rate stay put as the width grows? (issue 64)

LR sweeps at several widths (fixed depth, the same tokens per parameter) on the built-in corpus
(this Python's standard library, byte tokens), under the standard parametrization and under µP
(`model.parametrization=mup`, `model.mup_base_width` = the smallest width unless `--base-width`):
each run trains with `raylm.train.loop.train_local` (no Ray) and is judged by its final validation loss. The best
LR's index on the grid should move by at most one step across the widths under µP; how far it
moves under the standard parametrization is the comparison.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mup_transfer.py --json-out FILE \\
        [--widths 64,128,256] [--lrs 7] [--tokens-per-param 1.0 | --steps N] [--data DIR] [--jobs 2] \\
        [--layers 2] [--batch 16] [--base-width W] [--parametrizations standard,mup] [--output-multiplier A]

`--layers`, `--batch`: where µP's transfer is not promised (depth, batch size): the same grid at
other depths or batches, one width (`--widths 128 --base-width 64 --parametrizations mup`), to
compare with the best LR at the default shape. `--output-multiplier`: µP's
`model.mup_output_multiplier` (1 by default).

`--steps N`: the same steps (and tokens) at every width instead, as Tensor Programs V's transfer
experiments train: at one token per parameter the base width's run is a few dozen steps, whose best
LR is that of a run that short, not of the width.

JSON: `best_lr` ({parametrization: {width: lr}}), `shift_steps` ({parametrization: grid steps
between the widths' best LRs, the largest minus the smallest index}), `refined_best_lr` and
`refined_shift_steps` (the best refined by the parabola through it and its neighbours in log LR, as
the sweep refines a rung's: the shift in grid steps as a fraction, less at the mercy of one
run's noise than an index), `val_loss`
({parametrization: {width: {lr: loss}}}), `steps` (per width), the grid, `base_width`, `layers`,
`batch`, `output_multiplier` and the machine's load.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import load_average  # noqa: E402

SEQ_LEN, HEADS = 128, 4
BASE_LR = 3e-3  # the grid's middle: √2 apart either side


def prepare(workdir: str) -> str:
    import ray

    from raylm.data.prepare import prepare_dataset
    from raylm.ray_runtime import use_loopback

    out = os.path.join(workdir, "stdlib")
    use_loopback()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        prepare_dataset([], out, seq_len=SEQ_LEN, max_documents=2000)
    finally:
        ray.shutdown()
    return out


def run(data: str, workdir: str, parametrization: str, width: int, base: int, lr: float, steps: int,
        layers: int, batch: int, output_multiplier: float) -> float:
    from raylm.config import load_config
    from raylm.train.loop import train_local
    from raylm.train.observe.records import read_jsonl

    mup = (["model.parametrization=mup", f"model.mup_base_width={base}",
            f"model.mup_output_multiplier={output_multiplier}"] if parametrization == "mup" else [])
    cfg = load_config(None, [
        f"data.path={data}", "data.loader=local", f"model.d_model={width}", f"model.n_layers={layers}",
        f"model.n_heads={HEADS}", f"model.max_seq_len={SEQ_LEN}",
        f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}", f"train.steps={steps}",
        f"train.eval_every={steps}", "train.eval_batches=8", "train.tensorboard=false", "checkpoint.every_steps=0",
        "guard.enabled=false", f"optim.lr={lr}", f"schedule.warmup_steps={max(1, steps // 10)}",
        f"schedule.min_lr={lr / 10}", "parallel.num_workers=1", *mup])
    run_dir = os.path.join(workdir, f"{parametrization}-{width}-{lr:.3g}")
    train_local(cfg, run_dir)
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "val_loss" in r]
    shutil.rmtree(run_dir, ignore_errors=True)
    return rows[-1]["val_loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out", required=True)
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--lrs", type=int, default=7, help="grid points, √2 apart around 3e-3 (default 7)")
    horizon = parser.add_mutually_exclusive_group()
    horizon.add_argument("--tokens-per-param", type=float, default=1.0)
    horizon.add_argument("--steps", type=int, help="the same steps at every width (instead of --tokens-per-param)")
    parser.add_argument("--data", help="a prepared dataset (default: the built-in corpus, prepared here)")
    parser.add_argument("--layers", type=int, default=2, help="the depth of every run (default 2)")
    parser.add_argument("--batch", type=int, default=16, help="sequences a step (default 16)")
    parser.add_argument("--base-width", type=int, help="µP's base width (default: the smallest of --widths)")
    parser.add_argument("--parametrizations", default="standard,mup", help="which to run (default both)")
    parser.add_argument("--output-multiplier", type=float, default=1.0,
                        help="µP's model.mup_output_multiplier (default 1)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in a process of its own (with OMP_NUM_THREADS=1: one a core)")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.steps is not None and args.steps < 10:
        parser.error(f"--steps must be at least 10, got {args.steps}")

    from raylm.config import ModelConfig
    from raylm.data.manifest import load_manifest
    from raylm.model.sizes import count_params
    from raylm.sweep.fit import best_lr

    widths = [int(w) for w in args.widths.split(",")]
    base = args.base_width or widths[0]
    parametrizations = args.parametrizations.split(",")
    if not set(parametrizations) <= {"standard", "mup"}:
        parser.error(f"--parametrizations takes standard and mup, got {args.parametrizations}")
    grid = [BASE_LR * math.sqrt(2) ** (k - (args.lrs - 1) / 2) for k in range(args.lrs)]
    workdir = tempfile.mkdtemp(prefix="raylm-mup-")
    started = time.time()
    try:
        data = args.data or prepare(workdir)
        vocab = load_manifest(data).vocab_size
        steps = {w: args.steps or max(10, round(args.tokens_per_param * count_params(
            ModelConfig(d_model=w, n_layers=args.layers, n_heads=HEADS, vocab_size=vocab, max_seq_len=SEQ_LEN))
            / (args.batch * SEQ_LEN))) for w in widths}
        runs = [(p, w, lr) for p in parametrizations for w in widths for lr in grid]
        losses: dict = {}
        # Processes started afresh (spawn), not forked from this one after Ray ran in it.
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run, data, workdir, p, w, base, lr, steps[w], args.layers, args.batch,
                                   args.output_multiplier): (p, w, lr) for p, w, lr in runs}
            for future in concurrent.futures.as_completed(futures):
                parametrization, width, lr = futures[future]
                loss = future.result()
                losses.setdefault(parametrization, {}).setdefault(width, {})[lr] = loss
                print(f"{parametrization:8} width {width:4} lr {lr:.2e}: val {loss:.4f} ({steps[width]} steps)",
                      flush=True)
        losses = {p: {w: dict(sorted(losses[p][w].items())) for w in widths} for p in parametrizations}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    best = {p: {w: min(by_lr, key=by_lr.get) for w, by_lr in per_width.items()} for p, per_width in losses.items()}
    shift = {p: max(grid.index(lr) for lr in b.values()) - min(grid.index(lr) for lr in b.values())
             for p, b in best.items()}
    refined = {p: {w: best_lr(list(by_lr), list(by_lr.values()))[0] for w, by_lr in per_width.items()}
               for p, per_width in losses.items()}
    in_steps = {p: [math.log(lr, math.sqrt(2)) for lr in r.values()] for p, r in refined.items()}
    refined_shift = {p: round(max(s) - min(s), 2) for p, s in in_steps.items()}
    result = {"best_lr": best, "shift_steps": shift, "refined_best_lr": refined,
              "refined_shift_steps": refined_shift, "val_loss": losses, "steps": steps, "grid": grid,
              "widths": widths, "base_width": base, "layers": args.layers, "batch": args.batch,
              "output_multiplier": args.output_multiplier,
              "tokens_per_param": None if args.steps else args.tokens_per_param, "jobs": args.jobs,
              "seconds": time.time() - started,
              "load_average": load_average()}
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=1)
    for p in parametrizations:
        print(f"{p}: best LR by width {', '.join(f'{w}: {lr:.2e}' for w, lr in best[p].items())}; "
              f"moves {shift[p]} grid step(s)" + (f" (goal <= 1: {'met' if shift[p] <= 1 else 'NOT met'})"
                                                   if p == "mup" else "")
              + f"; refined {', '.join(f'{lr:.2e}' for lr in refined[p].values())}: {refined_shift[p]} step(s)")


if __name__ == "__main__":
    main()
