"""parallel.fault_tolerance=replica on Ray Train: each worker a torchft replica group, a torchft
lighthouse beside Train's controller, and a failed group replaced alone.

What Ray Train 2.60's `ray.train.v2.torch.TorchftConfig` does, on raylm's node-bound backend
(`raylm.launch.backend`): the controller replaces only the failing replica groups of a backend
whose class says `has_replica_groups`, and every group gets its own process group. Not Ray's
config itself, for two reasons: its backend is Ray's torch backend, whose rendezvous store listens
on every interface, and it starts the lighthouse on `[::]:0`, every interface too; and its module
imports torch into the driver and the controller (2 s each on 2 cores), which raylm's never do.
Here the lighthouse and each group's store listen on the address Ray gave the node (127.0.0.1 on a
local run). The quorum, the fault-tolerant all-reduce and the heal are torchft's
(`raylm.train.replica`).

The controller runs `on_start` for the whole worker group at a (re)start from a checkpoint, and for
one replica group when it replaces a failed one: that group is told it joins a running quorum, so
it heals from a peer instead of reading a checkpoint.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raylm.launch.backend import NodeBoundTorchConfig, _NodeBoundTorchBackend

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # Ray's and torchft's name for the lighthouse's address
STORE_ENV = "RAYLM_REPLICA_STORE"  # this group's rendezvous store, host:port (torchft's Manager connects)
JOINING_ENV = "RAYLM_REPLICA_JOINING"  # "1": a replacement group, which heals from a live peer


@ray.remote(num_cpus=0)
class Lighthouse:
    """torchft's lighthouse (a PyO3 type, which `ray.remote` cannot wrap itself), on `bind`."""

    def __init__(self, bind: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int):
        from torchft.coordination import LighthouseServer

        self.server = LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                       heartbeat_timeout_ms=heartbeat_timeout_ms)
        self.host = bind.rsplit(":", 1)[0]

    def address(self) -> str:
        # torchft names its server by the machine's hostname, which need not resolve to the address
        # it listens on (a node of the local cluster on 127.0.0.2 was refused at "http://vm:PORT").
        return f"http://{self.host}:{self.server.address().rsplit(':', 1)[1]}"


def _set_env(values: dict[str, str]) -> None:
    os.environ.update(values)


class _ReplicaBackend(_NodeBoundTorchBackend):
    has_replica_groups = True  # Ray Train's controller then replaces failing replica groups alone

    def __init__(self) -> None:
        super().__init__()
        self.lighthouse: Optional[Any] = None

    def _lighthouse_address(self, config: "ReplicaTorchConfig") -> str:
        if self.lighthouse is not None:
            try:
                return ray.get(self.lighthouse.address.remote())
            except ray.exceptions.RayActorError:
                # Its process was lost: every group lost its quorum with it and failed, and Ray Train
                # starts them again from the checkpoint, which needs a live lighthouse to join.
                print("raylm: the torchft lighthouse was lost; the replica groups start again on a new one", flush=True)
        # In the controller's process, on its node: the node's Ray address is the lighthouse's.
        host = ray.util.get_node_ip_address()
        bind = f"[{host}]:0" if ":" in host else f"{host}:0"
        self.lighthouse = Lighthouse.options(
            runtime_env={"env_vars": config.env},
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(bind, 1, config.join_timeout_ms, config.heartbeat_timeout_ms)
        return ray.get(self.lighthouse.address.remote())

    def _start_group(self, group, config: "ReplicaTorchConfig", lighthouse: str, joining: bool) -> None:
        super().on_start(group, config)
        store = group.execute_single(0, _store_address)
        group.execute(_set_env, {LIGHTHOUSE_ENV: lighthouse, STORE_ENV: store, JOINING_ENV: "1" if joining else "0"})

    def on_start(self, worker_group, backend_config: "ReplicaTorchConfig") -> None:
        _replace_without_the_dead()  # in the controller's process, where it replaces them
        lighthouse = self._lighthouse_address(backend_config)
        groups = worker_group.get_replica_groups() if hasattr(worker_group, "get_replica_groups") else None
        if groups is None:  # one replica group, replacing a failed one
            self._start_group(worker_group, backend_config, lighthouse, joining=True)
            return
        with ThreadPoolExecutor() as pool:
            for done in [pool.submit(self._start_group, group, backend_config, lighthouse, False) for group in groups]:
                done.result()


def _replace_without_the_dead() -> None:
    """Ray Train 2.60's controller replaces failing replica groups one at a time, and each
    replacement first clears the result queues of the other groups it finds active. A group lost
    with the first (a node that held both) is dead there, and the clear's ActorDiedError fails the
    run (`ControllerError`). Two cases: the poll found both failing (they are shut down before the
    first is replaced), or the poll still found the second running (it went silent first, or its
    poll was late on a loaded machine) and the clear meets it dead (it is shut down then, and the
    replacement tried again; the next poll finds it failed and replaces it). Shut down, a group is
    not cleared, and its workers are kept for its own replacement (Ray's `ReplicaGroup` keeps them
    for that). On the worker group's class: the controller's own methods are wrapped per instance
    by Ray's tracing."""
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    replace = WorkerGroup.replace_replica_group
    if getattr(replace, "raylm", False):
        return

    def replace_replica_group(worker_group, index: int) -> None:
        # Once per poll: the controller replaces its failing groups one after the other, and a
        # group replaced already is a new, live one.
        status = worker_group.get_latest_poll_status()
        if status is not None and getattr(worker_group, "raylm_shut_down_for", None) is not status:
            worker_group.raylm_shut_down_for = status
            for other in status.failing_replica_group_indices:
                if other != index:
                    worker_group._replica_groups[other].shutdown()
        while True:
            try:
                return replace(worker_group, index)
            except ray.exceptions.RayActorError:
                # Ray's replacement leaves the old group shut down and no new one made when its
                # clear fails, so trying again starts from where the first try began.
                if not _shut_dead_groups_down(worker_group, index):
                    raise

    replace_replica_group.raylm = True
    WorkerGroup.replace_replica_group = replace_replica_group


def _shut_dead_groups_down(worker_group, index: int) -> bool:
    """Shut down the active groups other than `index` whose workers are dead; whether there were any.
    The probe is the replacement's own clear of their result queues."""
    dead = []
    for other, group in enumerate(worker_group._replica_groups):
        if other == index or not group.is_active():
            continue
        try:
            ray.get([worker.actor.clear_result_queue.remote() for worker in group.get_workers()])
        except ray.exceptions.RayActorError:
            dead.append(other)
            group.shutdown()
    if dead:
        print(f"raylm: replica group(s) {dead} died while group {index} was being replaced; Ray Train "
              "replaces them after it", flush=True)
    return bool(dead)


def _store_address() -> str:
    from raylm.launch import backend

    store = backend._hosted[1]
    return f"{store.host}:{store.port}"


@dataclass
class ReplicaTorchConfig(NodeBoundTorchConfig):
    """The node-bound torch backend with torchft's replica groups (see the module)."""

    # How long the lighthouse waits for a group of the last quorum that is alive (it heartbeats)
    # but late: the quorum's first group saving a checkpoint, a slow host. A group dead or gone
    # stops heartbeating and is out after the heartbeat timeout instead; one not in the last
    # quorum (a replacement starting) is not waited for (torchft's fast quorum). At 1 s, three
    # groups went on without the saving one at every checkpoint longer than that, and it healed.
    # Set from parallel.replica_timeout_s.
    join_timeout_ms: int = 30000
    # A group silent this long is out of the quorum: the stall of the others when one is lost
    # (torchft's 5 s default made it 5.1 s on 2 cores; its managers beat every 100 ms).
    heartbeat_timeout_ms: int = 2000
    env: dict = field(default_factory=dict)  # the lighthouse's environment (its log level)

    @property
    def backend_cls(self) -> type:
        return _ReplicaBackend
