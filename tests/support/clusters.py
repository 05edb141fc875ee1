"""Local multi-node Ray clusters as test fixture bodies (cluster/local.py does the work).

The cluster modules (tests/cluster/test_chaos.py, test_elastic.py, test_jobs.py,
test_local_cluster.py, test_preemption.py) all run on the README's cluster shape, a head with 0
CPUs and two worker nodes of 2 CPUs (`scripts/local-cluster start --nodes 2 --cpus-per-node 2`).
Each started its own: 20-120 s of a 2-core machine each, and up to 17 s to stop it. `SharedCluster`
starts that shape once for the session (the `shared_cluster` fixture) and hands it to each
module whole: every worker node alive, a node that the previous module killed started again (as
`start-node` would), and after a module in which a test failed, a fresh cluster, so that a
failure leaves nothing (a drained node, a stray actor) to the next module. A module may also ask
for a fresh one after it (test_local_cluster.py, whose last test stops the cluster and whose
detached actors hold CPUs: tests/conftest.py runs it after the others). The cluster is stopped as soon as no later test of the session asks
for it, so that the rest of the suite does not share the CPUs with its idle daemons. A cluster
of a test's own takes addresses of its own (benchmarks/drill.py's, in tests/test_drill.py, is on
127.0.1.x); tests/conftest.py runs it after the shared one's modules, on the same xdist worker.
"""

from __future__ import annotations

from typing import Iterator, Optional

import pytest

from cluster.local import LocalCluster

# The README's shape, which every module that shares the cluster was written for.
SHARED_SHAPE = {"num_nodes": 2, "cpus_per_node": 2}


class driver_environment:
    """This process gets `cluster`'s driver environment inside the block, its own back after."""

    def __init__(self, cluster: LocalCluster):
        self.cluster, self.patch = cluster, pytest.MonkeyPatch()

    def __enter__(self) -> LocalCluster:
        for name, value in self.cluster.driver_env().items():
            self.patch.setenv(name, value)
        return self.cluster

    def __exit__(self, *exc) -> None:
        self.patch.undo()


class SharedCluster:
    """The session's one cluster of SHARED_SHAPE, started on first use and again after a stop."""

    def __init__(self) -> None:
        self._cluster: Optional[LocalCluster] = None

    @property
    def running(self) -> bool:
        return self._cluster is not None and self._cluster.gcs_port is not None and \
            bool(self._cluster.processes(0))

    def acquire(self) -> LocalCluster:
        """The cluster, whole: started if it is not running, else each worker node that was
        killed started again, and every node alive in Ray's view."""
        if not self.running:
            self.release()
            cluster = LocalCluster(**SHARED_SHAPE)
            try:
                cluster.start()
            except BaseException:
                cluster.stop()
                raise
            self._cluster = cluster
            return cluster
        cluster = self._cluster
        try:
            for node in cluster.nodes[1:]:
                if not cluster.processes(node.index):
                    cluster.start_node(node.index)
            cluster.wait_for_alive(range(len(cluster.nodes)), timeout_s=60)
        except Exception:
            self.release()  # a cluster that cannot be made whole again is replaced, not handed out
            return self.acquire()
        return cluster

    def release(self) -> None:
        """Stop every process of the cluster (idempotent); the next acquire starts a new one."""
        if self._cluster is not None:
            self._cluster.stop()
            self._cluster = None


# The session's one (the `shared_cluster` fixture hands it out once S3 is up).
SHARED = SharedCluster()


def module_on_shared_cluster(request: pytest.FixtureRequest, shared: SharedCluster,
                             fresh_after: bool = False) -> Iterator[LocalCluster]:
    """The body of a cluster module's module-scoped `cluster` fixture: the shared cluster, whole,
    with the driver environment (RAY_ADDRESS, the auth settings) for the module's tests, so that
    a test can `ray.init()`; outside the module a test's `raylm train` starts its own local Ray
    again. After the module, a failed test (or `fresh_after`) costs the next module a fresh
    cluster; the last module to need it stops it."""
    failed_before = request.session.testsfailed
    with driver_environment(shared.acquire()) as cluster:
        yield cluster
    if fresh_after or request.session.testsfailed != failed_before or not _needed_later(request):
        shared.release()


def _needed_later(request: pytest.FixtureRequest) -> bool:
    """Whether a test after this module's in the session's order asks for the shared cluster."""
    items = request.session.items
    module = request.node.path
    last = max((i for i, item in enumerate(items) if item.path == module), default=len(items))
    return any("shared_cluster" in item.fixturenames for item in items[last + 1:])
