"""Ray's autoscaling coordinator, as an elastic run needs it at its start.

The coordinator is a detached actor through which Ray Train and Ray Data tell a cluster's
autoscaler what they need; an elastic run starts with as many workers as the resources it
reserves for the run. It is one of Ray's internals (see the package's list): on a Ray without
it the run still starts, as Ray Train would start it.
"""

from __future__ import annotations

import contextlib
import time
from typing import ContextManager

from raylm.ray_runtime import setting_while

# With it set, Ray Train records each run and its controller in its state actor (Ray's dashboard
# shows them): the record `release_dead_runs` reads.
TRAIN_STATE_TRACKING = "RAY_TRAIN_ENABLE_STATE_TRACKING"
# How long the coordinator keeps a Ray Train run's request after the run last sent it (Ray 2.60's
# AUTOSCALING_REQUESTS_EXPIRE_TIME_S); the value if that name is gone.
DEFAULT_REQUEST_EXPIRY_S = 180.0


def train_state_tracking(enabled: bool) -> ContextManager[None]:
    """Ray Train's run tracking on while a trainer makes its callbacks (it reads the setting there,
    in the driver, and nowhere else), unless the user set it. Only for that while: the process may
    go on to a run on a Ray of its own (tests and sweeps do), whose controller then started Train's
    state actor, and imported torch, for a record no one reads."""
    return setting_while(TRAIN_STATE_TRACKING, "1") if enabled else contextlib.nullcontext()


def start_autoscaling_coordinator(elastic: bool) -> None:
    """Start Ray's autoscaling coordinator, or find it running, before Ray Train's controller.

    The controller asks this detached actor for the workers' resources before it starts them and
    waits for the answer: started here, the actor's process comes up beside the controller's
    instead of after it (1.5 s of a local start on 2 cores). For an `elastic` run it also gives
    up what it still reserves for runs no longer running (`release_dead_runs`), then re-reads the
    cluster's nodes: it re-reads them only every 20 s, so a run started just after a node
    (re)joined began smaller than the cluster and restarted to grow a minute later."""
    import ray

    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)

        coordinator = get_or_create_autoscaling_coordinator()
        if elastic:
            try:
                release_dead_runs(coordinator)
            except Exception as e:  # noqa: BLE001 - then Ray's own expiry releases them
                print(f"raylm: could not release what Ray reserves for runs no longer running ({e!r}); "
                      "the run may wait up to 3 minutes for its workers", flush=True)
            ray.get(coordinator.get_reserved_resources.remote("raylm-launch", recompute=True), timeout=10)
    except Exception as e:  # noqa: BLE001 - Ray Train starts the coordinator itself, with its older view
        print(f"raylm: could not prepare Ray's autoscaling coordinator ({e!r}); "
              f"{'the run may start smaller and grow' if elastic else 'Ray Train starts it'}", flush=True)


def release_dead_runs(coordinator) -> None:
    """Cancel the coordinator's requests of Ray Train runs that ended or whose controller is dead.

    A run's controller cancels its request when it ends, but one killed with its driver (a
    SIGKILL, a lost head-node process) cannot: the coordinator goes on reserving the run's
    workers until the request expires, 180 s after the run last renewed it, and an elastic run
    started in that time (the same command, run again) finds no resources left for it and waits
    out the expiry. Ray Train's state actor knows each run's controller; a run that ended
    longer ago than the expiry has no request left to cancel."""
    import ray

    try:
        from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
            AUTOSCALING_REQUESTS_EXPIRE_TIME_S as expiry_s)
    except ImportError:
        expiry_s = DEFAULT_REQUEST_EXPIRY_S
    from ray.train.v2._internal.state.state_actor import get_state_actor
    from ray.train.v2._internal.state.util import is_actor_alive

    state = get_state_actor()
    if state is None:  # no Train run on this cluster yet
        return
    ended_after_ns = time.time_ns() - int(expiry_s * 1e9)
    dead = []
    for run in ray.get(state.get_train_runs.remote(), timeout=10).values():
        if run.status.is_terminal():  # aborted or ended: its request, if any, is of no use
            if (run.end_time_ns or 0) >= ended_after_ns:
                dead.append(run.id)
        elif not is_actor_alive(run.controller_actor_id, timeout=10):  # not yet marked aborted
            dead.append(run.id)
    # The request's name: Ray Train's policies ask as "train-<run id>" (`after_controller_start`).
    ray.get([coordinator.cancel_request.remote(f"train-{run_id}") for run_id in dead], timeout=10)
