"""Recovery time: from a worker's death to the first completed step after the restart.

    .venv/bin/python benchmarks/recovery.py [--kill-at 150 250]

Starts the local multi-node cluster (a head and 2 worker nodes of 2 CPUs on 127.0.0.2-4),
prepares the demo's data if needed (the built-in corpus, byte tokens, seq_len 256), and runs
`raylm train configs/demo-cpu.yaml` on it as a driver process. At each --kill-at step it
SIGKILLs one Ray Train worker process and times the recovery from the run's own records:

- detected: the driver's `failure` event (Ray Train saw the worker group fail);
- restored: rank 0's `resumed` event (new workers started, self-tested, checkpoint loaded);
- first step: the first metrics.jsonl row after the restart (polled every 20 ms).

Steps lost are the steps trained after the checkpoint and redone (the demo checkpoints every 100
steps, so a kill at step 150 loses 50). The goal is <= 30 s from death to first step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import load_average, print_table
from cluster.chaos import ChaosError, TrainDriver, train_worker
from cluster.local import LocalCluster, kill_process_trees

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo-cpu.yaml"


def ensure_demo_data(path: Path) -> None:
    if (path / "manifest.json").exists():
        print(f"data: {path} already prepared")
        return
    subprocess.run([sys.executable, "-m", "raylm.cli", "prepare", "--output", str(path), "--seq-len", "256"],
                   check=True)


def kill_a_worker(cluster: LocalCluster) -> int:
    for node in range(1, len(cluster.nodes)):
        try:
            proc = train_worker(cluster, node)
        except ChaosError:
            continue
        kill_process_trees([proc])
        return node
    raise ChaosError("no Ray Train worker process on any node")


def measure_recovery(driver: TrainDriver, cluster: LocalCluster, step: int) -> dict:
    driver.wait_for(f"step {step}", lambda: driver.last_step() >= step, timeout_s=900)
    failures, resumes = len(driver.events("failure")), len(driver.events("resumed"))
    killed_at_step = driver.last_step()
    killed = time.time()
    node = kill_a_worker(cluster)
    driver.wait_for("the restart", lambda: len(driver.events("resumed")) > resumes, timeout_s=300, poll_s=0.02)
    resumed = driver.events("resumed")[-1]
    driver.wait_for("a step after the restart", lambda: driver.last_step() > resumed["from_step"], poll_s=0.02)
    first_step = time.time()
    failure = driver.events("failure")[failures:]
    detected = failure[0]["time"] if failure else float("nan")
    return {"killed at step": killed_at_step, "node": node, "detected s": detected - killed,
            "restored s": resumed["time"] - killed, "first step s": first_step - killed,
            "resumed from": resumed["from_step"], "steps lost": resumed["steps_lost"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kill-at", type=int, nargs="+", default=[150, 250], help="steps at which to kill a worker")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench")
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "data" / "stdlib-byte-256",
                        help="the demo's prepared data (prepared here if missing)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    ensure_demo_data(args.data)
    name = time.strftime("recovery-%Y%m%d-%H%M%S")
    with LocalCluster(num_nodes=2, cpus_per_node=2) as cluster:
        driver = TrainDriver(cluster, args.workdir / name, [
            str(DEMO_CONFIG), f"data.path={args.data}", f"run.storage_path={args.workdir}", f"run.name={name}",
            f"run.max_failures={len(args.kill_at)}", "train.log_every=50", *args.override])
        try:
            results = [measure_recovery(driver, cluster, step) for step in args.kill_at]
            driver.finish(timeout_s=900)
        finally:
            driver.stop()
    rows = driver.metrics()
    step_time = statistics.median(r["step_time"] for r in rows)
    print(f"\n== recovery on the local cluster, {DEMO_CONFIG.relative_to(REPO)} (load {load_average()})")
    headers = list(results[0]) + ["work lost s (steps × median step)"]
    print_table(headers, [[f"{v:.1f}" if isinstance(v, float) else v for v in r.values()]
                          + [f"{r['steps lost'] * step_time:.1f}"] for r in results])
    print(f"\nmedian step time {step_time:.3f} s; run {args.workdir / name}; goal: first step <= 30 s after the kill")
    print(f"command: {' '.join([os.path.relpath(sys.executable, REPO), *sys.argv])}")


if __name__ == "__main__":
    main()
