"""What the console and the experiment trackers cost per training step.

    .venv/bin/python benchmarks/tracker_overhead.py [--steps 200] [--rounds 5] [--only ARM ...]

On the nanoGPT Shakespeare config (configs/nanogpt-shakespeare-char-cpu.yaml), trained in this
process (the loop on plain files with the local loader: no Ray in the timed steps), the same
run with each way of watching it:

- jsonl: metrics.jsonl only, a progress line every 100 steps (the config's log_every): the baseline;
- console every step: a progress line every step (log_every 1);
- tensorboard: TensorBoard event files (on by default in raylm);
- mlflow: MLflow with a local file store in the run directory (no server);
- wandb offline: Weights & Biases in offline mode (its service process writes a local log).

1. End to end: interleaved rounds whose order alternates (forward, then backward) so that a
   drift of the machine's load cancels; each run's cost is its mean step time after the first
   20 steps (a metrics row is written after its step's clock stops, so it lands in the next
   step's time), and its 10th-percentile ("fast") step; a round's ratio is each arm against
   the round's baseline run.
2. Direct: the rank-0 metrics hook alone (`MetricsLogger.on_step_end`: the jsonl row, the
   console line, the tracker calls) timed per call with a real step's metrics, for each arm,
   the best of 10 batches of 50 calls. It
   does not see work a tracker hands to another process (W&B's service) that then competes for
   the same cores: the end-to-end figure does.

Needs the `tracking` extra (mlflow, wandb). Nothing leaves the machine: W&B runs offline and
MLflow writes files.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import load_average, print_table, shakespeare_bytes
from raylm.config import Config, load_config
from raylm.parallel.world import World
from raylm.train.loop import train_local
from raylm.train.observe.metrics import MetricsLogger
from raylm.train.observe.records import read_jsonl

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "nanogpt-shakespeare-char-cpu.yaml"
WARMUP_STEPS = 20
BASELINE = "jsonl"
ARMS = {BASELINE: (),
        "console every step": ("train.log_every=1",),
        "tensorboard": ("train.tensorboard=true",),
        "mlflow": ("train.trackers=[mlflow]",),
        "wandb offline": ("train.trackers=[wandb]",)}


def config(data: str, steps: int, *extra: str) -> Config:
    return load_config(CONFIG, [f"data.path={data}", "data.loader=local", f"train.steps={steps}",
                                "train.eval_every=0", "train.tensorboard=false", "checkpoint.every_steps=0",
                                "guard.norms_every=0", *extra])


def local_trackers_only() -> None:
    """Trackers write into the run directory: no server, no account, nothing sent anywhere."""
    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_BASE_URL"):
        os.environ.pop(name, None)
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")


def run_dir(tmp: str, name: str, r: int) -> str:
    return f"{tmp}/{name.replace(' ', '-')}-{r}"


def end_to_end(data: str, arms: list[str], steps: int, rounds: int, tmp: str) -> dict[str, list[list[float]]]:
    """Each arm's step times after warm-up, per round."""
    times: dict[str, list[list[float]]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in arms if r % 2 == 0 else reversed(arms):
            run = run_dir(tmp, name, r)
            train_local(config(data, steps, *ARMS[name]), run)
            times[name].append([row["step_time"] for row in read_jsonl(f"{run}/metrics.jsonl")[WARMUP_STEPS:]])
            print(f"round {r}: {name:<18} mean step {1e3 * statistics.fmean(times[name][-1]):.2f} ms, "
                  f"median {1e3 * statistics.median(times[name][-1]):.2f} ms (load {load_average()})", flush=True)
    return times


def fast(run: list[float]) -> float:
    """The 10th-percentile step: a shared VM switches between a fast and a slow state within a
    run, and the fast steps of two runs compare alike."""
    return statistics.quantiles(run, n=10)[0]


def direct(data: str, arms: list[str], metrics: dict, tmp: str, batches: int = 10, calls: int = 50) -> dict[str, float]:
    """Seconds per `MetricsLogger.on_step_end` call, per arm, the best of `batches` batches (as
    timeit advises: what the work costs when it has a core, not how long other jobs on a shared
    machine held it off one); the console goes to a buffer."""
    per_call = {}
    for name in arms:
        logger = MetricsLogger(config(data, batches * calls, *ARMS[name]),
                               f"{tmp}/direct-{name.replace(' ', '-')}", World.current())
        try:
            best, step = float("inf"), 0
            with contextlib.redirect_stdout(io.StringIO()):
                for _ in range(batches):
                    start = time.perf_counter()
                    for _ in range(calls):
                        step += 1
                        logger.on_step_end(None, step - 1, {**metrics, "step": step})
                    best = min(best, (time.perf_counter() - start) / calls)
            per_call[name] = best
        finally:
            logger.close()
    return per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", type=Path, default=REPO.parent / "shared" / "data" / "tinyshakespeare.txt")
    ap.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench-guard",
                    help="where the prepared data is kept (shared with guard_panel.py)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="+", choices=list(ARMS), help="arms besides the baseline")
    args = ap.parse_args()
    arms = [BASELINE, *[a for a in (args.only or ARMS) if a != BASELINE]]
    local_trackers_only()
    data = shakespeare_bytes(args.input, args.workdir)
    print(f"load {load_average()}, torch threads {torch.get_num_threads()}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        times = end_to_end(data, arms, args.steps, args.rounds, tmp)
        metrics = read_jsonl(f"{run_dir(tmp, BASELINE, 0)}/metrics.jsonl")[-1]
        per_call = direct(data, arms, metrics, tmp)
    print(f"load {load_average()}", flush=True)

    base = times[BASELINE]
    fastest = min(map(fast, base))  # a fixed cost's share is largest on the fastest step
    rows = []
    for name in arms:
        means = [statistics.fmean(m) / statistics.fmean(b) for m, b in zip(times[name], base)]
        fasts = [fast(m) / fast(b) for m, b in zip(times[name], base)]
        rows.append([name, f"{1e3 * statistics.median(map(statistics.fmean, times[name])):.2f} ms",
                     f"{statistics.median(means):.3f} ({', '.join(f'{r:.2f}' for r in means)})",
                     f"{statistics.median(fasts):.3f}",
                     f"{1e6 * per_call[name]:.0f} µs ({100 * per_call[name] / fastest:.2f}%)"])
    print_table(["arm", "mean step (median of rounds)", "mean-step ratio to jsonl, median (rounds)",
                 "fast-step ratio, median", f"direct: metrics hook per step (% of a {1e3 * fastest:.1f} ms step)"],
                rows)


if __name__ == "__main__":
    main()
