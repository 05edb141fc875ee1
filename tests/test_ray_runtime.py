"""raylm's Ray token: created once per user, private, never handed around in the clear; and
when raylm joins a cluster rather than starting one. (Auth against real Rays: the local
cluster's tests refuse a client without the token; every Ray of the suite runs with it.)"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from raylm.ports import free_ports
from raylm import ray_runtime
from raylm.ray_runtime import RayJoinError, ensure_auth_token, joins_cluster
from tests.support.processes import session_processes


@pytest.fixture
def token_path(tmp_path, monkeypatch):
    path = tmp_path / "home" / ".ray" / "auth_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    return path


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_token_is_created_once_private_and_never_returned(token_path):
    env = ensure_auth_token()
    token = token_path.read_text()
    assert len(token) == 64 and int(token, 16)  # 256 random bits, as `ray get-auth-token --generate`
    assert (mode(token_path), mode(token_path.parent)) == (0o600, 0o700)
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    ensure_auth_token()
    assert token_path.read_text() == token  # once per user: later calls reuse it
    assert [p.name for p in token_path.parent.iterdir()] == ["auth_token"]  # no temporary file left


def test_a_token_file_readable_by_others_is_made_private(token_path):
    token_path.parent.mkdir(parents=True)
    token_path.write_text("a" * 64)
    token_path.chmod(0o644)  # as a default umask leaves a file Ray wrote itself
    ensure_auth_token()
    assert mode(token_path) == 0o600 and token_path.read_text() == "a" * 64


def test_explicit_settings_are_the_users(token_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "b" * 64)
    assert ensure_auth_token()["RAY_AUTH_MODE"] == "token"
    assert not token_path.exists()  # the token in the environment is used as it is
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # e.g. to reach an old cluster without auth
    assert ensure_auth_token() == {"RAY_AUTH_MODE": "disabled"}


def test_joins_the_cluster_rays_conventions_name(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not joins_cluster(None) and not joins_cluster("local")
    assert joins_cluster("auto") and joins_cluster("127.0.0.2:6379")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.2:6379")  # exported, or set for a job's entry point
    assert joins_cluster(None) and not joins_cluster("local")


IGNORING_CTRL_C_START = """
import signal, time
from raylm.ray_runtime import start_ray

signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's `cmd &` starts a command
assert start_ray("local", 1)
print("started at", time.monotonic(), signal.getsignal(signal.SIGINT) == signal.SIG_IGN)
"""


def test_a_process_that_ignores_ctrl_c_starts_its_ray_through_two(tmp_path):
    """Two Ctrl-Cs while the local Ray starts, to a process that ignores SIGINT: the second, held
    as a Ctrl-C that insists, ended the start with KeyboardInterrupt."""
    with subprocess.Popen([sys.executable, "-c", IGNORING_CTRL_C_START], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env={**os.environ, "RAY_ADDRESS": ""}) as proc:
        deadline = time.monotonic() + 120
        while not any(name == "gcs_server" for _, name, _ in session_processes(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        for _ in range(2):  # apart: Python runs a handler once for signals that come before it runs
            proc.send_signal(signal.SIGINT)
            sent = time.monotonic()
            time.sleep(0.2)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    _, started, still_ignored = out.split()[-3:]
    assert sent < float(started) and still_ignored == "True", out  # both during the start; ignored after it


def test_a_local_rays_workers_run_at_normal_priority(ray_session):
    # Ray's default niceness 15 made a local run's training workers yield to every other
    # process on the machine (a plain PyTorch loop does not).
    @ray_session.remote
    def niceness() -> int:
        return os.nice(0)

    assert ray_session.get(niceness.remote()) == 0


def test_a_local_ray_that_misses_its_start_up_deadline_is_one_line_and_leaves_nothing(tmp_path):
    """A local Ray starting under load missed Ray's deadline for its GCS and the command ended in
    Ray's raw traceback. Ray's own setting for that deadline, at 0 s, makes every start miss it."""
    text = tmp_path / "a.txt"
    text.write_text("The king rode to the castle by the river.\n" * 20)
    output = tmp_path / "data"
    env = {**os.environ, "RAY_gcs_server_port_wait_time_s": "0", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    with subprocess.Popen([sys.executable, "-m", "raylm.cli", "prepare", "--input", str(text), "--output", str(output),
                           "--seq-len", "16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            left = session_processes(proc.pid)
            for pid, _, _ in left:
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert err.startswith("raylm: error: the local Ray did not start (Timed out waiting for file "), err[-3000:]
    assert "Traceback" not in err and "run the command again once the load drops" in err
    assert not left and not output.exists()


TINY_RUN = ("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32", "train.steps=4",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0", "schedule.warmup_steps=1",
            "parallel.num_workers=1", "train.tensorboard=false")


def test_a_join_where_no_ray_answers_is_refused_at_once_naming_the_address(tiny_dataset, tmp_path):
    """Ray's own join retried for about 13 minutes, printing only its connection warnings, and the
    SIGTERM that could have stopped it was held until the join ended."""
    (port,) = free_ports(1)
    train = [sys.executable, "-m", "raylm.cli", "train", f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}",
             "run.name=nowhere", *TINY_RUN]
    for extra, env, named in (([f"run.ray_address=127.0.0.2:{port}"], {}, f"run.ray_address=127.0.0.2:{port}"),
                              ([], {"RAY_ADDRESS": f"127.0.0.1:{port}"}, f"RAY_ADDRESS=127.0.0.1:{port}")):
        started = time.monotonic()
        done = subprocess.run([*train, *extra], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env})
        assert done.returncode == 1, done.stderr[-3000:]
        assert f"raylm: error: no Ray answers at {named} (Connection refused)" in done.stderr, done.stderr[-3000:]
        assert "Traceback" not in done.stderr and time.monotonic() - started < 60


def refused_at_once(address: str, source: str, error: str) -> None:
    """`check_answers` refuses `address` from `source` with an error matching `error`, within 10 s."""
    started = time.monotonic()
    with pytest.raises(RayJoinError, match=error):
        ray_runtime.check_answers(address, source)
    assert time.monotonic() - started < 10


def test_a_join_where_something_else_listens_or_nothing_answers_is_refused_naming_what_it_met(monkeypatch):
    """Ray's GCS speaks gRPC: a port where something else listens (the dashboard's 8265, which
    `ray job submit` takes, given as the cluster's address) or where the connection is accepted
    and nothing answers (a hung head) had Ray retry for about 13 minutes, the SIGTERM held."""
    server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    mute = socket.create_server(("127.0.0.2", 0))  # listens, so the kernel accepts; never reads nor answers
    monkeypatch.setattr(ray_runtime, "HANDSHAKE_S", 1.0)
    try:
        web = f"127.0.0.2:{server.server_address[1]}"
        with pytest.raises(RayJoinError, match=rf"^no Ray answers at run.ray_address={web}: what listens there is not a "
                                               r"Ray GCS \(it answered '<!DOCTYPE HTML>', not gRPC's handshake\).*\(8265 is the "
                                               r"dashboard's, for `ray job submit"):
            ray_runtime.check_answers(web, "run.ray_address")
        hung = f"127.0.0.2:{mute.getsockname()[1]}"
        refused_at_once(hung, "RAY_ADDRESS", rf"^no Ray answers at RAY_ADDRESS={hung}: the connection was accepted, "
                                             r"but nothing answered within 1 s \(a Ray head that hangs")
    finally:
        server.shutdown()
        mute.close()


def test_a_join_where_the_gcs_takes_the_handshake_but_answers_no_request_is_refused_naming_it(ray_session,
                                                                                             monkeypatch):
    """A head whose GCS takes gRPC's handshake and then hangs: Ray's join asked it for the cluster
    id 20 times, 30 s each, with the SIGTERM held: `raylm train` said nothing for 10.5 minutes. A
    real gRPC server whose handlers never return is that GCS; a real one answers the same request
    at once (refused: the request carries no token, and the suite's Rays require one)."""
    import grpc
    from concurrent import futures

    release = threading.Event()

    class Hangs(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(lambda request, context: release.wait(60) and b"")

    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[Hangs()])
    hung = f"127.0.0.2:{server.add_insecure_port('127.0.0.2:0')}"
    server.start()
    monkeypatch.setattr(ray_runtime, "GCS_ANSWER_S", 1.0)
    try:
        refused_at_once(hung, "run.ray_address", rf"^no Ray answers at run.ray_address={hung}: its GCS answered gRPC's "
                                                 r"handshake, but not a request within 1 s \(a Ray head that hangs\)$")
    finally:
        release.set()
        server.stop(None)
    started = time.monotonic()
    ray_runtime.check_answers(ray_session.get_runtime_context().gcs_address, "RAY_ADDRESS")
    assert time.monotonic() - started < 1


def test_a_job_servers_url_as_the_ray_to_join_is_refused_naming_it(tiny_dataset, tmp_path):
    """The dashboard's URL (`ray job submit`'s) given as the Ray to join: in the config, a config
    error before anything starts; in RAY_ADDRESS, Ray's own explanation, without the traceback
    that printed it before (as for "auto" with no Ray on the machine, or an unreachable ray://)."""
    train = [sys.executable, "-m", "raylm.cli", "train", f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}",
             "run.name=web", *TINY_RUN]
    configured = subprocess.run([*train, "run.ray_address=http://127.0.0.2:8265"], capture_output=True, text=True,
                                timeout=120)
    assert configured.returncode == 2, configured.stderr[-3000:]
    assert configured.stderr.startswith("raylm: error: run.ray_address=http://127.0.0.2:8265 is a job server's "
                                        "address (the dashboard's, for `raylm submit --address`"), configured.stderr
    exported = subprocess.run(train, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RAY_ADDRESS": "http://127.0.0.2:8265"})
    assert exported.returncode == 1, exported.stderr[-3000:]
    assert ("raylm: error: cannot join the Ray at RAY_ADDRESS=http://127.0.0.2:8265: Invalid Ray address: "
            "'http://127.0.0.2:8265'. It looks like you set RAY_ADDRESS to an HTTP address") in exported.stderr
    assert "Traceback" not in configured.stderr + exported.stderr


def test_a_ray_on_127_0_0_1_is_joined_without_rays_loopback_variable(ray_session, tiny_dataset, tmp_path):
    """A single-node Ray on loopback (raylm's own, or `ray start --head` as FIELD-NOTES start one),
    joined from a shell that lacks RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray rewrote 127.0.0.1 to
    the machine's external address, where nothing listens, and the run hung in its join."""
    address = ray_session.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    done = subprocess.run([sys.executable, "-m", "raylm.cli", "train", f"data.path={tiny_dataset}",
                           f"run.storage_path={tmp_path}", "run.name=joined", *TINY_RUN],
                          capture_output=True, text=True, timeout=180, env={**env, "RAY_ADDRESS": address})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(on a joined cluster)" in done.stdout and "done: step 4" in done.stdout, done.stdout[-3000:]
