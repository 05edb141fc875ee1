"""A step queued on the device whose outcome the host has not read yet (`raylm.train.loop`), and
the RNG state it keeps to compute the step again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from raylm.data.stream import Batch
from raylm.train.resilience.preemption import Notice


Rng = tuple[torch.Tensor, Optional[torch.Tensor]]  # torch's CPU and CUDA generators


def rng_state() -> Rng:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def set_rng_state(state: Rng) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


@dataclass
class QueuedStep:
    """A step whose work is queued on the device and whose outcome the host has not read yet."""

    batch: Batch  # as trained: labelled with its step
    raw: Batch  # as the stream gave it: queued again, it is labelled anew
    lr: float
    record: torch.Tensor  # its verdict, loss and gradient norm on the device (raylm.train.resilience.judge)
    rng: Rng  # the RNG before its forward: the host computes it again from there
    data_wait: float  # seconds the loop waited for its batch
    mark: object  # the device's timeline once its update was queued (Timeline.mark)
    due: frozenset[str]  # the step clock's timers due at its boundary that need the model as it leaves it
    notice: Optional[Notice]  # the cluster takes nodes back: stop after this step
