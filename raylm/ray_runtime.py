"""The one way raylm gets a Ray, always with Ray's token authentication on.

- Join the cluster that Ray's own conventions name: an explicit address, else RAY_ADDRESS.
  A Ray job's entrypoint has RAY_ADDRESS set by the job supervisor (Ray documents that
  `ray.init()` inside a job connects to the job's cluster), so `raylm train` inside
  `ray job submit`, or with RAY_ADDRESS exported, joins instead of starting a Ray.
- Otherwise (or with address "local") start a single-node Ray listening on loopback only.

The token: Ray reads it from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH, else
~/.ray/auth_token. raylm creates that file once per user, private (0600), and turns token mode
on in its environment, which every process it starts (Ray's daemons, workers, `ray start`
nodes, job drivers) inherits; later `raylm` and `ray` commands read the same file.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from raylm.ports import free_ports

# Usage stats would phone home. Ray starts its workers at niceness 15, which makes a local run's
# training yield to every other process on the machine; the training is the user's foreground
# work, as Ray's job server decides too. Ray Train's controller polls its workers every 2 s, which
# delays a run's end by up to 2 s; polling the few workers of one machine 4 times a second costs
# nothing. Its preemption watcher (a process polling for nodes an autoscaler drains) has nothing
# to watch on one machine. The raylet prestarts one worker process per CPU when the driver
# connects, for tasks; a run's actors (Train's controller and workers, each with its own
# environment) never use them, and starting them takes the CPU a small machine's run needs.
# Ray's log monitor lists its node's log directory ten times a second until it holds 1000 files:
# 3% of a core on a node of the local cluster that had run 250 worker processes, 0.3% at its
# pace beyond them (once every 0.5 s, the most a new worker's first lines then wait).
LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0",
                 "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
                 "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0",
                 "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def auth_token_path() -> Path:
    """Where Ray looks for the token file: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def ensure_auth_token() -> dict[str, str]:
    """Turn Ray's token authentication on for this process and the processes it starts, with
    this user's token; returns the variables that say so (never the token itself).

    An explicit RAY_AUTH_MODE (e.g. "disabled" to reach an old cluster without auth) is the
    user's choice and is kept. A token given in RAY_AUTH_TOKEN is used as it is. Otherwise the
    token file is created if missing (0600 in a 0700 directory) and tightened to 0600 if Ray
    or a user left it readable by others."""
    if os.environ.get(AUTH_MODE_ENV, "token") != "token":
        return {AUTH_MODE_ENV: os.environ[AUTH_MODE_ENV]}
    env = {AUTH_MODE_ENV: "token"}
    if "RAY_AUTH_TOKEN_PATH" in os.environ:
        env["RAY_AUTH_TOKEN_PATH"] = os.environ["RAY_AUTH_TOKEN_PATH"]
    if not os.environ.get("RAY_AUTH_TOKEN"):
        _create_token_file(auth_token_path())
    if os.environ.get(AUTH_MODE_ENV) != "token":
        os.environ[AUTH_MODE_ENV] = "token"
        _refresh_ray_auth_config()
    return env


def _create_token_file(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        if path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
            path.chmod(0o600)
        return
    # Written whole under another name, then linked into place: a concurrent raylm or Ray
    # process sees no file or the complete token (Ray aborts on an empty one), and of two
    # racing creators one wins and both use its token.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".auth_token-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` makes: 256 bits
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def _refresh_ray_auth_config() -> None:
    """Ray caches its settings and token per process when ray._raylet is imported: reload them
    so that a change of mode made after that import takes effect here too."""
    if "ray._raylet" not in sys.modules:
        return
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def use_loopback() -> None:
    """Make a Ray started from this process bind every server to 127.0.0.1, with token auth.

    Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import, to decide whether the node
    advertises a routable address; the environment covers the processes Ray spawns, and the
    module constant this process, where Ray is usually imported already.
    """
    ensure_auth_token()
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    _keep_loopback_addresses()


def _keep_loopback_addresses() -> None:
    """Keep 127.0.0.1 as it is in the addresses Ray advertises and dials from this process."""
    import ray._private.ray_constants as ray_constants

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False")


def in_ray_job() -> bool:
    """Whether this process is a Ray job's entrypoint (the job supervisor gives it its job config)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


class RayJoinError(RuntimeError):
    """No Ray answers at the address of the Ray a command was told to join. Ray's own join
    would retry for about 13 minutes, printing only its connection warnings, with the SIGTERM
    that could stop it held until the join ends (`_signals_held_while_starting`)."""


JOIN_PROBE_S = 5.0
# A GCS under load still answers the handshake from its I/O thread within milliseconds; the wait
# is for a head whose machine is swapping, not for a GCS that is busy.
HANDSHAKE_S = 10.0
# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS)
# answers with a SETTINGS frame of its own (frame type 4, the fourth byte of its 9-byte header).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4
# Ray's join then asks the GCS for its cluster id, 30 s an attempt, 20 attempts, a SIGTERM held
# throughout: so the same request is made here once, with one attempt's deadline. A GCS that
# answers it in any way serves requests (one that requires a token refuses this request, which
# carries none, at once).
GCS_ANSWER_S = 30.0
_CLUSTER_ID_RPC = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def check_answers(given: str, source: str, local_start: Optional[str] = "run.ray_address") -> None:
    """Refuse, naming where the address came from (`source`), a `host:port` Ray address where no
    Ray GCS answers: nothing accepts a connection within JOIN_PROBE_S (a mistyped port, a cluster
    that is down), what accepts it does not answer gRPC's handshake within HANDSHAKE_S (another
    server's port, such as the dashboard's, or a head that hangs), or the GCS that answers it does
    not answer a request within GCS_ANSWER_S (a head that hangs). Keep 127.0.0.1 and localhost as
    they are: Ray would dial the machine's external address instead, where a single-node Ray on
    loopback (raylm's, FIELD-NOTES') does not listen.
    "auto", ray:// and the like are Ray's. `local_start`: the setting that would start a Ray here
    instead, named in the error (None: the command has none)."""
    host, _, port = given.rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    if not host or not port.isdigit() or "/" in host:
        return
    if host in ("127.0.0.1", "localhost", "::1"):
        _keep_loopback_addresses()
    where = f"no Ray answers at {source}={given}"
    deadline = time.monotonic() + JOIN_PROBE_S
    while True:
        try:
            connection = socket.create_connection((host, int(port)), timeout=1.0)
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                hint = f" ({local_start}=local starts a Ray here)" if local_start else ""
                raise RayJoinError(f"{where} ({e.strerror or e}): start the cluster first, or correct the "
                                   f"address{hint}") from None
            time.sleep(0.5)
    with connection:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return  # the GCS speaks TLS first: Ray's own join checks it
        answer = b""
        try:
            connection.settimeout(HANDSHAKE_S)
            connection.sendall(_H2_PREFACE)
            while len(answer) < 9 and (chunk := connection.recv(64)):
                answer += chunk
        except socket.timeout:
            raise RayJoinError(f"{where}: the connection was accepted, but nothing answered within {HANDSHAKE_S:.0f} "
                               "s (a Ray head that hangs, or a port that is not a Ray GCS's)") from None
        except OSError as e:  # reset: what listens there took the handshake for garbage
            answer = f"<{e.strerror or e}>".encode()
    if len(answer) < 9 or answer[3] != _H2_SETTINGS:
        shown = answer.strip().split(b"\n")[0].strip()[:40].decode("ascii", "replace") if answer else "<closed at once>"
        raise RayJoinError(f"{where}: what listens there is not a Ray GCS (it answered {shown!r}, not gRPC's "
                           "handshake): give the head's GCS address, port 6379 unless `ray start --port` chose another "
                           "(8265 is the dashboard's, for `ray job submit --address http://HEAD:8265`)")
    if not _gcs_answers(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", GCS_ANSWER_S):
        raise RayJoinError(f"{where}: its GCS answered gRPC's handshake, but not a request within {GCS_ANSWER_S:.0f} s "
                           "(a Ray head that hangs)")


def _gcs_answers(target: str, timeout_s: float) -> bool:
    """Whether the gRPC server at `target` answers Ray's cluster-id request within `timeout_s`."""
    import grpc

    # No proxy: a proxy from the environment would answer for a head it cannot reach.
    with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as channel:
        request = channel.unary_unary(_CLUSTER_ID_RPC)
        try:
            request(b"", timeout=timeout_s)
        except grpc.RpcError as e:
            return e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
    return True


class RayStartError(RuntimeError):
    """The local Ray did not start: its daemons missed Ray's start-up deadlines (a machine under
    load: Ray waits 30 s for its GCS and its raylet) or failed. Not the user's input, and no fault
    of a run: the same command may start it once the load drops (exit status 1)."""

    def __init__(self, cause: BaseException):
        first = " ".join(str(cause).split())[:300] or type(cause).__name__
        super().__init__(f"the local Ray did not start ({first}); its logs are under "
                         f"{os.path.join(tempfile.gettempdir(), 'ray', 'session_latest', 'logs')}. On a loaded machine "
                         "its daemons can miss Ray's start-up deadlines: run the command again once the load drops, or "
                         "start Ray yourself (ray start --head) and give its address (run.ray_address, --ray-address)")


def joins_cluster(address: Optional[str] = None) -> bool:
    """Whether `start_ray(address)` joins a running cluster rather than starting one."""
    if address == "local":
        return False
    return address is not None or bool(os.environ.get("RAY_ADDRESS"))


def start_ray(address: Optional[str] = None, num_cpus: Optional[int] = None, worker_threads: int = 1,
              dashboard: bool = False, address_name: str = "run.ray_address") -> bool:
    """Join the Ray at `address` (None: RAY_ADDRESS when set, as inside a Ray job), or start a
    local one (loopback only) with `num_cpus` logical CPUs whose workers run `worker_threads`
    OpenMP threads, and Ray's dashboard only if `dashboard`; "local" always starts one. A joined
    cluster's size and dashboard are its own: the other arguments apply only to a Ray started here
    (why the dashboard is off by default: `run.dashboard`). Returns whether it started a Ray, one
    that lives only as long as this process. `address_name` is what an error calls `address`
    (the config's field, or a command's --ray-address)."""
    import ray

    if ray.is_initialized():
        return False
    ensure_auth_token()
    if joins_cluster(address):
        given, source = (address, address_name) if address is not None else (os.environ["RAY_ADDRESS"],
                                                                                   "RAY_ADDRESS")
        check_answers(given, source, address_name)
        try:
            with _signals_held_while_starting():
                ray.init(address=address)  # None: Ray reads RAY_ADDRESS
        except (ConnectionError, ValueError) as e:  # "auto" with no Ray here, ray:// unreachable, an http:// URL
            raise RayJoinError(f"cannot join the Ray at {source}={given}: {' '.join(str(e).split())[:400]}") from None
        return False
    use_loopback()
    env_vars = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(worker_threads))}
    dashboard_options = {}
    if dashboard:
        (port,) = free_ports(1)
        dashboard_options = {"dashboard_host": "127.0.0.1", "dashboard_port": port}
        # Ray Train's placement-group cleaner finds the State API by looking for the one local
        # Ray, and fails beside another (a sweep and a run on one machine): it is told this one's.
        env_vars["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    # "local", not None: a RAY_ADDRESS in the environment must not turn this start into a join.
    try:
        with _daemons_in_a_process_group_of_their_own(), _signals_held_while_starting():
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=dashboard,
                     runtime_env={"env_vars": env_vars}, **dashboard_options)
    except (RuntimeError, OSError) as e:  # what Ray raises when its daemons miss their start-up deadlines
        raise RayStartError(e) from e
    except Exception as e:
        if type(e) is not Exception:  # Ray raises a plain Exception when the raylet never registers
            raise
        raise RayStartError(e) from e
    # Once per process, however many Rays it starts; runs before Ray's own hook, registered at import.
    atexit.unregister(_stop_autoscaler_monitor)
    atexit.register(_stop_autoscaler_monitor)
    return True


@contextlib.contextmanager
def _daemons_in_a_process_group_of_their_own() -> Iterator[None]:
    """Start a local Ray's daemons (GCS, raylet, and through it the workers) outside this process's
    group. A signal to the group (Slurm's `scancel`, `timeout`, `kill -TERM -PGID`) then reaches
    the driver alone, which stops the run as the README says (the workers aborted, the last
    checkpoint named, exit 143), and then Ray. Inside the group, the GCS would die at once with
    the driver's SIGTERM: Train could then not abort its workers, which would train and save on
    unattended, while the driver waited for the GCS. Ray blocks SIGINT in its daemons for the
    same reason; it has no option for this, so its process class is wrapped while
    `ray.init` starts them. They still die with the driver (Ray's fate sharing)."""
    import ray._private.services as services

    popen = services.ConsolePopen

    class OwnGroupPopen(popen):
        def __init__(self, *args, preexec_fn: Optional[Callable[[], None]] = None, **kwargs):
            def preexec() -> None:
                os.setpgid(0, 0)
                if preexec_fn is not None:
                    preexec_fn()
            super().__init__(*args, preexec_fn=preexec, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = popen


@contextlib.contextmanager
def sigterm_as_ctrl_c(received: threading.Event) -> Iterator[None]:
    """A SIGTERM handled as Ctrl-C, `received` set. `ray job stop`, Kubernetes and Slurm end a
    driver with SIGTERM; by Python's default it would die on the spot, its output half written and
    its Ray workers, aborted only once Ray noticed, stepping and writing checkpoints after the job
    reads STOPPED. As Ctrl-C, Ray Train aborts the worker group and Tune ends a sweep's
    trials keeping its state before the driver exits, and a command cleans up as for Ctrl-C. They
    register their SIGINT handlers as they run, so the handler is looked up when the signal comes;
    only the main thread can set one (a trial under Tune runs elsewhere and is stopped by Tune)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def as_ctrl_c(signum: int, frame: object) -> None:
        received.set()
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:  # SIGINT ignored: stop as Python's default SIGTERM would, with the message
            raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, as_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def setting_while(name: str, value: str) -> Iterator[None]:
    """The environment variable `name` at `value` while the block runs: a Ray setting read only
    there, in this process, which must not outlast it (the process may go on to other runs). A
    value the user set is theirs and is kept."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


# The signals whose handlers Ray Train's trainer and Tune's tuner set for a run and leave behind.
RUN_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGUSR1") if hasattr(signal, name))


@contextlib.contextmanager
def callers_handlers_kept() -> Iterator[None]:
    """The caller's SIGINT (and SIGUSR1) handlers back when the block ends. Ray Train's trainer and
    Tune's tuner set theirs for a run's Ctrl-C (Tune's SIGUSR1 too) and leave them for good: in a
    process that goes on after the run (a notebook, a script, a test session), a later Ctrl-C asked
    a dead controller to abort and exited with status 0, or met Tune's "ending Ray Tune run"
    warning and nothing else, where the caller's handler would have raised KeyboardInterrupt; a
    SIGUSR1 set the dead run's event where the caller's handler, or the default exit, should act."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    callers = {signum: signal.getsignal(signum) for signum in RUN_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in callers.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def _signals_held_while_starting() -> Iterator[None]:
    """Hold a SIGTERM, or a first Ctrl-C, that comes while `ray.init` starts or joins a Ray until it
    is done, then deliver it: a SIGTERM to the caller's handler (`sigterm_as_ctrl_c`), or, when the
    caller has none, to the one `ray.init` sets (an exit, on which Ray's exit hook stops the
    daemons). Handled at once, either cut the start short: Ray's hook then had no node to stop,
    and the raylet's dashboard and runtime-env agents lived on after the driver; or the exit
    landed in a callback of one of the start's forks, where Python drops it, and the run trained
    on. Ray's SIGTERM handler replaced the caller's, and Ray's C++ handler printed a stack dump on
    the way to an exit with status 15. A second Ctrl-C acts at once, for a start that hangs. Only
    the main thread sets handlers; on a Ray that sets its handler otherwise, signals act at once."""
    import ray._private.utils as ray_utils

    set_handler = getattr(ray_utils, "set_sigterm_handler", None)
    if threading.current_thread() is not threading.main_thread() or set_handler is None:
        yield
        return
    held: list[int] = []
    sigterm_after, sigint_after = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    callers_own = callable(sigterm_after)
    # A process that ignores Ctrl-C (a script's `cmd &`, a supervisor's child) goes on ignoring it:
    # held, a second one ended the start.
    held_signals = (signal.SIGTERM,) if sigint_after == signal.SIG_IGN else (signal.SIGTERM, signal.SIGINT)

    def hold(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and signum in held:
            raise KeyboardInterrupt
        held.append(signum)

    def set_after(handler: Callable) -> None:
        nonlocal sigterm_after
        if not callers_own:
            sigterm_after = handler

    ray_utils.set_sigterm_handler = set_after
    for signum in held_signals:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = set_handler
        signal.signal(signal.SIGTERM, sigterm_after)  # also in place of the C++ handler Ray's start set
        signal.signal(signal.SIGINT, sigint_after)
        for signum in dict.fromkeys(held):  # each once, in the order they came
            signal.raise_signal(signum)


def _stop_autoscaler_monitor() -> None:
    """Stop the autoscaler monitor of a Ray started here, before Ray's exit hook stops the rest.

    That hook terminates the monitor after the GCS; the monitor then spends its one second of
    grace trying to report its own termination to the GCS that is gone, and is killed: a second
    of every command's exit. A local Ray has nothing to autoscale, so it is killed first."""
    import ray._private.worker

    node = ray._private.worker._global_node
    if node is not None:
        node.kill_monitor(check_alive=False)


def placeable(need: dict[str, float]) -> tuple[int, str]:
    """How many workers that each need `need` (a resource -> its amount: CPU, GPU) the alive nodes
    of the Ray this process is connected to hold at once, by each node's total resources; and the
    largest node's resources in words ("2 CPUs", with GPUs when `need` has them), for a message
    about a worker no node can hold. A worker beyond that count waits for a node that may never
    come: an actor pool hands it work all the same, and the work waits with it."""
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    fits = sum(min(math.floor(resources.get(name, 0) / amount + 1e-9) for name, amount in need.items() if amount > 0)
               for resources in nodes)

    def count(n: float, what: str) -> str:
        return f"{n:g} {what}" + ("" if n == 1 else "s")

    largest = max(nodes, key=lambda r: (r.get("GPU", 0), r.get("CPU", 0)), default={})
    has = count(largest.get("CPU", 0), "CPU")
    if need.get("GPU"):
        has += f" and {count(largest.get('GPU', 0), 'GPU')}"
    return fits, has


def local_num_cpus(num_workers: int, cpus_per_worker: float) -> int:
    """Logical CPUs of a local Ray for a run: the workers' reservations plus room for the Ray
    Data readers (one per rank)."""
    return max(os.cpu_count() or 1, math.ceil(num_workers * cpus_per_worker) + 2)
