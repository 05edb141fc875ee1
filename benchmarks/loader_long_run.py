"""Step time of a long run with the cluster loader (`data.loader=ray`) against the local one.

    .venv/bin/python benchmarks/loader_long_run.py [--steps 20000] [--measure 150]

On the README's local cluster (a head and 3 nodes of 2 CPUs), the demo model on 2 workers is
planned for --steps steps (long enough that its reader never holds the rest of the run) and
stopped after 20 + --measure steps; its median step time over the last --measure is compared with
the same run reading on a thread of the training process (`data.loader=local`, the baseline: no
reader process at all). The ratio is what the cluster loader costs a step; it was 2.68 when the
reader was a Ray Data pipeline, whose scheduling loop busy-waits in the training process once it
is ahead of its consumer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from _common import load_average, print_table
from cluster.chaos import TrainDriver
from cluster.local import LocalCluster
from recovery import DEMO_CONFIG, REPO, ensure_demo_data


def median_step(cluster: LocalCluster, workdir: Path, data: Path, loader: str, steps: int, measure: int) -> float:
    name = f"loader-{loader}-{time.strftime('%H%M%S')}"
    driver = TrainDriver(cluster, workdir / name, [
        str(DEMO_CONFIG), f"data.path={data}", f"run.storage_path={workdir}", f"run.name={name}",
        f"train.steps={steps}", f"data.loader={loader}", "train.eval_every=0", "checkpoint.every_steps=0",
        "train.tensorboard=false"])
    try:
        driver.wait_for(f"step {20 + measure}", lambda: driver.last_step() >= 20 + measure, timeout_s=1800, poll_s=1)
    finally:
        driver.stop()
    return statistics.median(r["step_time"] for r in driver.metrics() if 20 < r["step"] <= 20 + measure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000, help="the run's planned steps")
    parser.add_argument("--measure", type=int, default=150, help="steps timed, after 20 of warm-up")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench")
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "data" / "stdlib-byte-256",
                        help="the demo's prepared data (prepared here if missing)")
    args = parser.parse_args()

    ensure_demo_data(args.data)
    with LocalCluster(num_nodes=3, cpus_per_node=2) as cluster:
        times = {loader: median_step(cluster, args.workdir, args.data, loader, args.steps, args.measure)
                 for loader in ("local", "ray")}
    print(f"\n== median step time of a {args.steps}-step run, {DEMO_CONFIG.relative_to(REPO)} on 2 workers "
          f"(load {load_average()})")
    print_table(["loader", "median step s", "vs local"],
                [[loader, f"{t:.3f}", f"{t / times['local']:.2f}x"] for loader, t in times.items()])
    print(f"command: {' '.join([os.path.relpath(sys.executable, REPO), *sys.argv])}")


if __name__ == "__main__":
    main()
