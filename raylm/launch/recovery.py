"""The driver's record of worker failures, as a Ray Train callback.

It runs inside Ray Train's controller process, which unpickles it at start: it imports nothing
of the training code (torch, the model, the loop), which the controller does not need.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from ray.train import UserCallback

from raylm.config import StorageConfig
from raylm.data.storage import redact
from raylm.train.observe.records import EVENTS_FILE, append_event
from raylm.train.checkpoint.resume import latest_usable


class RecoveryLog(UserCallback):
    """Driver side of the recovery record: each worker failure, with its cause, goes to
    events.jsonl (the restarted workers add when and from which step training resumed)."""

    def __init__(self, run_dir: str, run_uri: str, storage_cfg: Optional[StorageConfig]):
        self.run_dir, self.run_uri, self.storage_cfg = run_dir, run_uri, storage_cfg

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        # What the restarted workers restore (RayTrainEnv.restore_dir): the newest complete
        # checkpoint on storage, which can be newer than the last one Ray's controller polled.
        restart_from = latest_usable(self.run_uri, self.storage_cfg, allow_none_usable=True)
        event = {"event": "failure", "time": time.time(),
                 "cause": {str(rank): redact(f"{type(e).__name__}: {e}")[:1000]
                           for rank, e in worker_exceptions.items()},
                 "restart_from": restart_from}
        print(f"raylm: worker failure, restarting from {restart_from}: {event['cause']}", flush=True)
        append_event(os.path.join(self.run_dir, EVENTS_FILE), event)
