"""An elastic run's command run again after its driver was SIGKILLed: how long until it trains.

    .venv/bin/python benchmarks/elastic_restart.py --json-out elastic_restart.json [--rounds 2]

On the README's local cluster (`scripts/local-cluster`'s shape: a 0-CPU head and two 2-CPU
nodes), the demo model elastic (`parallel.min_workers=1`) with two 2-CPU workers that fill both
nodes. Each round: the run starts and writes its first checkpoint, its driver is SIGKILLed (as a
lost head-node process would be), and the same command starts again at once; the figure is the
seconds from the kill to the first step the new driver's run trains after its resume, which is
then stopped by a SIGTERM. Rounds alternate between Ray's behaviour
(`RAY_TRAIN_ENABLE_STATE_TRACKING=0`, which leaves raylm nothing to release: the autoscaling
coordinator keeps the dead run's reservation until it expires) and raylm's (tracking on, the
dead run's reservation released at the elastic start; `raylm.launch.coordinator`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from _common import load_average
from cluster.chaos import TrainDriver
from cluster.local import LocalCluster
from raylm.launch.coordinator import TRAIN_STATE_TRACKING

REPO = Path(__file__).resolve().parents[1]
MODES = {"ray": "0", "raylm": "1"}  # the tracking setting of each side
CHECKPOINT_EVERY = 10


def args(data: Path, storage: Path, name: str) -> list[str]:
    return [str(REPO / "configs" / "demo-cpu.yaml"), f"data.path={data}", f"run.storage_path={storage}",
            f"run.name={name}", "train.steps=100000", "train.eval_every=0", "train.tensorboard=false",
            f"checkpoint.every_steps={CHECKPOINT_EVERY}", "parallel.min_workers=1", "parallel.cpus_per_worker=2",
            "parallel.resize_check_s=2"]


def round_trip(cluster: LocalCluster, data: Path, storage: Path, name: str) -> float:
    """Seconds from the SIGKILL of a training run's driver to the first step of the same command."""
    killed = TrainDriver(cluster, storage / name, args(data, storage, name))
    try:
        killed.wait_for("a checkpoint", lambda: killed.last_step() > CHECKPOINT_EVERY, timeout_s=600)
    finally:
        killed.stop()
    killed_at = time.time()
    again = TrainDriver(cluster, storage / name, args(data, storage, name))

    def first_step() -> Optional[float]:
        # After the new run's resume: the killed driver's workers may write a row or two as they die.
        resumed = [event["time"] for event in again.events("resumed") if event["time"] > killed_at]
        times = [row["time"] for row in again.metrics() if resumed and row["time"] > resumed[0]]
        return min(times) if times else None
    try:
        again.wait_for("a step of the new driver", lambda: first_step() is not None, timeout_s=600)
        return first_step() - killed_at
    finally:  # stopped as `ray job stop` stops it: its controller gives its reservation back
        again.proc.send_signal(signal.SIGTERM)
        try:
            again.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            again.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="of each side, in turns")
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "data" / "stdlib-bpe-2048-128",
                        help="the demo's prepared data (make demo prepares it)")
    parser.add_argument("--json-out", type=Path)
    opts = parser.parse_args()
    storage = Path(tempfile.mkdtemp(prefix="elastic-restart-"))
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    cluster = LocalCluster(num_nodes=2, cpus_per_node=2)
    try:
        cluster.start()
        for index in range(opts.rounds):
            for mode, tracking in MODES.items():
                os.environ[TRAIN_STATE_TRACKING] = tracking  # the drivers' environment
                took = round_trip(cluster, opts.data, storage, f"{mode}-{index}")
                seconds[mode].append(took)
                print(f"{mode}: round {index}: the same command trained {took:.1f} s after the kill "
                      f"(load {load_average()})", flush=True)
    finally:
        cluster.stop()
    result = {mode: {"seconds": s, "median_s": statistics.median(s)} for mode, s in seconds.items()}
    result["ratio"] = result["ray"]["median_s"] / result["raylm"]["median_s"]
    print(f"median: Ray {result['ray']['median_s']:.1f} s, raylm {result['raylm']['median_s']:.1f} s "
          f"({result['ratio']:.1f}x sooner)", flush=True)
    if opts.json_out:
        opts.json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
