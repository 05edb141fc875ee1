"""`raylm submit` before it submits: an address where no job server (or GCS) answers is refused
in seconds. The submissions themselves are tests/cluster/test_jobs.py's, on the local cluster."""

from __future__ import annotations

import socket
from pathlib import Path

from raylm import ray_runtime
from tests.support.cli import run_main

REPO = Path(__file__).resolve().parents[2]


def test_an_address_that_accepts_and_never_answers_is_refused_in_seconds(monkeypatch, tmp_path):
    """Ray's job client waits for the job server's first answer without a timeout: `raylm submit`
    to a port that accepted and never answered (a hung head, a forward whose far end is gone) sat
    silent until killed (90 s tried). A bare host:port, which Ray's client takes for a GCS
    address, retried for minutes."""
    mute = socket.create_server(("127.0.0.2", 0))  # listens, so the kernel accepts; never reads nor answers
    port = mute.getsockname()[1]
    monkeypatch.setattr(ray_runtime, "HANDSHAKE_S", 1.0)
    monkeypatch.chdir(REPO)  # the working directory the job would upload
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    args = ["submit", "configs/demo-cpu.yaml", f"data.path={tmp_path}/data", f"run.storage_path={tmp_path}/runs"]
    try:
        web = run_main(*args, "--address", f"http://127.0.0.2:{port}")
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.2:{port}")
        gcs = run_main(*args)
    finally:
        mute.close()
    assert web.status == 2 and web.stderr == (
        f"raylm: error: cannot reach the Ray job server at --address=http://127.0.0.2:{port}: nothing answered "
        "within 1 s (a head that hangs, or a forwarded port whose far end is gone)\n"), web.stderr
    assert gcs.status == 2 and gcs.stderr.startswith(
        f"raylm: error: no Ray answers at RAY_ADDRESS=127.0.0.2:{port}: the connection was accepted, but nothing "
        "answered within 1 s"), gcs.stderr
