"""The one way raylm gets a Ray: join the cluster Ray's own conventions name, or start a local
single-node Ray that listens on loopback only."""

from __future__ import annotations

import math
import os
from typing import Optional

# Usage stats would phone home.
# TODO(issue 14): token authentication stays on; this module will manage the token.
LOCAL_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def use_loopback() -> None:
    """Make a Ray started from this process bind every server to 127.0.0.1.

    Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import, to decide whether the node
    advertises a routable address; the environment covers the processes Ray spawns, and the
    module constant this process, where Ray is usually imported already.
    """
    import ray._private.ray_constants as ray_constants

    for key, value in {**LOCAL_RAY_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}.items():
        os.environ.setdefault(key, value)
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False")


def start_ray(address: Optional[str] = None, num_cpus: Optional[int] = None, worker_threads: int = 1) -> None:
    """Join the Ray at `address`, or start a local one (loopback only) with `num_cpus` logical
    CPUs whose workers run `worker_threads` OpenMP threads. None or "local" starts one."""
    import ray

    if ray.is_initialized():
        return
    if address not in (None, "local"):
        ray.init(address=address)
        return
    use_loopback()
    ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=True, dashboard_host="127.0.0.1",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(worker_threads))}})


def local_num_cpus(num_workers: int, cpus_per_worker: float) -> int:
    """Logical CPUs of a local Ray for a run: the workers' reservations plus room for the Ray
    Data readers (one per rank)."""
    return max(os.cpu_count() or 1, math.ceil(num_workers * cpus_per_worker) + 2)
