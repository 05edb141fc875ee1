"""Loopback means loopback: every listening socket of every process a local `raylm train`
starts (Ray's servers, the dashboard, Ray Train's workers with the process group's store and
gloo) binds a loopback address. And the run keeps to its own Ray beside another one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from cluster.local import process_tree
from tests.support.sockets import listeners

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dashboard", [False, True])
def test_a_local_run_listens_on_loopback_only(tiny_dataset, tmp_path, dashboard):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    metrics = tmp_path / "sockets" / "metrics.jsonl"
    driver = subprocess.Popen(
        [sys.executable, "-m", "raylm.cli", "train", f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}",
         "run.name=sockets", "data.chunk_rows=8", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
         "model.max_seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=12",
         "train.eval_every=0", "schedule.warmup_steps=2", "checkpoint.every_steps=6", "parallel.num_workers=2", "parallel.cpus_per_worker=1",
         "run.max_failures=0", f"run.dashboard={str(dashboard).lower()}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: set = set()
    try:
        # From start-up (the store exists only while the process group forms and trains) to exit.
        while driver.poll() is None:
            seen |= listeners(process_tree(driver.pid))
            time.sleep(0.3)
        out = driver.stdout.read().decode(errors="replace")
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out[-3000:]
    # The console is raylm's progress lines: Ray Train's per-report lines only with --verbose.
    assert "done: step 12" in out and "Reporting training result" not in out, out[-3000:]
    # The run goes beside another local Ray (the test session's): with the dashboard, Train's
    # placement-group cleaner must find its own run's State API, not give up on two candidates
    # with a traceback; without it, the run has no cleaner to warn that the State API is absent.
    assert "Found multiple active Ray instances" not in out and "Traceback" not in out, out[-3000:]
    assert "Failed to query Ray Train Controller" not in out, out[-3000:]
    assert metrics.exists() and len(metrics.read_text().splitlines()) == 12
    # The survey saw the run's servers: the GCS, the raylet, and the training workers' own.
    names = {listener.process for listener in seen}
    assert {"gcs_server", "raylet"} <= names, names
    assert any(name.startswith("ray::RayTrainWo") for name in names), names
    shown = re.search(r"View the dashboard at \S*http://127\.0\.0\.1:(\d+)", out)
    assert bool(shown) == dashboard, out[-3000:]
    if dashboard:  # seen serving, on loopback like the rest
        assert int(shown.group(1)) in {listener.port for listener in seen}, seen
    exposed = sorted(f"{s.process} (pid {s.pid}) on {s.address}:{s.port}" for s in seen if not s.loopback)
    assert not exposed, "listening beyond loopback:\n  " + "\n  ".join(exposed)
