"""Loopback means loopback: every listening socket of every process a local `raylm train`
starts (Ray's servers, the dashboard, Ray Train's workers with the process group's store and
gloo) binds a loopback address. And the run keeps to its own Ray beside another one.

The default run (no dashboard) also shows that it starts only what it needs. On a 2-core machine
every process and import before the first step delays it. Only the training workers need torch
(each import of it elsewhere was 2 s), and a fixed-size run on a Ray it started has no autoscaler
for Ray's autoscaling coordinator to talk to (the coordinator was a process importing Ray Data at
start-up, 2.5 s of CPU, and waking 100 times a second all run). A callback that Ray Train runs in
the driver and in its controller records both (tests/support/run_probe.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.local import process_tree
from tests.support.sockets import listeners

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dashboard", [False, True])
def test_a_local_run_listens_on_loopback_only_and_by_default_starts_only_what_it_needs(tiny_dataset, tmp_path, dashboard):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    probe = tmp_path / "probe.jsonl"
    if not dashboard:
        env.update(RAY_TRAIN_CALLBACKS="tests.support.run_probe.RunProbe", RAYLM_RUN_PROBE=str(probe),
                   PYTHONPATH=str(REPO))
    metrics = tmp_path / "sockets" / "metrics.jsonl"
    driver = subprocess.Popen(
        [sys.executable, "-m", "raylm.cli", "train", f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}",
         "run.name=sockets", "data.chunk_rows=8", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
         "model.max_seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=12",
         "train.eval_every=0", "schedule.warmup_steps=2", "checkpoint.every_steps=6", "parallel.num_workers=2", "parallel.cpus_per_worker=1",
         "run.max_failures=0", f"run.dashboard={str(dashboard).lower()}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
    if not dashboard:
        records = [json.loads(line) for line in probe.read_text().splitlines()]
        assert [r["where"] for r in records] == ["driver", "controller, workers started", "controller, run finished"]
        assert records[1]["pid"] != records[0]["pid"]
        assert [r for r in records if r["torch"]] == []
        assert [r["named_actors"] for r in records[1:]] == [[], []]
