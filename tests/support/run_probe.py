"""A Ray Train callback that records what a run's start-up brought up beside the training: whether
torch is imported in the driver (when the trainer is built, after the run's checks) and in Train's
controller (once the workers have started, and after the run, shutdown included), and the named
actors living on the Ray at those two points. Named in RAY_TRAIN_CALLBACKS, Ray Train builds it in
the driver and runs it in the controller; each record is a JSON line in $RAYLM_RUN_PROBE."""

from __future__ import annotations

import json
import os
import sys

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback


class RunProbe(ControllerCallback, WorkerGroupCallback):
    def __init__(self) -> None:
        self.path = os.environ["RAYLM_RUN_PROBE"]
        self._record("driver")

    def _record(self, where: str, actors: bool = False) -> None:
        record = {"where": where, "pid": os.getpid(), "torch": "torch" in sys.modules}
        if actors:
            record["named_actors"] = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def after_worker_group_start(self, worker_group) -> None:
        self._record("controller, workers started", actors=True)

    def after_controller_finish(self, result) -> None:
        self._record("controller, run finished", actors=True)
