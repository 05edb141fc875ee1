"""Which worker failures Ray Train restarts from, and the record of each.

Both run inside Ray Train's controller process, which unpickles them at start: they import
nothing of the training code (torch, the model, the loop), which the controller does not need.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from ray.train import UserCallback

from raylm.config import StorageConfig
from raylm.data.storage import redact
from raylm.errors import DeterministicError, Preempted
from raylm.train.checkpoint.resume import latest_usable
from raylm.train.observe.records import EVENTS_FILE, append_event


def deterministic_failures(worker_exceptions: dict) -> dict:
    """The failures among `worker_exceptions` (rank -> exception) that a restart cannot cure
    (`raylm.errors`). One such rank decides for the group: when it raises, its peers fail
    beside it with collateral errors (a collective aborted, a connection reset)."""
    return {rank: e for rank, e in worker_exceptions.items() if isinstance(e, DeterministicError)}


def preemption(worker_exceptions: dict) -> Optional[Preempted]:
    """The ranks' `Preempted` (they agree: one stands for all) when the worker group stopped for
    a node reclaim, and no rank failed in a way that a restart cannot cure."""
    if deterministic_failures(worker_exceptions):
        return None
    return next((e for e in worker_exceptions.values() if isinstance(e, Preempted)), None)


try:
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    from ray.train.v2.api.exceptions import PreemptionError, WorkerGroupError
    from ray.train.v2.api.preemption import PreemptionInfo

    class RaylmFailurePolicy(DefaultFailurePolicy):
        """Ray Train's failure policy, except that a deterministic error ends the run at once
        instead of being replayed `max_failures` times, and that ranks which stopped for a
        preemption (`Preempted`, after saving) are Ray's own preemption: charged to
        `max_preemption_failures`, not `max_failures`."""

        def _is_retryable_error(self, training_failed_error) -> bool:
            if isinstance(training_failed_error, WorkerGroupError) and deterministic_failures(
                    training_failed_error.worker_failures):
                return False
            return super()._is_retryable_error(training_failed_error)

        def make_decision(self, training_failed_error):
            if isinstance(training_failed_error, WorkerGroupError) and (
                    notice := preemption(training_failed_error.worker_failures)):
                deadline_ms = None if notice.deadline is None else int(notice.deadline * 1000)
                training_failed_error = PreemptionError(PreemptionInfo(deadline_ms, notice.node_ranks))
            return super().make_decision(training_failed_error)
except ImportError:  # a Ray whose internals moved: every failure is retried, as Ray Train would
    RaylmFailurePolicy = None


class RecoveryLog(UserCallback):
    """Driver side of the recovery record: each worker failure, with its cause, goes to
    events.jsonl (the restarted workers add when and from which step training resumed); a
    deterministic one is recorded as the end of the run, ranks that stopped for a node reclaim
    as a `preempted` event (the nodes, their ranks, the deadline, the step saved)."""

    def __init__(self, run_dir: str, run_uri: str, storage_cfg: Optional[StorageConfig], replica_groups: int = 0):
        self.run_dir, self.run_uri, self.storage_cfg = run_dir, run_uri, storage_cfg
        # parallel.fault_tolerance=replica: a worker is a replica group; Ray Train replaces the
        # failed ones alone while any group is left (raylm.launch.replicas).
        self.replica_groups = replica_groups
        self.preempted_at: Optional[int] = None  # the step of the preemption last recorded

    def _restart_from(self) -> Optional[str]:
        """The checkpoint the restarted workers will find, as far as storage says now."""
        try:
            return latest_usable(self.run_uri, self.storage_cfg, allow_none_usable=True)
        except OSError as e:  # storage out of reach, which may be the failure itself: the workers look again
            return f"the newest checkpoint once {self.run_uri} can be read ({redact(str(e))[:200]})"

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        cause = {str(rank): redact(f"{type(e).__name__}: {e}")[:1000] for rank, e in worker_exceptions.items()}
        if (notice := preemption(worker_exceptions)) and RaylmFailurePolicy is not None:
            # Ray Train may show the stopped ranks at two polls (the second after it saw the
            # notice itself, which moved it to its preempting state): one event per preemption.
            if notice.step == self.preempted_at:
                return
            self.preempted_at = notice.step
            restart_from = self._restart_from()
            event = {"event": "preempted", "time": time.time(), "nodes": sorted(notice.node_ranks),
                     "ranks": sorted(r for ranks in notice.node_ranks.values() for r in ranks),
                     "deadline": notice.deadline, "step": notice.step, "saved": notice.saved,
                     "restart_from": restart_from}
            print(f"raylm: {notice}; the restart resumes from {restart_from} (it counts against "
                  "run.max_preemptions, not run.max_failures)", flush=True)
        elif 0 < len(worker_exceptions) < self.replica_groups and not deterministic_failures(worker_exceptions):
            groups = sorted(int(rank) for rank in worker_exceptions)
            event = {"event": "failure", "time": time.time(), "cause": cause, "replica_groups": groups,
                     "restart_from": None}
            print(f"raylm: replica group(s) {groups} failed; the others train on, Ray Train starts them again and "
                  f"they heal from a live peer: {cause}", flush=True)
        elif deterministic_failures(worker_exceptions) and RaylmFailurePolicy is not None:
            event = {"event": "failure", "time": time.time(), "cause": cause, "deterministic": True,
                     "restart_from": None}
            print("raylm: the run stops: a restart cannot cure this failure", flush=True)
        else:
            # What the restarted workers restore (RayTrainEnv.restore): the newest complete
            # checkpoint on storage, which can be newer than the last one Ray's controller polled.
            restart_from = self._restart_from()
            event = {"event": "failure", "time": time.time(), "cause": cause, "restart_from": restart_from}
            print(f"raylm: worker failure, restarting from {restart_from}: {cause}", flush=True)
        append_event(os.path.join(self.run_dir, EVENTS_FILE), event)
