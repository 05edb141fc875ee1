"""Start-up of a cluster job: from `ray job submit` to the first training step, against `raylm train`.

    .venv/bin/python benchmarks/job_startup.py [--rounds 2] [--steps 20]

Starts the local multi-node cluster (a head and 2 worker nodes of 2 CPUs on 127.0.0.2-4, as the
README's `scripts/local-cluster start --nodes 2 --cpus-per-node 2`), prepares the demo's data if
needed (the built-in corpus, byte tokens, seq_len 256) and runs `configs/demo-cpu.yaml` for a few
steps three ways, round after round:

- `ray job submit --working-dir . --runtime-env jobs/runtime_env.yaml -- python jobs/pretrain.py`
  (the job uploads the working directory, starts a driver on the head, which joins the cluster);
- `raylm train ... run.ray_address=<cluster>`: the CLI on this machine joins the same cluster;
- `raylm train ...` alone: the CLI starts its own local Ray (the laptop run), for scale.

Each figure is the time from the command's start to the end of the first training step (the
first metrics.jsonl row's `time`) and to the command's exit. The first round is cold (Ray's
runtime-env cache, the page cache, Python's bytecode); later rounds are warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import load_average, print_table
from cluster.local import LocalCluster

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = "configs/demo-cpu.yaml"
RAY = str(Path(sys.executable).with_name("ray"))


def ensure_demo_data(path: Path) -> None:
    if not (path / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "raylm.cli", "prepare", "--output", str(path), "--seq-len", "256"],
                       check=True, cwd=REPO)


def first_step_time(run_dir: Path) -> float:
    with open(run_dir / "metrics.jsonl") as f:
        return json.loads(f.readline())["time"]


def timed(command: list[str], env: dict, run_dir: Path, log: Path) -> dict:
    start = time.time()
    with open(log, "wb") as out:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    end = time.time()
    if code != 0:
        raise SystemExit(f"{command[0]} exited {code}; see {log}")
    return {"first step s": first_step_time(run_dir) - start, "exit s": end - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench")
    parser.add_argument("--data", type=Path, default=REPO / "runs" / "data" / "stdlib-byte-256",
                        help="the demo's prepared data (prepared here if missing)")
    args = parser.parse_args()

    ensure_demo_data(args.data)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    storage = (args.workdir / f"job-startup-{stamp}").resolve()
    storage.mkdir(parents=True)

    def run_args(name: str) -> list[str]:
        # The job's driver runs in another directory: every path is absolute.
        return [DEMO_CONFIG, f"data.path={args.data.resolve()}", f"run.storage_path={storage}", f"run.name={name}",
                f"train.steps={args.steps}", "schedule.warmup_steps=5", "train.eval_every=0", "checkpoint.every_steps=0"]

    results: dict[str, list[dict]] = {"ray job submit": [], "raylm train (joins the cluster)": [],
                                      "raylm train (own local Ray)": []}
    with LocalCluster(num_nodes=2, cpus_per_node=2) as cluster:
        joined = {**os.environ, **cluster.driver_env()}
        alone = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        for r in range(args.rounds):
            name = f"job-{r}"
            results["ray job submit"].append(timed(
                [RAY, "job", "submit", "--address", cluster.dashboard_url, "--runtime-env", "jobs/runtime_env.yaml",
                 "--working-dir", ".", "--submission-id", f"startup-{stamp}-{r}", "--", "python", "jobs/pretrain.py",
                 *run_args(name)], joined, storage / name, storage / f"{name}.log"))
            name = f"join-{r}"
            results["raylm train (joins the cluster)"].append(timed(
                [sys.executable, "-m", "raylm.cli", "train", *run_args(name), f"run.ray_address={cluster.address}"],
                joined, storage / name, storage / f"{name}.log"))
        for r in range(args.rounds):  # after the cluster is gone: the cores are the local Ray's alone
            name = f"local-{r}"
            results["raylm train (own local Ray)"].append(timed(
                [sys.executable, "-m", "raylm.cli", "train", *run_args(name)], alone, storage / name,
                storage / f"{name}.log"))

    print(f"\n== start-up to the first step, {DEMO_CONFIG} ({args.steps} steps), load {load_average()}")
    rows = []
    for how, rounds in results.items():
        for r, figures in enumerate(rounds):
            rows.append([how, "cold" if r == 0 else "warm", f"{figures['first step s']:.1f}", f"{figures['exit s']:.1f}"])
    print_table(["how", "round", "command to first step, s", "command to exit, s"], rows)
    submit, joined_cli = results["ray job submit"][1:], results["raylm train (joins the cluster)"][1:]
    if submit and joined_cli:
        ratio = (statistics.median(f["first step s"] for f in submit)
                 / statistics.median(f["first step s"] for f in joined_cli))
        print(f"\nwarm: ray job submit / raylm train on the same cluster, to the first step: {ratio:.2f}×")
    print(f"runs and logs: {storage}")
    print(f"command: {' '.join([os.path.relpath(sys.executable, REPO), *sys.argv])}")


if __name__ == "__main__":
    main()
