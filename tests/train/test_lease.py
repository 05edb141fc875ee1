"""One writer per run directory: a second run is refused naming the holder; a lease whose holder
is gone (a stale heartbeat, a dead process on this machine, an unreadable file) is taken over with
an event; a holder that finds its lease taken stops. On local disk and on S3 (conditional writes)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from raylm.data import storage
from raylm.train.lease import LEASE_FILE, LeaseHeldError, LeaseLostError, RunLease
from raylm.train.observe.records import read_jsonl


@pytest.fixture(params=["local", "s3"])
def run_dir(request, tmp_path) -> tuple[str, object]:
    if request.param == "local":
        return str(tmp_path / "run"), None
    server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    return f"{bucket}/run", server.storage


def lease_of(uri: str, storage_cfg) -> dict:
    return json.loads(storage.read_bytes(storage.join(uri, LEASE_FILE), storage_cfg))


def test_a_second_run_is_refused_naming_the_holder_until_the_first_ends(run_dir, tmp_path):
    uri, storage_cfg = run_dir
    with RunLease(uri, storage_cfg, timeout_s=60, events_dir=str(tmp_path)):
        holder = lease_of(uri, storage_cfg)
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(LeaseHeldError, match=rf"in use by raylm train \(host {socket.gethostname()}, pid "
                                                 rf"{os.getpid()}; heartbeat \d+ s ago\)"):
            RunLease(uri, storage_cfg, timeout_s=60).acquire()
    assert not storage.exists(storage.join(uri, LEASE_FILE), storage_cfg)  # released
    with RunLease(uri, storage_cfg, timeout_s=60):  # the directory is free again
        pass


def test_a_lease_taken_in_a_ray_job_names_the_job(tmp_path, monkeypatch):
    """The lease read RAY_JOB_SUBMISSION_ID, which Ray's job supervisor never sets: a refusal
    could not name the job to stop. The supervisor gives the entrypoint its job config, whose
    metadata holds the submission id (ray/dashboard/modules/job/job_supervisor.py)."""
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(
        {"runtime_env": {}, "metadata": {"job_submission_id": "raylm-demo-3", "job_name": "raylm-demo-3"}}))
    uri = str(tmp_path / "run")
    with RunLease(uri, None, timeout_s=60):
        assert lease_of(uri, None)["ray_job"] == "raylm-demo-3"
        with pytest.raises(LeaseHeldError, match=rf"pid {os.getpid()}, Ray job raylm-demo-3; heartbeat"):
            RunLease(uri, None, timeout_s=60).acquire()


def test_the_heartbeat_keeps_the_lease_fresh(run_dir):
    uri, storage_cfg = run_dir
    with RunLease(uri, storage_cfg, timeout_s=10) as lease:  # beats every 10/6 s
        first = lease_of(uri, storage_cfg)["heartbeat"]
        time.sleep(4)
        assert lease_of(uri, storage_cfg)["heartbeat"] > first + 1 and lease.lost is None


def _write_lease(uri: str, storage_cfg, **fields) -> None:
    record = {"owner": "raylm train", "host": "another-host", "pid": 4242, "heartbeat": time.time(), **fields}
    storage.write_bytes(storage.join(uri, LEASE_FILE), json.dumps(record).encode(), storage_cfg)


def test_a_stale_lease_is_taken_over_with_an_event(run_dir, tmp_path):
    uri, storage_cfg = run_dir
    _write_lease(uri, storage_cfg, heartbeat=time.time() - 300)
    with RunLease(uri, storage_cfg, timeout_s=60, events_dir=str(tmp_path)):
        assert lease_of(uri, storage_cfg)["pid"] == os.getpid()
    (event,) = read_jsonl(str(tmp_path / "events.jsonl"))
    assert event["event"] == "lease_taken_over" and event["previous"]["host"] == "another-host"
    # The age is measured when the lease is read: 300 s, plus however long S3 took to answer.
    age = re.search(r"heartbeat is (\d+) s old \(run.lease_timeout_s=60\)", event["why"])
    assert age and 300 <= int(age.group(1)) <= 330, event["why"]


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "killed_not_yet_reaped"])
def test_a_lease_of_a_dead_process_on_this_machine_is_taken_over_at_once(run_dir, tmp_path, reaped):
    """Not yet reaped: a `kill -9` of a driver whose parent had gone, under a container's PID 1
    that reaps orphans late; the same command, run at once, takes the lease over."""
    uri, storage_cfg = run_dir
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    gone.kill()
    if reaped:
        gone.wait()
    else:  # a zombie: still answers signal 0
        deadline = time.monotonic() + 30
        while open(f"/proc/{gone.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(gone.pid, 0)
    try:
        _write_lease(uri, storage_cfg, host=socket.gethostname(), pid=gone.pid)
        with RunLease(uri, storage_cfg, timeout_s=600, events_dir=str(tmp_path)):
            pass
    finally:
        gone.wait()
    (event,) = read_jsonl(str(tmp_path / "events.jsonl"))
    assert f"its process {gone.pid} on this machine no longer runs" in event["why"]


def test_a_fresh_lease_of_a_live_process_elsewhere_is_respected(run_dir):
    uri, storage_cfg = run_dir
    _write_lease(uri, storage_cfg)
    with pytest.raises(LeaseHeldError, match="host another-host, pid 4242"):
        RunLease(uri, storage_cfg, timeout_s=600).acquire()


def test_an_unreadable_lease_is_taken_over(run_dir, tmp_path):
    uri, storage_cfg = run_dir
    storage.write_bytes(storage.join(uri, LEASE_FILE), b'{"owner": "raylm tr', storage_cfg)  # torn
    with RunLease(uri, storage_cfg, timeout_s=600, events_dir=str(tmp_path)):
        assert lease_of(uri, storage_cfg)["pid"] == os.getpid()


def test_a_holder_whose_lease_was_taken_stops(run_dir, tmp_path):
    uri, storage_cfg = run_dir
    lease = RunLease(uri, storage_cfg, timeout_s=10, events_dir=str(tmp_path))
    deadline = time.monotonic() + 10
    # The heartbeat interrupts the main thread (a KeyboardInterrupt, or Ray's own abort where a
    # trainer installed its handler); leaving the lease's block then says why the run stops.
    with pytest.raises(LeaseLostError, match="another run took over this run directory's lease"):
        with lease:
            _write_lease(uri, storage_cfg)  # another run took the directory over
            while lease.lost is None and time.monotonic() < deadline:
                time.sleep(0.1)
    assert lease_of(uri, storage_cfg)["host"] == "another-host"  # the new holder's lease is left alone
    assert [e["event"] for e in read_jsonl(str(tmp_path / "events.jsonl"))] == ["lease_lost"]


def test_a_lease_that_storage_cannot_remove_at_the_end_leaves_the_runs_outcome_alone(s3_server, tmp_path, capsys):
    """Storage out of reach when the run ends: the lease is left with a warning (the next run takes
    it over as stale). The failed read raised, and its error replaced the run's own: the last line
    of a run that a storage outage stopped named the lease, not the checkpoint."""
    from cluster.seaweedfs import SeaweedFS
    from raylm.config import StorageConfig

    server = SeaweedFS(access_key=s3_server.server.access_key, secret_key=s3_server.server.secret_key).start()
    try:
        storage_cfg = StorageConfig(endpoint_url=server.endpoint_url)
        storage.ensure_bucket("s3://lease-outage", storage_cfg)
        with pytest.raises(KeyError, match="the run's own error"):
            with RunLease("s3://lease-outage/run", storage_cfg, timeout_s=60, events_dir=str(tmp_path)):
                server._kill()
                raise KeyError("the run's own error")
    finally:
        server.stop()
    said = capsys.readouterr().err
    assert "raylm: warning: the lease s3://lease-outage/run/run.lease could not be removed" in said, said
    assert "takes it over as stale" in said


def test_storage_out_of_reach_at_the_start_is_the_one_error_said(tmp_path, capsys):
    """Nothing listens at the endpoint: taking the lease fails naming it, and no warning about a
    lease that was never written comes before that error."""
    from raylm.config import StorageConfig
    from raylm.ports import free_ports

    closed = free_ports(1)[0]
    with pytest.raises(storage.StorageError, match=f"127.0.0.1:{closed}"):
        with RunLease("s3://nowhere/run", StorageConfig(endpoint_url=f"http://127.0.0.1:{closed}"), timeout_s=60,
                      events_dir=str(tmp_path)):
            pass
    said = capsys.readouterr().err
    assert "could not be removed" not in said, said
