"""`raylm train` run again once its run has reached train.steps: the driver says so and exits 0,
without starting Ray and without writing an event; a raised train.steps, or a damaged newest
checkpoint (which the workers pass over to an older one), is a resume as before."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from raylm.config import load_config
from raylm.data import storage
from raylm.launch import driver
from raylm.train.lease import LEASE_FILE
from raylm.train.loop import train_local
from raylm.train.observe.records import EVENTS_FILE
from raylm.train.spec import local_run_dir

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = ("run.name=done", "data.chunk_rows=8", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
       "model.max_seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
       "train.tensorboard=false", "schedule.warmup_steps=1", "checkpoint.every_steps=2", "parallel.num_workers=1")


@pytest.fixture(scope="module")
def finished(tiny_dataset, tmp_path_factory) -> str:
    """A run trained in this process to its train.steps=4, checkpoints at steps 2 and 4."""
    run_dir = str(tmp_path_factory.mktemp("finished") / "done")
    train_local(load_config(None, [f"data.path={tiny_dataset}", "data.loader=local", *RUN, "train.steps=4"]), run_dir)
    return run_dir


def events(uri: str, storage_cfg) -> bytes:
    path = storage.join(uri, EVENTS_FILE)
    return storage.read_bytes(path, storage_cfg) if storage.exists(path, storage_cfg) else b""


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_finished_run_run_again_says_so_and_exits_without_ray_or_an_event(finished, tiny_dataset, tmp_path,
                                                                          request, where):
    storage_path, storage_cfg, extra = str(tmp_path / "runs"), None, []
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        storage_path, storage_cfg = request.getfixturevalue("s3_bucket") + "/runs", server.storage
        extra = [f"storage.endpoint_url={server.endpoint_url}"]
    run = storage.join(storage_path, "done")
    storage.copy_dir(finished, run, storage_cfg)
    args = [f"data.path={tiny_dataset}", f"run.storage_path={storage_path}", *RUN, "train.steps=4", *extra]
    mirror = local_run_dir(load_config(None, args))  # the driver's events.jsonl for a run on S3
    before = events(run, storage_cfg), events(mirror, None)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "raylm.cli", "train", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (f"raylm: run done already finished: {run}/checkpoint_00000004 is at step 4 of train.steps=4; "
            "nothing to train") in out.stdout.splitlines()
    assert "Ray instance" not in out.stdout + out.stderr and "resum" not in out.stdout + out.stderr
    assert (events(run, storage_cfg), events(mirror, None)) == before  # no `resumed` for `raylm report` to count
    assert not storage.exists(storage.join(run, LEASE_FILE), storage_cfg)  # taken, then released
    print(f"exited {time.monotonic() - started:.1f} s after the command")


class Trains(Exception):
    """Raised where the driver would start Ray: the run goes on to train."""


@pytest.mark.parametrize("case", ["train.steps raised", "the newest checkpoint damaged"])
def test_a_run_with_steps_left_or_a_damaged_newest_checkpoint_resumes(finished, tiny_dataset, tmp_path, monkeypatch,
                                                                     capsys, case):
    run = shutil.copytree(finished, tmp_path / "done")
    newest, steps = run / "checkpoint_00000004", 6
    if case == "the newest checkpoint damaged":  # one byte flipped: only its checksum tells
        shard = next(newest.glob("*.distcp"))
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
        steps = 4

    def start_ray(*args, **kwargs):
        raise Trains()
    monkeypatch.setattr(driver, "start_ray", start_ray)
    with pytest.raises(Trains):
        driver.launch(load_config(None, [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", *RUN,
                                         f"train.steps={steps}"]))
    said = capsys.readouterr().out
    assert f"raylm: resuming from {newest} if its files pass their checksums" in said and "finished" not in said


def test_a_run_already_at_its_stop_at_step_says_so_without_ray(finished, tiny_dataset, tmp_path, monkeypatch, capsys):
    """A stopped run's command run again (train.stop_at_step at its newest checkpoint) trains nothing either."""
    shutil.copytree(finished, tmp_path / "done")

    def start_ray(*args, **kwargs):
        raise Trains()
    monkeypatch.setattr(driver, "start_ray", start_ray)
    assert driver.launch(load_config(None, [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", *RUN,
                                            "train.steps=8", "train.stop_at_step=4"])) == {}
    assert (f"raylm: run done already stopped where asked: {tmp_path / 'done' / 'checkpoint_00000004'} is at step 4 "
            "of train.stop_at_step=4; nothing to train") in capsys.readouterr().out.splitlines()
