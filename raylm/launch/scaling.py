"""The worker group's size on a Ray that this process started, as Ray Train's controller decides it.

Ray Train's fixed-size policy also sends the group's resources to Ray Data's autoscaling
coordinator, a detached actor through which Train and Data tell a cluster's autoscaler what to
grow to. A Ray started by `raylm train` is one machine with no autoscaler behind it: the request
reached no one, and the coordinator was one more process, importing Ray Data while the run's own
processes started (2.5 s of CPU before the first step on 2 cores) and waking 100 times a second
for the whole run. This policy sizes the group as Ray's does, without the coordinator.

Imported by Train's controller, which unpickles the policy: nothing of torch or the training code.
"""

from __future__ import annotations

from ray.train.v2._internal.execution.context import TrainRunContext
from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy


class OwnRayFixedScalingPolicy(FixedScalingPolicy):
    """Ray Train's fixed-size policy with its autoscaling requests left out (see the module)."""

    def after_controller_start(self, train_run_context: TrainRunContext) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass
