"""Ray glue for the progress watchdog (raylm/train/resilience/watchdog.py): what the cluster has pending,
for the reason it gives, and failing the worker group through Ray Train's own failure handling.

    hooks = (*hooks, progress_watchdog(cfg))     # in the Ray Train worker function
"""

from __future__ import annotations

from typing import Optional

from raylm.config import Config
from raylm.train.resilience.watchdog import ProgressTimeout, ProgressWatchdog

PENDING_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "RESTARTING")
STATE_TIMEOUT_S = 10


def progress_watchdog(cfg: Config) -> Optional[ProgressWatchdog]:
    """The watchdog of one Ray Train worker per run.watchdog_* (None when watchdog_factor is 0)."""
    run = cfg.run
    factor = run.watchdog_factor
    if not factor:
        return None
    import ray

    job_id = ray.get_runtime_context().get_job_id()
    return ProgressWatchdog(startup_s=run.watchdog_startup_s, factor=factor,
                            min_s=run.watchdog_min_s,
                            describe=lambda: describe_pending(job_id), fail=fail_worker_group)


def describe_pending(job_id: str) -> str:
    """This job's actors that wait to start (what they need, where they may go), each node's
    CPU use, and the resource demands Ray cannot place: the usual reasons a run stops."""
    return "; ".join(part for part in (_pending_actors(job_id), _cluster_usage()) if part)


def _pending_actors(job_id: str) -> str:
    import ray
    from ray.util.state import list_actors

    try:
        actors = list_actors(ray.get_runtime_context().gcs_address, filters=[("job_id", "=", job_id)], detail=True, timeout=STATE_TIMEOUT_S,
                             raise_on_missing_output=False)
    except Exception as e:  # noqa: BLE001 - the State API needs the dashboard, absent on some clusters
        return f"(actors unknown: the Ray State API did not answer: {type(e).__name__}: {' '.join(str(e).split())[:200]})"
    waiting = [a for a in actors if a.state in PENDING_STATES]
    if not waiting:
        return f"no actor of job {job_id} waits to start"
    return f"{len(waiting)} actor(s) waiting to start: " + ", ".join(
        f"{a.repr_name or a.class_name} ({a.state}, needs {_resources(a.required_resources)}"
        + (f", label selector {a.label_selector}" if a.label_selector else "") + ")" for a in waiting[:8])


def _cluster_usage() -> str:
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status  # what `ray status` shows

    try:
        status = get_cluster_status(ray.get_runtime_context().gcs_address, timeout=STATE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
        return f"cluster CPUs free {free:g} of {total:g} (per node unknown: {type(e).__name__})"
    nodes = []
    for node in status.active_nodes + status.idle_nodes:
        usage = {u.resource_name: u for u in (node.resource_usage.usage if node.resource_usage else [])}
        cpu = usage.get("CPU")
        nodes.append(f"{node.ip_address} {cpu.used:g}/{cpu.total:g}" if cpu else f"{node.ip_address} no CPUs")
    demands = [f"{_resources(r.bundle)} × {r.count}"
               for d in status.resource_demands.ray_task_actor_demand for r in d.bundles_by_count]
    demands += [f"placement group {d.details or d.pg_id} ({d.state})"
                for d in status.resource_demands.placement_group_demand]
    return (f"CPUs used per node: {', '.join(nodes) or 'no node alive'}; "
            f"unplaceable demands: {', '.join(demands) or 'none'}")


def _resources(resources: Optional[dict]) -> str:
    shown = {k: v for k, v in (resources or {}).items() if k != "memory" and not k.startswith("node:")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}" if shown else "no resources"


def fail_worker_group(error: ProgressTimeout) -> None:
    """Fail this worker in Ray Train as if its training function had raised `error`, while that
    function is still blocked: Ray Train's monitor takes the first error put in this queue (its
    own background checkpoint uploads fail the worker this way), the controller's next poll
    sees it, records it (RecoveryLog) and restarts or ends the worker group per FailureConfig."""
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.execution.context import get_train_context

    runner = get_train_context().execution_context.training_thread_runner
    runner.get_exception_queue().put(UserExceptionWithTraceback(error, f"{type(error).__name__}: {error}"))
