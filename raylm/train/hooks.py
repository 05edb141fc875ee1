"""The hook interface of the training loop, and what hooks are handed: the run's live objects.
Health checks, the watchdog, metrics, norms and sweeps' reporters subclass `Hook` without
importing the loop."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from raylm.config import Config
from raylm.train.state import TrainState

if TYPE_CHECKING:
    import torch

    from raylm.parallel.world import World
    from raylm.train.step import ParallelModel


@dataclass
class Run:
    """The live objects of a run, handed to hooks."""

    cfg: Config
    world: World
    model: ParallelModel
    optimizer: torch.optim.Optimizer
    state: TrainState
    seq_len: int
    global_batch: int
    flops_per_token: float
    peak_flops: Optional[float]  # per device; None: a GPU model without a known peak
    restored_world_size: Optional[int] = None  # of the checkpoint the run resumed from (None: a fresh start)
    restore_read_bytes: list[int] = field(default_factory=list)  # each rank's reads of that checkpoint
    history: deque = field(default_factory=lambda: deque(maxlen=1000))  # recent steps' metrics, for hooks


class Hook:
    """Callbacks around each step."""

    # A hook that only reads a step's metrics, and whose call may be its process's last (a report
    # to Tune, whose scheduler may end the trial there), is called after they are written out.
    after_metrics_written: bool = False

    def on_train_start(self, run: Run) -> None: ...

    def on_step_begin(self, run: Run, step: int) -> None:
        """When the step is queued. The loop queues steps ahead of reading them (train.read_every):
        a step may begin again after `on_step_abandoned`, and `run.state` is the last read step's."""

    def needs_read(self, step: int) -> bool:
        """Whether `on_step_end(step)` must see the model as that step leaves it (its weights, a
        profiler stopped after it): the loop then reads the step before it queues the next."""
        return False

    def on_step_end(self, run: Run, step: int, metrics: dict) -> None:
        """When the step is read, in step order: later steps may already be queued."""

    def on_step_abandoned(self, run: Run, step: int) -> None:
        """The step began but never ends: the stability guard rolled the run back in it.
        Release what on_step_begin took (its metrics are not written)."""

    def on_train_end(self, run: Run, metrics: dict) -> None: ...
