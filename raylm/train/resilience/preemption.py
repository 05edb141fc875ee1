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
from typing import Callable, NoReturn, Optional

from raylm.errors import Preempted
from raylm.parallel.world import World
from raylm.train.checkpoint.policy import Checkpointer


@dataclass(frozen=True)
class Notice:
    """Nodes being taken back, with the ranks on them, and when (UNIX time, s; None: not said)."""

    node_ranks: dict[str, list[int]]
    deadline: Optional[float]

    def passed(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline


def stop_for_preemption(notice: Notice, step: int, checkpointer: Checkpointer, world: World,
                        save: Callable[[], None]) -> NoReturn:
    """Nodes of the run are being taken back: a checkpoint of this step boundary (`save`, unless
    this step's own is already written, or the deadline has passed), then every rank stops with
    `Preempted`, for Ray Train to restart the run from it without those nodes. Stopping, not
    training on until the node goes: a step after the save would be trained again."""
    checkpointer.wait()
    # Rank 0's clock decides for all: the save is collective.
    if world.agree(checkpointer.published_step != step and not notice.passed(), "rank0"):
        save()
        checkpointer.wait()
    # Also a barrier: rank 0 gets here only once it has finalized the checkpoint, which a rank
    # stopping sooner could otherwise have Ray Train tear down half-written.
    saved = world.agree(checkpointer.published_step == step, "all")
    raise Preempted(notice.node_ranks, notice.deadline, step, saved)
