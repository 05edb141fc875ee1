"""`raylm status RUN`: running or not, step of total, losses, tokens/s, ETA, the newest complete
checkpoint and the last events, read from the run directory alone, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.support.checkpoints import make_run, run_cli
from tests.support.cli import run_main
from tests.support.terminal import run_on_terminal


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> str:
    """Checkpoints at steps 2 and 4 of a tiny training."""
    run = str(tmp_path_factory.mktemp("status") / "run")
    make_run(run, (2, 4))
    return run


def _run_with_records(saved_run: str, directory, steps: int = 10, heartbeat_age_s: float | None = 0.0) -> str:
    """A copy of `saved_run` with config.yaml (train.steps), six steps of metrics two seconds
    apart, a failure and the resume after it, and a lease whose heartbeat is `heartbeat_age_s`
    old (None: no lease)."""
    run = str(directory / "run")
    shutil.copytree(saved_run, run)
    now = time.time()
    with open(os.path.join(run, "config.yaml"), "w") as f:
        f.write(f"train:\n  steps: {steps}\nrun:\n  lease_timeout_s: 120\n")
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for step in range(1, 7):
            row = {"step": step, "time": now - 2 * (6 - step), "loss": 3.0 - 0.1 * step, "tokens_per_s": 1000.0}
            if step == 4:
                row["val_loss"] = 2.5
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(run, "events.jsonl"), "w") as f:
        f.write(json.dumps({"event": "failure", "time": now - 5, "cause": "worker died"}) + "\n")
        f.write(json.dumps({"event": "resumed", "time": now - 4, "from_step": 4, "seconds": 6.073549270629883}) + "\n")
        f.write(json.dumps({"event": "profile", "time": now - 3}) + "\n")  # not a failure, restart or guard event
    if heartbeat_age_s is not None:
        with open(os.path.join(run, "run.lease"), "w") as f:
            json.dump({"owner": "raylm train", "host": socket.gethostname(), "pid": os.getpid(),
                       "heartbeat": now - heartbeat_age_s}, f)
    return run


def test_a_running_run_shows_its_holder_progress_eta_checkpoint_and_last_events(saved_run, tmp_path):
    run = _run_with_records(saved_run, tmp_path)
    shown = run_cli("status", run)  # a fresh interpreter: no Ray, nothing but the directory
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"{run}: running (held by raylm train (host {socket.gethostname()}, pid {os.getpid()}")
    assert lines[1] == "step 6/10, loss 2.4000, val loss 2.5000 at step 4"
    assert lines[2] == "1,000 tokens/s, eta 0m08s"  # 2 s a step, 4 steps to go
    assert lines[3] == f"newest complete checkpoint: {run}/checkpoint_00000004"
    assert lines[4] == "last events:"
    assert lines[5].startswith("  failure ") and "cause=worker died" in lines[5]
    assert lines[6].startswith("  resumed ") and lines[6].endswith(": from_step=4, seconds=6.074")
    assert len(lines) == 7  # the profile event is not shown


def test_a_stale_lease_is_a_stopped_run_that_names_how_to_go_on(saved_run, tmp_path):
    run = _run_with_records(saved_run, tmp_path, heartbeat_age_s=1000)
    out = run_main("status", run).stdout
    assert out.startswith(f"{run}: stopped (a stale lease: its last heartbeat is 1000 s old "
                          f"(run.lease_timeout_s=120); the same command resumes from {run}/checkpoint_00000004)")
    assert "eta" not in out  # nothing runs: no ETA


def test_a_run_whose_last_checkpoint_is_at_train_steps_is_finished(saved_run, tmp_path):
    run = _run_with_records(saved_run, tmp_path, steps=4, heartbeat_age_s=None)
    assert run_main("status", run).stdout.startswith(
        f"{run}: finished (its checkpoint at step 4 is the last of train.steps=4)")


def test_a_run_stopped_at_its_stop_at_step_says_how_it_goes_on(saved_run, tmp_path):
    """It said "stopped (the same command resumes ...)": the same command, stop_at_step and all,
    trains nothing more."""
    run = _run_with_records(saved_run, tmp_path, steps=10, heartbeat_age_s=None)
    with open(os.path.join(run, "config.yaml"), "w") as f:
        f.write("train:\n  steps: 10\n  stop_at_step: 4\nrun:\n  lease_timeout_s: 120\n")
    assert run_main("status", run).stdout.startswith(
        f"{run}: stopped at train.stop_at_step (its checkpoint at step 4 is train.stop_at_step=4 of train.steps=10; "
        f"the same command with a later train.stop_at_step, or none, resumes from {run}/checkpoint_00000004)")


def test_a_run_directory_without_records_and_a_missing_one(tmp_path):
    assert run_main("status", str(tmp_path)).stdout.startswith(f"{tmp_path}: not started (no step written yet)")
    missing = run_main("status", str(tmp_path / "nope"))
    assert missing.status == 2 and missing.stderr == f"raylm: error: {tmp_path / 'nope'} does not exist\n"


def test_a_directory_that_is_not_a_run_is_refused_naming_the_runs_in_it(saved_run, tmp_path):
    """`raylm status runs` for `raylm status runs/demo`: it said "not started", exit 0, of any
    directory without a run's files (a dataset's, /tmp), and `--watch` said so for ever."""
    runs = tmp_path / "runs"
    (runs / "data").mkdir(parents=True)
    (runs / "data" / "manifest.json").write_text("{}")
    first = _run_with_records(saved_run, tmp_path)
    shutil.move(first, runs / "demo")
    for name in ("data", ""):
        shown = run_main("status", str(runs / name))
        assert shown.status == 2 and shown.stdout == "", shown.stdout
        assert shown.stderr == (f"raylm: error: {runs / name} holds no run (no config.yaml, metrics.jsonl, lease or "
                                "checkpoint)" + ("" if name else f"; the runs in it: {runs / 'demo'}") + "\n")
    watched = run_main("status", str(runs), "--watch", "--every", "30")
    assert watched.status == 2 and "holds no run" in watched.stderr
    assert run_main("status", str(runs / "demo")).stdout.startswith(f"{runs / 'demo'}: running")


def test_a_sweeps_directory_names_its_trials_and_a_finished_trial_is_finished(tmp_path):
    """`raylm status` of a sweep's directory said "holds no run"; of a finished trial, "stopped (the
    same command resumes from ...)": a trial's steps are the sweep's, in no config.yaml of its own."""
    sweep, trial = tmp_path / "sweep", tmp_path / "sweep" / "trials" / "ladder-000-abc123"
    trial.mkdir(parents=True)
    (sweep / "sweep.yaml").write_text("sweep: {}\n")
    (trial / "metrics.jsonl").write_text('{"step": 5, "loss": 2.5, "val_loss": 2.6}\n')
    shown = run_main("status", str(sweep))
    assert shown.status == 2 and shown.stderr == (
        f"raylm: error: {sweep} is a sweep's directory, not a run's: each trial is a run in {sweep / 'trials'} "
        f"(raylm status {sweep / 'trials' / 'TRIAL_ID'}); the sweep's results are its trials.csv and fit.json "
        f"(raylm sweep --refit {sweep})\n")
    assert run_main("status", str(trial)).stdout.startswith(f"{trial}: stopped")  # its sweep resumes it
    (trial / "final.json").write_text('{"val_loss": 2.6, "step": 5}')
    assert run_main("status", str(trial)).stdout.startswith(f"{trial}: finished (a sweep's trial: its result is "
                                                            "final.json)\nstep 5, loss 2.5000")


def test_watch_shows_it_again_until_ctrl_c(saved_run, tmp_path):
    run = _run_with_records(saved_run, tmp_path)
    outcome = run_on_terminal("status", run, "--watch", "--every", "0.2", timeout_s=120,
                              interrupt_when=lambda text: text.count("newest complete checkpoint") >= 2)
    assert outcome.status == 0, outcome.output
    assert outcome.output.count("\x1b[H\x1b[2J") >= 2  # each time in place of the last
    assert "Traceback" not in outcome.output


def test_watch_ends_once_the_run_has_finished(saved_run, tmp_path):
    # A finished run changes no more: `raylm status RUN --watch && next-step` waits for it.
    run = _run_with_records(saved_run, tmp_path, steps=4, heartbeat_age_s=None)
    shown = subprocess.run([sys.executable, "-m", "raylm.cli", "status", run, "--watch", "--every", "30"],
                           capture_output=True, text=True, timeout=25)  # before a second refresh
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count(f"{run}: finished") == 1
