"""The run state a checkpoint carries besides the tensors (train_state.json): where the run is,
and what its guard and loss scaler decided. Plain data: the driver and the loop read it alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    position: int = 0  # global index of the next sample to train on
    tokens_seen: int = 0
    skip: list[list[int]] = field(default_factory=list)  # sample ranges the guard skipped (beside data.skip)
    # (dataset, shard, row) of the rows of batches the guard skipped: left out of the epochs after
    # (raylm.train.resilience.quarantine).
    quarantine: list[list[int]] = field(default_factory=list)
    lr_cap: Optional[float] = None  # the guard's ceiling on the scheduled LR, after it cut the LR
    lr_scale: float = 1.0  # the guard's factor on the whole schedule, after the run stalled at its LR
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
