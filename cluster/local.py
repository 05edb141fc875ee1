"""A local multi-node Ray cluster of real `ray start` processes, for development and tests.

    with LocalCluster(num_nodes=2, cpus_per_node=2) as cluster:
        os.environ.update(cluster.driver_env())
        ray.init(address=cluster.address)
        cluster.kill_node(2)                 # SIGKILL node 2's processes: a node loss
        cluster.wait_for_alive([0, 1])       # Ray noticed (a few seconds)
        cluster.start_node(2)                # same IP and temp dir; Ray gives it a new node id

Node 0 is the head (GCS, and the dashboard with the job server on 127.0.0.1 for `ray job
submit`; `head_cpus` CPUs, 0 by default so that work lands on worker nodes and killing a node
kills the work on it). Nodes 1..num_nodes are workers with `cpus_per_node`
CPUs each. Node i has IP 127.0.0.{i+2} (or {subnet}.{i+2}: `subnet` gives a second cluster,
such as benchmarks/drill.py's, addresses of its own so that it runs beside one of the README's),
its own temp dir and explicitly chosen free ports. Not 127.0.0.1: Ray rewrites that address to the machine's external one when a node joins
(unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, with which `ray start` refuses to join a cluster at
all); 127.0.0.2.. are taken as they are. Every address the cluster advertises and dials is on
loopback, and the dashboard and job server bind 127.0.0.1; but Ray 2.60 binds its gRPC servers
(GCS, raylets, workers, agents) to all interfaces for any node IP other than 127.0.0.1 itself
(seen with `ss -ltnp`), so on a machine with other interfaces this development cluster's ports
are reachable from them, guarded by the auth token only. A single-node
`raylm train` binds everything to 127.0.0.1 (tests/launch/test_sockets.py).

A node's processes: those carrying its marker variable (set for its `ray start`, inherited by
the daemons it leaves) and their descendants. Agents and workers rename themselves with
setproctitle, which may wipe their environment and command line, so only the process tree
reaches them; hence a kill freezes the tree (SIGSTOP) before SIGKILL, or the raylet's children
would be orphaned, and lost, the moment it died. PIDs are kept with their start time: a PID
reused by an unrelated process is never signalled.

Ray's token authentication is on (raylm.ray_runtime.ensure_auth_token: this user's token file,
created once): every node gets RAY_AUTH_MODE=token, and a client without the token is refused.
The nodes run with this Python's bin/ first on PATH, so a job's `python` is this environment's.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from raylm.ports import free_ports
from raylm.ray_runtime import LOCAL_RAY_ENV, ensure_auth_token

# Dead-node detection in ~3 s instead of Ray's default ~30 s (the GCS pings each raylet every
# period; `threshold` failed pings mark the node dead): a killed node refuses the ping at once.
# A live node on a machine loaded far past its cores may answer late, so the timeout is long:
# at 1 s the GCS declared a starting raylet dead (and it exits) three `ray start`s in a row.
FAST_FAILURE_DETECTION = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                          "health_check_timeout_ms": 10000}
# RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S: an elastic Train run gives up on a lost node sooner.
# RAY_agent_register_timeout_ms: a raylet aborts (a C++ check) when its dashboard agent has not
# reported its ports within this; on a machine loaded far past its cores that took longer than
# Ray's default, and the node never came back.
# RAY_TRAIN_ENABLE_PREEMPTION_WATCHER: these nodes can be drained (`ray drain-node`, a spot
# reclaim's notice), which only the watcher that one machine's Ray goes without passes on to a run.
# RAY_JOB_STOP_WAIT_TIME_S: `ray job stop` SIGKILLs a driver still alive 3 s after its SIGTERM; a
# raylm driver takes about that long to abort its workers and say where the run stands.
BASE_ENV = {**LOCAL_RAY_ENV, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20", "RAY_agent_register_timeout_ms": "300000",
            "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1", "RAY_JOB_STOP_WAIT_TIME_S": "30"}
NODE_MARKER = "RAYLM_LOCAL_CLUSTER_NODE"  # value: the node's temp dir, unique per node
_PORT_FLAGS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
               "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")
# Head-only listeners; the two metric servers are set through the environment (no flag) and
# would otherwise collide with any other Ray head on this machine.
_HEAD_PORT_FLAGS = ("port", "dashboard-port", "ray-client-server-port")  # set in _command
_HEAD_PORT_ENV = ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")
# Tries of a node's start that failed; one whose raylet died waiting for its agents (Ray's fixed
# 15 s for their port files, missed on a loaded machine) is tried again until the start's deadline.
_START_ATTEMPTS = 3


class LocalClusterError(RuntimeError):
    """A node failed to start or stop; the message names the node and quotes its log."""


Proc = tuple[int, int]  # (pid, start time in clock ticks since boot): survives PID reuse


def _stat(pid: int) -> Optional[tuple[int, int, str]]:
    """(ppid, start ticks, state) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def _process_table() -> dict[int, tuple[int, int, str]]:
    return {int(e): info for e in os.listdir("/proc") if e.isdigit() and (info := _stat(int(e)))}


def _alive(proc: Proc) -> bool:
    info = _stat(proc[0])
    # A SIGKILLed orphan stays a zombie until PID 1 reaps it; some container inits never do.
    return info is not None and info[1] == proc[1] and info[2] not in "ZX"


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:  # gone, or another user's process
        return False


def _with_descendants(roots: Iterable[Proc], table: dict[int, tuple[int, int, str]]) -> set[Proc]:
    found = {p for p in roots if p[0] in table and table[p[0]][1] == p[1]}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    stack = [pid for pid, _ in found]
    while stack:
        for child in children.get(stack.pop(), ()):
            proc = (child, table[child][1])
            if proc not in found:
                found.add(proc)
                stack.append(child)
    return {p for p in found if table[p[0]][2] not in "ZX"}


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    table = _process_table()
    if pid not in table:
        return []
    return sorted(p for p, _ in _with_descendants([(pid, table[pid][1])], table))


def _signal(proc: Proc, sig: int) -> None:
    if _alive(proc):  # checked just before: never signal a PID that now names another process
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc[0], sig)


def kill_process_trees(roots: Iterable[Proc], timeout_s: float = 10.0) -> set[Proc]:
    """SIGKILL `roots` and all their descendants; returns what was killed once all are gone.

    The trees are frozen first (SIGSTOP, repeated until no new descendant appears), so nothing
    forks or is orphaned between the survey and the kill. The roots stop before the first survey:
    on a loaded machine the surveys of a kill took about a second, in which a training worker went
    on for steps."""
    roots = set(roots)
    frozen = {proc for proc in roots if _alive(proc)}
    for proc in frozen:
        _signal(proc, signal.SIGSTOP)
    while True:
        new = _with_descendants(roots | frozen, _process_table()) - frozen
        if not new:
            break
        for proc in new:
            _signal(proc, signal.SIGSTOP)
        frozen |= new
    for proc in frozen:
        _signal(proc, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in frozen if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        raise LocalClusterError(f"processes {sorted(p[0] for p in left)} survived SIGKILL for {timeout_s:.0f} s")
    return frozen


@dataclass
class Node:
    index: int
    ip: str
    cpus: int
    temp_dir: str
    procs: list[Proc] = field(default_factory=list)  # as last seen; refreshed by `processes`

    @property
    def is_head(self) -> bool:
        return self.index == 0


class LocalCluster:
    """A Ray head and `num_nodes` worker nodes on this machine, each a real `ray start`."""

    def __init__(self, num_nodes: int, cpus_per_node: int, head_cpus: int = 0,
                 system_config: Optional[dict] = None, env: Optional[dict[str, str]] = None,
                 root: Optional[str] = None, object_store_mb: int = 128, start_timeout_s: float = 180.0,
                 dashboard: bool = True, subnet: str = "127.0.0"):
        if not 1 <= num_nodes <= 250:
            raise ValueError(f"num_nodes={num_nodes}: need 1..250 worker nodes (IPs {subnet}.3..)")
        if not re.fullmatch(r"127(\.(25[0-5]|2[0-4]\d|1?\d?\d)){2}", subnet):
            raise ValueError(f"subnet={subnet!r}: need the first three numbers of a loopback address, "
                             "such as 127.0.0 or 127.0.1")
        if cpus_per_node < 1 or head_cpus < 0:
            raise ValueError(f"cpus_per_node={cpus_per_node}, head_cpus={head_cpus}: need ≥ 1 and ≥ 0")
        self.system_config = {**FAST_FAILURE_DETECTION, **(system_config or {})}
        self.env = {**BASE_ENV, **ensure_auth_token(), **(env or {})}
        self.object_store_mb, self.start_timeout_s, self.dashboard = object_store_mb, start_timeout_s, dashboard
        # Short: Ray's unix sockets live under the temp dir and paths are limited to 107 bytes.
        self.owns_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="raylm-cluster-", dir="/tmp")
        self.nodes = [Node(i, f"{subnet}.{i + 2}", head_cpus if i == 0 else cpus_per_node,
                           os.path.join(self.root, f"node{i}")) for i in range(num_nodes + 1)]
        self.gcs_port: Optional[int] = None
        self.dashboard_port: Optional[int] = None
        self._gcs_client = None

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address, for `ray.init(address=...)` and `ray start --address`."""
        if self.gcs_port is None:
            raise LocalClusterError("the cluster is not started: call start() first")
        return f"{self.nodes[0].ip}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        """The dashboard and job server, for `ray job submit --address` and JobSubmissionClient."""
        if not self.dashboard or self.dashboard_port is None:
            raise LocalClusterError("the cluster runs no dashboard: start it with dashboard=True")
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self) -> "LocalCluster":
        """Start the head, then all worker nodes together; returns once Ray sees every node."""
        self._launch([self.nodes[0]])
        self._launch(self.nodes[1:])
        return self

    def start_node(self, index: int) -> None:
        """Start worker node `index` again after `kill_node`: same IP and temp dir, new ports."""
        node = self._worker(index)
        if self.processes(index):
            raise LocalClusterError(f"node {index} ({node.ip}) is running: kill_node({index}) first")
        self._launch([node])

    def kill_node(self, index: int) -> list[int]:
        """SIGKILL every process of worker node `index` (raylet, agents, workers); returns their PIDs."""
        node = self._worker(index)
        killed = kill_process_trees(self._roots(node))
        node.procs = []
        return sorted(pid for pid, _ in killed)

    def drain_node(self, index: int, deadline_s: int, message: str = "spot reclaim (simulated)") -> str:
        """Announce worker node `index`'s preemption as a cloud's autoscaler does, and as Ray's own
        tests simulate one: `ray drain-node` with the preemption reason and a deadline `deadline_s`
        seconds away. Ray schedules nothing new there and does not kill it; `kill_node` at the
        deadline is the cloud taking it. Returns the node's Ray id."""
        node_id = self.node_ids().get(self._worker(index).index)
        if node_id is None:
            raise LocalClusterError(f"node {index} is not alive: nothing to drain")
        args = [sys.executable, "-m", "ray.scripts.scripts", "drain-node", f"--address={self.address}",
                f"--node-id={node_id}", "--reason=DRAIN_NODE_REASON_PREEMPTION", f"--reason-message={message}",
                f"--deadline-remaining-seconds={deadline_s}"]
        done = subprocess.run(args, env={**os.environ, **self.driver_env()}, capture_output=True, text=True,
                              timeout=60)
        if done.returncode != 0:
            raise LocalClusterError(f"`ray drain-node` of node {index} exited with {done.returncode}:\n"
                                    f"{done.stdout}{done.stderr}")
        return node_id

    def stop(self) -> None:
        """Kill every process this cluster started, by PID, all frozen first (no node sees
        another go away). Idempotent."""
        kill_process_trees(set().union(*(self._roots(node) for node in self.nodes)))
        for node in self.nodes:
            node.procs = []
        self.gcs_port, self.dashboard_port, self._gcs_client = None, None, None
        if self.owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what is running --------------------------------------------------------------------

    def processes(self, index: int) -> list[int]:
        """PIDs of node `index`'s live processes (its daemons and their descendants)."""
        node = self.nodes[index]
        node.procs = sorted(_with_descendants(self._roots(node), _process_table()))
        return [pid for pid, _ in node.procs]

    def node_ids(self) -> dict[int, str]:
        """Ray node id (hex) of each node that Ray considers alive, by node index."""
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        ids, started = {}, {}
        for info in self._node_infos():
            index = self._index_of(info.node_manager_address)
            # A restarted node registers anew while its old registration may still look alive
            # (until the health checks fail): the newest registration is the node.
            alive = info.state == GcsNodeInfo.GcsNodeState.ALIVE
            if index is not None and alive and info.start_time_ms >= started.get(index, 0):
                ids[index], started[index] = info.node_id.hex(), info.start_time_ms
        return ids

    def alive_nodes(self) -> list[int]:
        """Indexes of the nodes that Ray considers alive."""
        return sorted(self.node_ids())

    def wait_for_alive(self, indexes: Iterable[int], timeout_s: float = 60.0) -> float:
        """Wait until exactly `indexes` are alive in Ray's view; returns the seconds waited."""
        want = sorted(indexes)
        return _wait(lambda: self.alive_nodes() == want, timeout_s,
                     lambda: f"alive nodes {self.alive_nodes()}, expected {want}")

    def driver_env(self) -> dict[str, str]:
        """Environment for a driver process or `ray` CLI: token auth like the nodes, RAY_ADDRESS
        for drivers and RAY_API_SERVER_ADDRESS for `ray job` commands."""
        env = {**self.env, "RAY_ADDRESS": self.address}
        if self.dashboard:
            env["RAY_API_SERVER_ADDRESS"] = self.dashboard_url
        return env

    # -- state file (for the CLI, where each command is a new process) ----------------------

    def save(self, path: str) -> None:
        state = {"root": self.root, "owns_root": self.owns_root, "gcs_port": self.gcs_port,
                 "dashboard": self.dashboard, "dashboard_port": self.dashboard_port,
                 "system_config": self.system_config, "env": self.env,
                 "object_store_mb": self.object_store_mb, "start_timeout_s": self.start_timeout_s,
                 "nodes": [asdict(n) for n in self.nodes]}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, path)  # a crash mid-write must not lose the PIDs of a running cluster

    @classmethod
    def load(cls, path: str) -> "LocalCluster":
        with open(path) as f:
            state = json.load(f)
        nodes = [Node(**{**n, "procs": [tuple(p) for p in n["procs"]]}) for n in state["nodes"]]
        cluster = cls(len(nodes) - 1, max(1, nodes[1].cpus), nodes[0].cpus, state["system_config"],
                      state["env"], state["root"], state["object_store_mb"], state["start_timeout_s"],
                      state.get("dashboard", False))  # absent from a state file older than the job server
        cluster.owns_root, cluster.gcs_port, cluster.nodes = state["owns_root"], state["gcs_port"], nodes
        cluster.dashboard_port = state.get("dashboard_port")
        return cluster

    # -- internals --------------------------------------------------------------------------

    def _worker(self, index: int) -> Node:
        if not 1 <= index < len(self.nodes):
            raise ValueError(f"node {index}: worker nodes are 1..{len(self.nodes) - 1} "
                             "(node 0, the head, holds the GCS and is not killed alone)")
        return self.nodes[index]

    def _index_of(self, ip: str) -> Optional[int]:
        return next((n.index for n in self.nodes if n.ip == ip), None)

    def _roots(self, node: Node) -> set[Proc]:
        """The node's recorded processes still alive, plus every process carrying its marker."""
        marker = f"{NODE_MARKER}={node.temp_dir}".encode()
        table = _process_table()
        marked = {(pid, info[1]) for pid, info in table.items() if _has_marker(pid, marker)}
        return marked | {p for p in node.procs if _alive(p)}

    def _node_infos(self) -> list:
        if self._gcs_client is None:
            from ray._raylet import GcsClient  # no driver needed, unlike ray.nodes()

            self._gcs_client = GcsClient(address=self.address)
        return list(self._gcs_client.get_all_node_info(timeout=10).values())

    def _command(self, node: Node) -> tuple[list[str], dict[str, str]]:
        env = {**os.environ, **self.env}
        env[NODE_MARKER] = node.temp_dir
        # A job's entrypoint (`python ...`) is looked up on the PATH of the node that runs it.
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", os.defpath)])
        # 0 (as a single-node setup may have left it) makes `ray start` refuse to join a cluster.
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
        ports = free_ports(len(_PORT_FLAGS) + (len(_HEAD_PORT_FLAGS) + len(_HEAD_PORT_ENV)) * node.is_head)
        args = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--node-ip-address={node.ip}",
                f"--temp-dir={node.temp_dir}", f"--num-cpus={node.cpus}", "--disable-usage-stats",
                f"--object-store-memory={self.object_store_mb * 2 ** 20}",
                # Port 0: workers bind OS-chosen ports, which cannot collide across nodes.
                "--min-worker-port=0", "--max-worker-port=0"]
        args += [f"--{flag}={ports.pop()}" for flag in _PORT_FLAGS]
        if node.is_head:
            self.gcs_port = ports.pop()
            self.dashboard_port = ports.pop()
            args += ["--head", f"--port={self.gcs_port}", f"--include-dashboard={str(self.dashboard).lower()}",
                     "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                     f"--ray-client-server-port={ports.pop()}", f"--system-config={json.dumps(self.system_config)}"]
            env.update({name: str(ports.pop()) for name in _HEAD_PORT_ENV})
        else:
            args.append(f"--address={self.address}")
        # Ray's own processes that look the cluster up (the State API in Train's placement-group
        # cleaner, the job supervisor) would otherwise search this machine, find every other Ray
        # on it too, and fail with "Found multiple active Ray instances".
        env["RAY_ADDRESS"] = self.address
        return args, env

    def _spawn(self, node: Node) -> tuple[subprocess.Popen, str]:
        os.makedirs(node.temp_dir, exist_ok=True)
        args, env = self._command(node)
        log_path = os.path.join(self.root, f"node{node.index}-ray-start.log")
        # A file, not a pipe: the daemons inherit it and would hold a pipe open forever.
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        return proc, log_path

    def _launch(self, nodes: list[Node]) -> None:
        """Run `ray start` for `nodes` concurrently; return once Ray reports each one alive.

        What says a node is up is the GCS listing it alive, and that is what this waits for, until
        a deadline that grows with the machine's load (`_deadline`). `ray start` gives a raylet a
        fixed 30 s to register and exits with an error when it is late; on a loaded machine its
        raylet then registers a little later all the same, so a failed `ray start` whose raylet
        runs is waited for, not killed; one whose raylet died is cleaned up and tried again, until
        the deadline when its agents missed Ray's fixed wait for them (the load), else 3 times."""
        previous = self.node_ids() if self.gcs_port is not None else {}
        budget = self._deadline()
        deadline = time.monotonic() + budget
        pending, logs = list(nodes), {}
        for attempt in itertools.count(1):
            started = [(node, *self._spawn(node)) for node in pending]
            pending = []
            for node, proc, log_path in started:
                logs[node.index] = log_path
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()  # what it already started carries the node's marker: found below
                    proc.wait()
                    code = None
                if code == 0 or self._raylet_running(node):
                    continue
                kill_process_trees(self._roots(node))
                last_words = _raylet_last_words(node)
                starved = "Timed out waiting for file" in last_words
                if time.monotonic() > deadline or (attempt >= _START_ATTEMPTS and not starved):
                    raise LocalClusterError(f"`ray start` of node {node.index} ({node.ip}) "
                                            f"{'timed out' if code is None else f'exited with {code}'} and its "
                                            f"raylet is not running (attempt {attempt}):\n{_tail(log_path)}"
                                            f"{last_words}")
                pending.append(node)
            if not pending:
                break
        for node in nodes:
            try:
                _wait(lambda: self.node_ids().get(node.index) not in (None, previous.get(node.index)),
                      max(1.0, deadline - time.monotonic()),
                      lambda: f"node {node.index} ({node.ip}) is not ALIVE in the GCS's node table at "
                              f"{self.address} after {budget:.0f} s (the deadline grows with the load: "
                              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
            except TimeoutError as e:
                raise LocalClusterError(f"{e}; see {node.temp_dir}/session_latest/logs\n"
                                        f"{_tail(logs[node.index])}") from None
            self.processes(node.index)

    def _deadline(self) -> float:
        """Seconds to give a start: `start_timeout_s` on an idle machine, up to 4 times that as
        the load average exceeds the cores (processes then wait their turn for a core)."""
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
        return self.start_timeout_s * min(4.0, max(1.0, load))

    def _raylet_running(self, node: Node) -> bool:
        for pid in self.processes(node.index):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[0].endswith(b"/raylet"):
                        return True
        return False


def _wait(done: Callable[[], bool], timeout_s: float, describe: Callable[[], str]) -> float:
    start = time.monotonic()
    while not done():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"after {timeout_s:.0f} s: {describe()}")
        time.sleep(0.2)
    return time.monotonic() - start


def _raylet_last_words(node: Node) -> str:
    """The fatal line of the node's newest raylet log and the frames that name its caller: why
    the raylet exited (e.g. its dashboard agent's port file not written within Ray's 15 s)."""
    logs = sorted(Path(node.temp_dir).glob("session_latest/logs/raylet*.out"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return ""
    lines = logs[-1].read_text(errors="replace").splitlines()
    fatal = [i for i, line in enumerate(lines) if "Check failed" in line or line.startswith("[") and " F " in line[:40]]
    if not fatal:
        return ""
    return f"\nthe raylet's last words ({logs[-1]}):\n" + "\n".join(lines[fatal[-1]:fatal[-1] + 5]) + "\n"


def _tail(path: str, lines: int = 25) -> str:
    try:
        return "".join(Path(path).read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError as e:
        return f"(no log: {e})"
