"""A step queued on the device whose outcome the host has not read yet (`raylm.train.loop`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from raylm.data.stream import Batch
from raylm.train.resilience.preemption import Notice


@dataclass
class QueuedStep:
    """A step whose work is queued on the device and whose outcome the host has not read yet."""

    batch: Batch  # as trained: labelled with its step
    raw: Batch  # as the stream gave it: queued again, it is labelled anew
    lr: float
    record: torch.Tensor  # its verdict, loss and gradient norm on the device (raylm.train.resilience.judge)
    rng: tuple[torch.Tensor, Optional[torch.Tensor]]  # the RNG before its forward: the host computes it again from there
    data_wait: float  # seconds the loop waited for its batch
    mark: object  # the device's timeline once its update was queued (Timeline.mark)
    due: frozenset[str]  # the step clock's timers due at its boundary that need the model as it leaves it
    notice: Optional[Notice]  # the cluster takes nodes back: stop after this step
