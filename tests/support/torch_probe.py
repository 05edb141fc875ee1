"""A Ray Train callback that records whether torch is imported in the driver (when the trainer is
built, after the run's checks) and in Train's controller (once the workers have started, and
after the run, shutdown included). Named in RAY_TRAIN_CALLBACKS, Ray Train builds it in the
driver and runs it in the controller; each record is a JSON line in $RAYLM_TORCH_PROBE."""

from __future__ import annotations

import json
import os
import sys

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback


class TorchImportProbe(ControllerCallback, WorkerGroupCallback):
    def __init__(self) -> None:
        self.path = os.environ["RAYLM_TORCH_PROBE"]
        self._record("driver")

    def _record(self, where: str) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"where": where, "pid": os.getpid(), "torch": "torch" in sys.modules}) + "\n")

    def after_worker_group_start(self, worker_group) -> None:
        self._record("controller, workers started")

    def after_controller_finish(self, result) -> None:
        self._record("controller, run finished")
