"""Chaos on the local multi-node cluster: a `raylm train` driver joined to it, and the Ray
Train worker processes to kill. Used by the chaos tests and the recovery benchmark.

    driver = TrainDriver(cluster, run_dir, ["configs/demo-cpu.yaml", "train.steps=100"])
    driver.wait_for("step 20", lambda: driver.last_step() >= 20)
    kill_process_trees([train_worker(cluster, node=2)])
    driver.finish()
    driver.events("resumed")   # from events.jsonl: when, from which step, steps lost, world size
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from cluster.local import LocalCluster, Proc
from raylm.train.observe.records import EVENTS_FILE, METRICS_FILE, read_jsonl


class ChaosError(AssertionError):
    """The run did not do what was waited for; the message quotes the driver's log."""


class TrainDriver:
    """`python -m raylm.cli train ARGS run.ray_address=<cluster>` in its own process, as `ray job
    submit` would start it; stdout and stderr go to `<run_dir>-driver.log`. `run_dir` must be
    where ARGS put the run (run.storage_path / run.name)."""

    def __init__(self, cluster: LocalCluster, run_dir: Path, args: list[str]):
        self.run_dir = Path(run_dir)
        self.log = self.run_dir.with_name(f"{self.run_dir.name}-driver.log")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "raylm.cli", "train", *args, f"run.ray_address={cluster.address}"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **cluster.driver_env()})

    def tail(self, lines: int = 60) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    def wait_for(self, what: str, done: Callable[[], bool], timeout_s: float = 240, poll_s: float = 0.05) -> float:
        """Wait until `done()`; returns the seconds waited. Raises ChaosError if the run ends
        first or time runs out."""
        start = time.monotonic()
        while not done():
            if self.proc.poll() is not None:
                raise ChaosError(f"the run ended (exit {self.proc.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() - start > timeout_s:
                raise ChaosError(f"not within {timeout_s:.0f} s: {what}:\n{self.tail()}")
            time.sleep(poll_s)
        return time.monotonic() - start

    def finish(self, timeout_s: float = 300) -> None:
        """Wait for the run to end; raises ChaosError unless it succeeded."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise ChaosError(f"the run did not finish within {timeout_s:.0f} s:\n{self.tail()}") from None
        if code != 0:
            raise ChaosError(f"the run failed (exit {code}):\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def metrics(self) -> list[dict]:
        return read_jsonl(str(self.run_dir / METRICS_FILE))

    def last_step(self) -> int:
        """The step of the last metrics row, read from the file's end: waiting loops ask several
        times a second, and parsing a long run's whole file (megabytes of JSON) each time took a
        sixth of a core from the run the drill was timing."""
        try:
            with open(self.run_dir / METRICS_FILE, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
                lines = f.read().splitlines()
        except FileNotFoundError:
            return 0
        for line in reversed(lines):  # the first may be cut by the seek, the last by a writer
            try:
                return json.loads(line)["step"]
            except (ValueError, KeyError):
                continue
        return 0

    def events(self, kind: str) -> list[dict]:
        """events.jsonl entries of one kind: "failure" (the driver's record of a worker-group
        failure) or "resumed" (rank 0's record of a restart: from_step, steps_lost, world_size)."""
        return [e for e in read_jsonl(str(self.run_dir / EVENTS_FILE)) if e["event"] == kind]


def train_workers(cluster: LocalCluster, node: int) -> list[Proc]:
    """(pid, start time) of each Ray Train worker process on `node`, for `kill_process_trees`."""
    cluster.processes(node)  # refreshes the node's (pid, start time) list read below
    found = []
    for pid, start in cluster.nodes[node].procs:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::RayTrainWorker"):
                    found.append((pid, start))
        except OSError:  # gone meanwhile
            continue
    return found


def train_worker(cluster: LocalCluster, node: int) -> Proc:
    """(pid, start time) of a Ray Train worker process on `node`."""
    found = train_workers(cluster, node)
    if not found:
        raise ChaosError(f"no Ray Train worker process on node {node}")
    return found[0]


def fill_filesystem(path: Path) -> int:
    """A stray file at `path` takes every free byte of its filesystem, to the last one (a full
    disk); returns its size. Deleting it frees the space."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return os.stat(path).st_size
