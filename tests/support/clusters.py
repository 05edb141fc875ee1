"""A local multi-node Ray cluster as a test fixture body (cluster/local.py does the work)."""

from __future__ import annotations

from typing import Iterator

import pytest

from cluster.local import LocalCluster


def local_cluster(num_nodes: int = 2, cpus_per_node: int = 2, **kwargs) -> Iterator[LocalCluster]:
    """1 head (0 CPUs) + `num_nodes` workers. This process gets the driver environment
    (RAY_ADDRESS, the auth settings) while it lasts, so that a test can `ray.init()`; every
    process of the cluster is stopped afterwards."""
    with LocalCluster(num_nodes, cpus_per_node, **kwargs) as cluster:
        patch = pytest.MonkeyPatch()
        for name, value in cluster.driver_env().items():
            patch.setenv(name, value)
        try:
            yield cluster
        finally:
            patch.undo()
