"""The held-out prediction's interval of a µP sweep two ways, from its records alone (no data, no Ray).

`raylm sweep` bootstraps the rungs: it resamples the ladder's points (seed means) with replacement
and refits, so a resample can drop a size. With `ladder.seeds` > 1 each rung's seeds can be
resampled instead, every rung kept: the ladder run again with other seeds. Both are printed for
the local predictor against the held-out size's measured mean of seeds (benchmarks/RESULTS.md,
issue 64).

    .venv/bin/python benchmarks/sweep_interval_by_seeds.py benchmarks/sweeps/sweep-cpu-mup-alpha-*
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import yaml

from raylm.config import build_dataclass
from raylm.sweep import fit
from raylm.sweep.analysis import local_rungs
from raylm.sweep.config import SweepConfig
from raylm.sweep.run import fit_ladder


def seed_interval(rungs: list[dict], sweep: SweepConfig, params: float, tokens: float, resamples: int) -> list[float]:
    """The local form refitted on `resamples` draws of each rung's seeds (with replacement)."""
    points = local_rungs(rungs, sweep)
    rng = np.random.default_rng(sweep.fit.seed)
    n, d = [r["params"] for r in points], [r["tokens"] for r in points]
    samples = []
    for _ in range(resamples):
        # A rung's loss is its refined best moved by its seeds' mean: move it by the drawn mean instead.
        losses = [r["loss"] - np.mean(r["seed_losses"]) + rng.choice(r["seed_losses"], len(r["seed_losses"])).mean()
                  for r in points]
        samples.append(float(fit.fit_local(n, d, losses).loss(params, tokens)))
    return fit.interval(samples, sweep.fit.confidence)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweeps", nargs="+", help="sweep directories (sweep.yaml, trials.csv, fit.json)")
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args()
    print("| sweep | predicted (local) | rungs resampled | seeds resampled | measured, mean of seeds |")
    print("|---|---|---|---|---|")
    for directory in args.sweeps:
        _, result, laws, _ = fit_ladder(directory)
        with open(os.path.join(directory, "fit.json")) as f:
            check = json.load(f)["check"]
        prediction = laws.predict(check["params"], check["tokens"], "local")
        predicted = prediction["loss"]
        with open(os.path.join(directory, "sweep.yaml")) as f:
            sweep = build_dataclass(SweepConfig, yaml.safe_load(f)["sweep"])
        by_seeds = seed_interval(result["rungs"], sweep, check["params"], check["tokens"], args.resamples)
        measured = check["averaged"]["shapes"][0]["measured_loss"]

        def span(interval: list[float]) -> str:
            inside = "inside" if interval[0] <= measured <= interval[1] else "outside"
            return f"{100 * (interval[0] / predicted - 1):+.1f}% / {100 * (interval[1] / predicted - 1):+.1f}% ({inside})"

        print(f"| {os.path.basename(directory.rstrip('/'))} | {predicted:.4f} | {span(prediction['interval'])} | "
              f"{span(by_seeds)} | {measured:.4f} ({100 * (measured / predicted - 1):+.2f}%) |")


if __name__ == "__main__":
    main()
