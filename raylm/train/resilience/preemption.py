"""Preemption notices: the cluster announces that it takes nodes of the run back (a spot reclaim:
the node is drained with a deadline, and Ray Train's preemption watcher hands the notice to every
worker). The loop asks at step boundaries (`PreemptionPoll`), saves a checkpoint there and stops
every rank with `raylm.errors.Preempted`, for Ray Train to restart the run without those nodes.

Nothing here imports Ray: the env (`TrainEnv.preemption_notice`) is what asks the cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from raylm.parallel.world import World

# Ray Train's watcher asks the GCS for drained nodes every 5 s (RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S),
# so asking it more often than every second finds a notice no sooner; and each ask is a barrier of
# every rank through Ray, which a step boundary every few milliseconds should not pay each time.
POLL_S = 1.0


@dataclass(frozen=True)
class Notice:
    """Nodes being taken back, with the ranks on them, and when (UNIX time, s; None: not said)."""

    node_ranks: dict[str, list[int]]
    deadline: Optional[float]

    def passed(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline


class PreemptionPoll:
    """`poll()`: the notice `ask` returns, asked at most every `interval_s` by rank 0's clock, so
    that every rank asks at the same step boundary (`ask` is a collective on a cluster)."""

    def __init__(self, ask: Callable[[], Optional[Notice]], world: World, interval_s: float = POLL_S):
        self.ask, self.world, self.interval_s = ask, world, interval_s
        self.last = time.monotonic()

    def poll(self) -> Optional[Notice]:
        if not self.world.agree(time.monotonic() - self.last >= self.interval_s, "rank0"):
            return None
        self.last = time.monotonic()
        return self.ask()
