"""The run's console kept in its directory (console.log, rotated), and for a run on S3 copied
there beside its records: a job submitted with `ray job submit` leaves its story with its
checkpoints; `raylm status` reads the run where it lies."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from raylm.config import load_config
from raylm.data import storage
from raylm.launch import console as console_module
from raylm.launch.console import CONSOLE_FILE, kept_console
from raylm.train.spec import local_run_dir
from tests.support.cli import run_storage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = ("run.name=told", "data.chunk_rows=8", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
       "model.max_seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
       "train.tensorboard=false", "schedule.warmup_steps=1", "checkpoint.every_steps=2", "parallel.num_workers=1",
       "train.steps=4", "train.log_every=2")


def test_lines_are_held_until_the_run_trains_then_kept_and_rotated(tmp_path, monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(console_module, "CONSOLE_MAX_BYTES", 200)
    with kept_console() as console:
        print("raylm: checked")
        sys.stderr.write("raylm: warning: a partial ")
        sys.stderr.write("line, then its end\n")
        assert not os.path.exists(tmp_path / CONSOLE_FILE)  # a run refused here leaves no file
        console.keep_in(str(tmp_path))
        for step in range(10):
            print(f"step {step:>6}/10 | loss 1.0")
    assert sys.stdout is out and out.getvalue().startswith("raylm: checked\nstep      0/10")  # shown as before
    assert err.getvalue() == "raylm: warning: a partial line, then its end\n"
    kept = "".join((tmp_path / name).read_text() for name in (f"{CONSOLE_FILE}.3", f"{CONSOLE_FILE}.2",
                                                               f"{CONSOLE_FILE}.1", CONSOLE_FILE)
                   if (tmp_path / name).exists())
    assert kept.endswith("".join(f"step {step:>6}/10 | loss 1.0\n" for step in range(5, 10)))
    assert (tmp_path / f"{CONSOLE_FILE}.1").exists() and not (tmp_path / f"{CONSOLE_FILE}.4").exists()


@pytest.mark.slow
def test_raylm_train_leaves_its_console_beside_its_checkpoints(tiny_dataset, tmp_path, request):
    # A run on S3 shows both halves: the console kept in the run's local directory, as a local
    # run keeps it, and copied to S3 beside the run's records. `raylm status` of a local run:
    # tests/test_status.py.
    storage_path, storage_cfg, extra = run_storage(request, "s3", tmp_path)
    args = [f"data.path={tiny_dataset}", f"run.storage_path={storage_path}", *RUN, *extra]
    done = subprocess.run([sys.executable, "-m", "raylm.cli", "train", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = storage.join(storage_path, "told")
    kept = storage.read_bytes(storage.join(run, CONSOLE_FILE), storage_cfg).decode()
    assert "raylm: parallel.cpus_per_worker=auto" in kept  # held from the start of the command
    # A warning on stderr is kept as well: this run's 4-row batches read chunks of 8 rows.
    warning = "raylm: warning: data.chunk_rows=8 is more than a global batch (4 rows): 2 steps in a row train on"
    assert warning in done.stderr and warning in kept
    assert "step      4/4 | loss" in kept  # the workers' lines, relayed by Ray
    assert kept.endswith(done.stdout.splitlines()[-1] + "\n") and kept.splitlines()[-1].startswith("done: step 4, ")
    assert kept == open(os.path.join(local_run_dir(load_config(None, args)), CONSOLE_FILE)).read()
    # And `raylm status` of the run, where it lies, without Ray.
    server = request.getfixturevalue("s3_server")
    shown = subprocess.run([sys.executable, "-m", "raylm.cli", "status", run, "--endpoint-url", server.endpoint_url],
                           capture_output=True, text=True, timeout=120, env={**os.environ, **server.env})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"{run}: finished (its checkpoint at step 4 is the last of train.steps=4)\nstep 4/4")
