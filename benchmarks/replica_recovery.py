"""What a lost worker costs under parallel.fault_tolerance=replica (issue 59).

    .venv/bin/python benchmarks/replica_recovery.py --json-out replica.json [--faults 2] [--steps 300] [--clean-seeds 3]
    .venv/bin/python benchmarks/replica_recovery.py --node-loss --json-out node.json [--node-down-s 20]

Runs of the demo model (`configs/demo-cpu.yaml` on the demo's BPE data) as 3 torchft replica
groups of one CPU worker each (gloo), on the local Ray the driver starts: clean ones at
`--clean-seeds` seeds (the weights' and the sample order's), then the first seed's run again in
which a group's worker is SIGKILLed at random steps (another group each time, once the last one
has healed). From the runs' own records:

- next_step_s: from the kill to the surviving groups' next committed step (the `replica_lost` event);
- heal_s: from the kill to the step at which the replaced group trains again (`replica_healed`);
- steps_lost: the steps given up and trained again per fault (the step in flight, at most);
- healthy_restarts: workers of the groups not killed that started again (their PIDs);
- samples_once: every sample of the planned order trained exactly once (metrics.jsonl's audit);
- val_loss, clean_val_loss: the final validation loss of the faulty run and of the clean run of
  the same seed; clean_val_losses, one per seed, and seed_noise, their spread (max - min) over
  their mean; val_within_seed_noise: the faulty run's distance from its clean twin no more than
  that spread;
- goodput: `raylm report`'s of the faulty run (committed compute over wall time, a lost group's
  share of each step it was down for counted lost); not the drill's (`benchmarks/drill.py
  --fault-tolerance replica` measures that, among the drill's other faults).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from _common import load_average
from cluster.chaos import TrainDriver
from raylm.report import write_report

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo-cpu.yaml"
GROUPS = 3
# Ray folds alike lines of several workers into one: every group names its process on the console.
LOCAL = SimpleNamespace(address="local", driver_env=lambda: {"RAY_DEDUP_LOGS": "0"})


def group_processes(driver: TrainDriver) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for group, pid in re.findall(r"raylm: replica group (\d+) of \d+ in process (\d+)",
                                 driver.log.read_text(errors="replace")):
        found.setdefault(int(group), []).append(int(pid))
    return found


def run(args: argparse.Namespace, name: str, ray: SimpleNamespace = LOCAL, seed: int = 0) -> TrainDriver:
    return TrainDriver(ray, args.workdir / name, [
        str(DEMO_CONFIG), f"train.seed={1337 + seed}", f"data.seed={seed}", f"data.path={args.data}",
        f"run.storage_path={args.workdir}", f"run.name={name}",
        f"train.steps={args.steps}", f"train.eval_every={args.steps}", f"train.global_batch_size={8 * GROUPS}",
        "train.micro_batch_size=8", "train.audit_samples=true", "train.log_every=50",
        f"parallel.num_workers={GROUPS}", f"parallel.dp_replicate={GROUPS}", "parallel.fault_tolerance=replica",
        "parallel.cpus_per_worker=1", f"run.max_failures={args.faults}", "checkpoint.every_steps=100",
        *args.override])


def strike(driver: TrainDriver, group: int, step: int) -> dict:
    """SIGKILL `group`'s worker at `step`; its figures once it has healed."""
    driver.wait_for(f"step {step}", lambda: driver.last_step() >= step, timeout_s=1800, poll_s=0.02)
    lost_before, healed_before = len(driver.events("replica_lost")), len(driver.events("replica_healed"))
    pid = group_processes(driver)[group][-1]
    killed_at, killed = driver.last_step(), time.time()
    os.kill(pid, signal.SIGKILL)
    driver.wait_for("the group healed", lambda: len(driver.events("replica_healed")) > healed_before,
                    timeout_s=600, poll_s=0.1)
    lost = driver.events("replica_lost")[lost_before]
    healed = driver.events("replica_healed")[healed_before]
    return {"group": group, "killed_at_step": killed_at, "pid": pid, "next_step_s": lost["time"] - killed,
            "stall_s": lost["seconds"], "heal_s": healed["time"] - killed, "healed_at_step": healed["step"],
            "steps_lost": lost["retried"]}


def node_loss(args: argparse.Namespace, name: str) -> dict:
    """The same run on the local multi-node cluster (a node of 1 CPU a group): the node of group
    1's worker killed (its raylet and every process on it), started again `--node-down-s` later;
    the run is stopped (SIGTERM) a few steps after the group healed."""
    from cluster.local import LocalCluster

    with LocalCluster(num_nodes=GROUPS, cpus_per_node=1) as cluster:
        env = {**cluster.driver_env(), "RAY_DEDUP_LOGS": "0"}
        driver = run(args, name, SimpleNamespace(address=cluster.address, driver_env=lambda: env))
        try:
            driver.wait_for("step 20", lambda: driver.last_step() >= 20, timeout_s=900, poll_s=0.02)
            driver.wait_for("group 1's process named", lambda: 1 in group_processes(driver), timeout_s=60)
            pid = group_processes(driver)[1][0]
            node = next(i for i, n in enumerate(cluster.nodes) if not n.is_head and pid in cluster.processes(i))
            killed_at, killed = driver.last_step(), time.time()
            cluster.kill_node(node)
            driver.wait_for("the others' next step", lambda: driver.events("replica_lost"), timeout_s=300, poll_s=0.02)
            time.sleep(max(0.0, killed + args.node_down_s - time.time()))
            returned = time.time()
            cluster.start_node(node)
            driver.wait_for("the group healed", lambda: driver.events("replica_healed"), timeout_s=600, poll_s=0.1)
            (lost,), (healed,) = driver.events("replica_lost"), driver.events("replica_healed")
            driver.wait_for("3 steps more", lambda: driver.last_step() >= healed["step"] + 3, timeout_s=120)
            driver.proc.send_signal(signal.SIGTERM)
            driver.proc.wait(timeout=120)
        finally:
            driver.stop()
    return {"group": lost["group"], "node": node, "killed_at_step": killed_at, "next_step_s": lost["time"] - killed,
            "node_down_s": returned - killed, "heal_s": healed["time"] - killed,
            "heal_after_return_s": healed["time"] - returned, "steps_lost": lost["retried"],
            "samples_once": audit(driver), "resumed": len(driver.events("resumed")), "run": str(driver.run_dir)}


def audit(driver: TrainDriver) -> bool:
    rows = {r["step"]: r for r in driver.metrics()}
    trained = [i for s in sorted(rows) for i in rows[s]["samples"]]
    return sorted(rows) == list(range(1, len(rows) + 1)) and trained == list(range(len(trained)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=2, help="workers killed, one at a time")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0, help="of the steps the kills come at")
    parser.add_argument("--clean-seeds", type=int, default=3, help="clean runs, for the seed noise of val loss")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench")
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "data" / "stdlib-bpe-2048-128",
                        help="the demo's prepared data (make demo prepares it)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--node-loss", action="store_true",
                        help="instead: a node of the local multi-node cluster lost and returned")
    parser.add_argument("--node-down-s", type=float, default=20.0)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.clean_seeds < 1:
        parser.error(f"--clean-seeds must be at least 1, not {args.clean_seeds}")

    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.node_loss:
        result = {**node_loss(args, f"replica-node-{stamp}"), "load": load_average()}
        print(json.dumps(result, indent=2))
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=2) + "\n")
        return
    cleans = []
    for seed in range(args.clean_seeds):
        cleans.append(run(args, f"replica-clean-{stamp}" + (f"-seed{seed}" if seed else ""), seed=seed))
        cleans[-1].finish(timeout_s=3600)
    clean = cleans[0]
    rng = random.Random(args.seed)
    # Spread over the run, leaving room for each heal (tens of seconds on 2 cores).
    steps = sorted(rng.sample(range(args.steps // 10, args.steps // 2), args.faults))
    faulty = run(args, f"replica-faults-{stamp}")
    try:
        faults = [strike(faulty, (1 + i) % GROUPS, step) for i, step in enumerate(steps)]
        faulty.finish(timeout_s=3600)
    finally:
        faulty.stop()
    processes = group_processes(faulty)
    # Every process past the first of each group and the one each kill called for.
    healthy_restarts = sum(len(pids) for pids in processes.values()) - GROUPS - len(faults)
    summary = write_report([str(faulty.run_dir)], str(faulty.run_dir / "report"))["runs"][faulty.run_dir.name]
    val = lambda d: [r["val_loss"] for r in d.metrics() if "val_loss" in r][-1]  # noqa: E731
    clean_vals = [val(c) for c in cleans]
    noise = (max(clean_vals) - min(clean_vals)) / statistics.mean(clean_vals)
    result = {
        "steps_lost": max(f["steps_lost"] for f in faults), "healthy_restarts": healthy_restarts,
        "next_step_s": max(f["next_step_s"] for f in faults), "heal_s": max(f["heal_s"] for f in faults),
        "samples_once": audit(faulty), "val_loss": val(faulty), "clean_val_loss": val(clean),
        "clean_val_losses": clean_vals, "seed_noise": noise,
        "val_within_seed_noise": abs(val(faulty) - val(clean)) <= noise * statistics.mean(clean_vals),
        "goodput": summary["goodput"], "clean_goodput": write_report(
            [str(clean.run_dir)], str(clean.run_dir / "report"))["runs"][clean.run_dir.name]["goodput"],
        "faults": faults, "groups": GROUPS, "steps": args.steps, "processes": processes,
        "load": load_average(), "runs": [*(str(c.run_dir) for c in cleans), str(faulty.run_dir)],
    }
    print(json.dumps(result, indent=2))
    print(f"command: {' '.join([os.path.relpath(sys.executable, REPO), *sys.argv])}")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
