"""Preemption notices: the cluster announces that it takes nodes of the run back (a spot reclaim:
the node is drained with a deadline, and Ray Train's preemption watcher hands the notice to every
worker). The loop asks at the step clock's ticks (`raylm.train.clock`, about every second),
saves a checkpoint there and stops every rank with `raylm.errors.Preempted`, for Ray Train to
restart the run without those nodes.

Nothing here imports Ray: the env (`TrainEnv.preemption_notice`) is what asks the cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Notice:
    """Nodes being taken back, with the ranks on them, and when (UNIX time, s; None: not said)."""

    node_ranks: dict[str, list[int]]
    deadline: Optional[float]

    def passed(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline
