"""What the loop, its hooks and the metrics share: the run's state and live objects, and the
environment the loop runs in. Below all three, so that none imports another for these."""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import ContextManager, Optional, Protocol

import torch

from raylm.config import Config
from raylm.parallel.world import World
from raylm.train.step import ParallelModel


@dataclass
class TrainState:
    """What a checkpoint's train_state.json holds besides the tensors."""

    step: int = 0  # optimizer steps completed
    position: int = 0  # global index of the next sample to train on
    tokens_seen: int = 0
    skip: list[list[int]] = field(default_factory=list)  # sample ranges the guard skipped (beside data.skip)
    lr_scale: float = 1.0  # the guard's cuts of the scheduled LR
    rollbacks: list[int] = field(default_factory=list)  # steps at which the guard rolled back
    loss_scale: Optional[float] = None  # fp16's dynamic loss scale (None: no scaling)
    # The guard's rolling history (recent healthy losses and grad norms, recent outlier steps,
    # steps skipped): without it a resumed run would judge its next steps against nothing and
    # take other decisions than the uninterrupted run.
    guard: dict = field(default_factory=dict)

    @classmethod
    def from_saved(cls, saved: dict) -> "TrainState":
        """From a checkpoint's train state; older checkpoints lack the guard's fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names})


class TrainEnv(Protocol):
    """Where the loop meets storage and the cluster (Ray Train, or plain files in tests)."""

    run_dir: str  # local directory for metrics.jsonl and TensorBoard (rank 0 writes)
    checkpoint_root: str  # where published checkpoints live (local path or s3:// URI)

    def device(self) -> torch.device:
        """The device this rank trains on."""

    def restore_dir(self, allow_none_usable: bool = False) -> ContextManager[Optional[str]]:
        """A local directory holding the newest usable checkpoint to resume from (every rank the
        same), or None; finished checkpoints all unusable are an error unless allowed."""

    def staging_dir(self, step: int) -> ContextManager[str]:
        """A local directory for this rank's part of the checkpoint of `step`."""

    def publish(self, step: int, directory: str, metrics: dict) -> str:
        """Make the staged checkpoint (every rank's part) durable; returns its URI."""

    def report(self, metrics: dict) -> None:
        """Progress for the cluster's bookkeeping (not every step: it may block)."""


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
    peak_flops: float  # per device
    history: deque = field(default_factory=lambda: deque(maxlen=1000))  # recent steps' metrics, for hooks
