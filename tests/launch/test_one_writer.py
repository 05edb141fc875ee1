"""`raylm train` as a user runs it: one writer per run directory (local disk and SeaweedFS S3),
and a deterministic error in a worker ends the run at once instead of going around Ray's restarts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from raylm.data import storage
from raylm.train.lease import LEASE_FILE
from raylm.train.observe.records import read_jsonl
from tests.support.cli import assert_clean_refusal, run_storage

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_args(dataset: str, storage_path: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "raylm.cli", "train", f"data.path={dataset}", f"run.storage_path={storage_path}",
            "run.name=shared", "data.chunk_rows=8", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
            "model.max_seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
            "train.tensorboard=false", "schedule.warmup_steps=1", "parallel.num_workers=1", *extra]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_second_run_of_the_same_run_is_refused_before_it_starts_ray(tiny_dataset, tmp_path, request, where):
    storage_path, storage_cfg, extra = run_storage(request, where, tmp_path)
    args = train_args(tiny_dataset, storage_path, "train.steps=40", "checkpoint.every_steps=10", *extra)
    lease = storage.join(storage_path, "shared", LEASE_FILE)
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not storage.exists(lease, storage_cfg):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.5)
        second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"is in use by raylm train (host {os.uname().nodename}, pid {first.pid}" in second.stderr
        assert "Ray instance" not in second.stdout + second.stderr  # refused before any Ray or worker
        assert first.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        first.kill()
    local = str(tmp_path / "runs" / "shared") if where == "local" else None
    if local:
        assert [r["step"] for r in read_jsonl(os.path.join(local, "metrics.jsonl"))] == list(range(1, 41))
    assert not storage.exists(lease, storage_cfg)  # released at the end


def test_a_deterministic_error_in_a_worker_ends_the_run_at_once(tiny_dataset, tmp_path):
    # The guard off and an LR no run survives: the loss turns non-finite, which no restart cures.
    args = train_args(tiny_dataset, str(tmp_path / "runs"), "train.steps=40", "checkpoint.every_steps=5",
                      "guard.enabled=false", "optim.lr=1e38", "schedule.warmup_steps=0", "schedule.name=constant",
                      "run.max_failures=3")
    started = time.monotonic()
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("raylm: error:")]
    assert len(errors) == 1 and "is not finite; the weights were not updated" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr.split("raylm: error:")[-1]
    events = read_jsonl(str(tmp_path / "runs" / "shared" / "events.jsonl"))
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == 1 and failures[0]["deterministic"] is True, events
    assert not [e for e in events if e["event"] == "resumed"]  # no second attempt
    print(f"ended {time.monotonic() - started:.1f} s after the command")


def test_a_refused_start_leaves_nothing_it_created(tiny_dataset, tmp_path):
    """`--resume` on a run that has no checkpoint is refused before Ray starts; the run directory
    (and the missing directories above it) that taking the lease created go again, its lock file
    with them. A directory that was there stays, as it was."""
    def resume(storage_path: str) -> None:
        out = subprocess.run([*train_args(tiny_dataset, storage_path), "--resume"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert_clean_refusal(out, "checkpoint.resume=required")
        assert out.returncode == 2 and "Ray instance" not in out.stdout + out.stderr

    resume(str(tmp_path / "new" / "runs"))
    assert os.listdir(tmp_path) == []
    (tmp_path / "runs" / "shared").mkdir(parents=True)
    resume(str(tmp_path / "runs"))
    assert os.listdir(tmp_path / "runs" / "shared") == []
