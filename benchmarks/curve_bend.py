"""Where does a finished sweep's loss-vs-size curve bend? Two explanations measured, not argued.

After `benchmarks/sweep_seeds.py --beyond` has trained sizes past a sweep's held-out one, the
log-log slope of loss against size along the check's budget may change with size (RESULTS.md:
on man pages it rises from 0.14 to 0.33 between 53k and 804k parameters), which no power law
through the smaller sizes can follow. This script asks two questions of the trained models and
the data, on one corpus:

1. Is the validation split's text also in the training split (a memorisable overlap that
   larger models would exploit more)? The share of the val split's 64-token windows (one per 64
   tokens) found verbatim in the training split, and, for scale, of the training split's second
   half found in its first half.
2. Is the bend in-context learning arriving with size (copying from earlier in the row, which
   helps late positions only)? Each size's val loss by position in the 256-token context, the
   mean over its seeds' final checkpoints, and the log-log slope between neighbouring sizes in
   each band of positions: a bend of in-context learning is steep late and flat early.

Where a size has several seeds, it also prints how far they differ, over every target and over
the targets whose 64 tokens are or are not found in train.

    OMP_NUM_THREADS=1 python benchmarks/curve_bend.py runs/sweep-cpu-manpages runs/data/manpages-byte-256

Sizes: the ladder's rungs and the held-out one at the check's budget (the ladder's best rate,
the check's picked rate) and the sizes `--beyond` trained at the held-out depth (d_model:n_heads),
with the seeds of `--mean-of` found in trials.csv and <sweep>/seeds-extra.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

from raylm.data.manifest import DatasetError, Manifest, load_manifest
from raylm.inference.evaluate import read_rows
from raylm.inference.load import load_for_inference
from raylm.sweep.fit import eval_power_law, power_law
from raylm.sweep.results import CHECK_PLAN_FILE, TRIALS_FILE, read_trials
from sweep_seeds import EXTRA, power_law_windows  # the script beside this one, which trained the extra seeds and sizes
BANDS = [(0, 16), (16, 64), (64, 128), (128, 256)]
WINDOW = 64


def split_tokens(data: str, manifest: Manifest, split: str) -> np.ndarray:
    rows = [read_rows(os.path.join(data, s.file), 0, s.rows, manifest.row_tokens, None)
            for s in manifest.splits[split].shards]
    return np.concatenate(rows).reshape(-1)


def window_hashes(tokens: np.ndarray, n: int = WINDOW) -> np.ndarray:
    """A 64-bit hash of every window of n tokens (a polynomial one: collisions are ~2^-64)."""
    tokens = tokens.astype(np.uint64) + np.uint64(1)
    h = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    prime = np.uint64(1099511628211)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = h * prime + tokens[k:k + len(h)]
    return h


def known_windows(tokens: np.ndarray) -> np.ndarray:
    """Every window of `tokens`, hashed once and sorted: what `found_share` and `isin` look up."""
    return np.unique(window_hashes(tokens))


def found_share(queries: np.ndarray, known: np.ndarray) -> float:
    """Share of `queries`' windows, one every WINDOW tokens, that are among the `known_windows`."""
    return float(np.isin(window_hashes(queries)[::WINDOW], known).mean())


def checkpoints(sweep: str, seeds: set[int]) -> dict[int, list[str]]:
    """Run directories by parameter count: the sizes of the held-out depth at the check's budget,
    `seeds` of each (seed 0 is the sweep's own trial); a run whose directory is gone is named and left out."""
    rows = [r for r in read_trials(sweep) if r["status"] == "completed"]
    with open(os.path.join(sweep, CHECK_PLAN_FILE)) as f:
        check = json.load(f)
    budget = next(r["budget"] for r in rows if r["rung"] == check["rung"])
    runs: dict[int, list[str]] = defaultdict(list)
    rungs = {r["rung"]: int(r["params"]) for r in rows if r["budget"] == budget and r["phase"] in ("ladder", "check")}
    for rung, params in rungs.items():
        if rung == check["rung"]:
            first = min((r for r in rows if r["phase"] == "check"), key=lambda r: abs(r["lr"] - check["lr"]))
        else:
            first = min((r for r in rows if r["rung"] == rung and r["phase"] == "ladder"), key=lambda r: r["val_loss"])
        runs[params] += [os.path.join(sweep, "trials", r["trial_id"]) for r in rows
                         if (r is first or (r["rung"] == rung and r["phase"] == "seeds" and r["lr"] == first["lr"]))
                         and int(r["seed"]) in seeds]
    for name in ("results.jsonl", "beyond.jsonl"):
        path = os.path.join(sweep, EXTRA, name)
        for line in open(path) if os.path.exists(path) else ():
            r = json.loads(line)
            beyond_same_depth = r["rung"].endswith("-check") and "x" not in r["rung"] and r["rung"] not in rungs
            if (r["rung"] in rungs or beyond_same_depth) and r["seed"] in seeds:
                leaf = f"{r['rung']}-lr{r['lr']:.6g}-seed{r['seed']}"  # as sweep_seeds.run_one names it
                runs[rungs.get(r["rung"]) or r["params"]].append(os.path.join(sweep, EXTRA, leaf))
    for params, dirs in runs.items():
        for gone in [d for d in dirs if not os.path.isdir(d)]:
            print(f"{gone}: no such directory, left out of {params:,} parameters' mean", flush=True)
            dirs.remove(gone)
    return dict(sorted((params, dirs) for params, dirs in runs.items() if dirs))


@torch.no_grad()
def token_loss(run_dir: str, rows: torch.Tensor) -> np.ndarray:
    """The val loss (nats) of every target of `rows` (rows x positions), from the run's newest checkpoint."""
    model = load_for_inference(run_dir)[0]
    nats = [F.cross_entropy(model(batch[:, :-1]).float().transpose(1, 2), batch[:, 1:], reduction="none")
            for batch in rows.split(32)]
    return torch.cat(nats).double().numpy()


def slope(small: tuple[int, float], large: tuple[int, float]) -> float:
    """Log-log slope of loss against parameters between two (parameters, loss) points."""
    return math.log(small[1] / large[1]) / math.log(large[0] / small[0])


def seed_list(text: str) -> set[int]:
    try:
        return {int(seed) for seed in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of seeds, e.g. 0,1,2") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="a finished sweep's directory, with sweep_seeds.py's --beyond sizes")
    parser.add_argument("data", help="the prepared dataset the sweep trained on")
    parser.add_argument("--mean-of", default="0,1,2", type=seed_list,
                        help="the seeds averaged at each size (default 0,1,2)")
    parser.add_argument("--val-rows", type=int, default=256, help="rows of the val split, evenly spaced (default 256)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    for name in (TRIALS_FILE, CHECK_PLAN_FILE):
        if not os.path.exists(os.path.join(args.sweep, name)):
            parser.error(f"{args.sweep} has no {name}: give the directory of a sweep that ran its held-out check")
    try:
        manifest = load_manifest(args.data)
    except DatasetError as e:
        parser.error(str(e))
    train, val = split_tokens(args.data, manifest, "train"), split_tokens(args.data, manifest, "val")
    train_windows = known_windows(train)
    half = len(train) // 2
    print(f"{args.data}: {len(train):,} train and {len(val):,} val tokens; {WINDOW}-token windows found verbatim: "
          f"val in train {found_share(val, train_windows):.1%}, train's second half in its first "
          f"{found_share(train[half:], known_windows(train[:half])):.1%}", flush=True)

    # A target is "seen" when the 64 tokens that end at it occur verbatim in the training split.
    seen = np.zeros(len(val), dtype=bool)
    seen[WINDOW - 1:] = np.isin(window_hashes(val), train_windows)
    row_tokens = manifest.row_tokens
    picked = np.linspace(0, len(val) // row_tokens - 1, args.val_rows).astype(int)
    rows = torch.from_numpy(val.reshape(-1, row_tokens)[picked].astype(np.int64))
    targets = picked[:, None] * row_tokens + np.arange(1, row_tokens)  # each target's index in the val tokens
    late = np.zeros_like(targets, dtype=bool)
    late[:, WINDOW:] = True  # its 64 tokens inside the row: what the model saw
    groups = {"seen": late & seen[targets], "unseen": late & ~seen[targets]}
    print(f"positions {WINDOW}-{row_tokens - 2} of {args.val_rows} val rows: {groups['seen'].sum() / late.sum():.1%} "
          "of their targets end a 64-token window found in train", flush=True)

    columns = [f"{a}-{b - 1}" for a, b in BANDS] + list(groups)
    losses: dict[int, dict[str, float]] = {}
    for params, dirs in checkpoints(args.sweep, args.mean_of).items():
        by_seed = [token_loss(d, rows) for d in dirs]
        nats = np.mean(by_seed, axis=0)
        losses[params] = {"all": nats.mean(), **{f"{a}-{b - 1}": nats[:, a:b].mean() for a, b in BANDS},
                          **{name: nats[mask].mean() for name, mask in groups.items()}}
        line = f"{params:>9,} parameters, {len(dirs)} seed(s): " + \
            " | ".join(f"{k} {v:.4f}" for k, v in losses[params].items())
        if len(by_seed) > 1:
            # Where the seeds differ: text the model could have memorised, or the rest.
            line += " | seed spread (highest / lowest - 1) " + ", ".join(
                f"{name} {max(seed[mask].mean() for seed in by_seed) / min(seed[mask].mean() for seed in by_seed) - 1:.1%}"
                for name, mask in {"all": np.ones_like(late), **groups}.items())
        print(line, flush=True)
    print("\nlog-log slope of val loss against parameters between neighbouring sizes: over every target, by "
          "position in the context, and (positions 64 on) by whether the 64 tokens ending at the target are in train")
    print(f"{'sizes':>22} | " + " | ".join(f"{c:>7}" for c in ["all", *columns]))
    sizes = sorted(losses)
    for small, large in zip(sizes, sizes[1:]):
        print(f"{small:>9,} -> {large:>9,} | " + " | ".join(
            f"{slope((small, losses[small][c]), (large, losses[large][c])):7.3f}" for c in ["all", *columns]))
    # As sweep_seeds.py's window table, on this script's val rows: would the targets that end no
    # window of the training split make a curve a power law carries further?
    print("a power law through 3 consecutive sizes, each larger one up to 4x predicted: every target, and positions "
          "64 on whose 64 tokens are not in train")
    for _, window, target in power_law_windows(sizes, (3,)):
        errors = [eval_power_law(power_law(window, [losses[p][c] for p in window]), target) / losses[target][c] - 1
                  for c in ("all", "unseen")]
        print(f"  {window[0]:,}-{window[-1]:,} -> {target:,}: {errors[0]:+.2%}, unseen {errors[1]:+.2%}")


if __name__ == "__main__":
    main()
