"""Decisions by time that every rank must take at the same step boundary: a report to Ray Train
every `train.report_every_s`, a save every `checkpoint.every_minutes`, asking the cluster whether it
takes nodes back, publishing an async save once every rank has written it. Rank 0's clock decides;
the ranks agree at ticks about TICK_S apart, spaced in steps by rank 0's recent step time, in one
collective and one host sync a tick, so that the steps between ticks pay none (asking at every
boundary was one broadcast, and on a GPU one more host sync, per timer per step).
"""

from __future__ import annotations

import time
from typing import Callable, Union

import torch

from raylm.parallel.world import World

# Ray Train's preemption watcher asks the GCS for drained nodes every 5 s, reports are every 30 s by
# default and saves by the minute: a second between ticks delays none of them noticeably.
TICK_S = 1.0
MAX_TICK_STEPS = 100  # a step time that grows (evaluation, a slower phase) is met within this many steps


class StepClock:
    """`add(name, due)` a timer: `due()` runs on rank 0 at a tick and says whether it is time (its
    own clock, e.g. seconds since the timer's last event). `tick()`, called at every step boundary
    on every rank, returns the names of the timers due there, the same on every rank."""

    def __init__(self, world: World, tick_s: float = TICK_S):
        self.world, self.tick_s = world, tick_s
        self.timers: dict[str, Callable[[], bool]] = {}
        self.countdown = 0  # boundaries until the next tick (0: this one)
        self.ticks = 0  # ticks so far: the collectives this clock made
        self.last: tuple[int, float] | None = None  # (boundaries seen, time) at the last tick
        self.seen = 0  # step boundaries so far (a step the guard rolled back or skipped is none)
        self.ticked = False  # whether the last boundary was a tick (the ranks' one collective)
        self.any_waiting = False  # at the last tick, whether any rank waited (`tick(waiting=...)`)

    def add(self, name: str, due: Callable[[], bool]) -> None:
        self.timers[name] = due

    def tick(self, waiting: bool = False) -> frozenset[str]:
        """`waiting`: this rank still waits on something every rank must have finished (an async
        save being written); after a tick, `any_waiting` says whether any rank does, from the same
        collective."""
        self.seen += 1
        self.ticked = self.countdown <= 0
        if not self.ticked:
            self.countdown -= 1
            return frozenset()
        names = sorted(self.timers)
        now = time.monotonic()
        mine = [int(self.timers[name]()) for name in names] + [self._gap(now)] if self.world.rank == 0 else \
            [0] * (len(names) + 1)
        *flags, gap, waiting_anywhere = self.world.max_of([*mine, int(waiting)])
        self.any_waiting = bool(waiting_anywhere)
        self.last = (self.seen, now)
        self.countdown = gap - 1
        self.ticks += 1
        return frozenset(name for name, flag in zip(names, flags) if flag)

    def _gap(self, now: float) -> int:
        """Boundaries to the next tick, by rank 0's time per boundary since the last one."""
        if self.last is None:
            return 1
        seen, then = self.last
        per_step = (now - then) / max(1, self.seen - seen)
        return max(1, min(MAX_TICK_STEPS, int(self.tick_s / per_step) if per_step > 0 else MAX_TICK_STEPS))


class Timeline:
    """Points on the device's timeline, for step times taken without waiting for the device: on a
    GPU, events recorded as each step's work is queued, whose distances are read once the host has
    waited for them anyway (`read`); a CPU runs the work as it is queued, and its clock is the
    timeline."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Union[float, torch.cuda.Event]:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Union[float, torch.cuda.Event], end: Union[float, torch.cuda.Event]) -> float:
        """Between two marks, both passed (on a GPU: marked before the last `read`)."""
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    def read(self, values: torch.Tensor) -> list:
        """`values` on the host, once everything queued so far has run (every mark passed): the
        loop's one host sync per read."""
        if not self.cuda:
            return values.tolist()
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host.tolist()
