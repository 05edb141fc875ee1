"""The guard's quarantine: the rows of a batch it skipped, left out when they come round again.

A run of several epochs (a laptop's, a sweep's, the drill's) meets each row once an epoch. A
batch the guard skipped as damaging would be judged again at every meeting, at the price of a
forward, a backward and canary passes each time, and skipped again. With `guard.quarantine`, the
rows (dataset, shard, row) of a skipped batch join the run state (`TrainState.quarantine`), and
their positions in the epochs after are left out of the data order as skip ranges are. Each
position passed over joins the skip ranges (`TrainState.skip`: the run's record of what it left
out, which resumes, audits and `skipped_samples` read) with a `samples_quarantined` event. Only a
skipped batch's rows: a rollback's left-out ranges hold clean data beside the suspects.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from raylm.data.order import SampleOrder, merge_ranges
from raylm.train.observe.records import append_event
from raylm.train.state import TrainState


def _ranges(positions: np.ndarray) -> list[list[int]]:
    """Sorted positions as [start, end) ranges of consecutive ones."""
    if not len(positions):
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return [[int(run[0]), int(run[-1]) + 1] for run in np.split(positions, breaks)]


def _covered(ranges: list[list[int]], lo: int, hi: int) -> int:
    """Positions of [lo, hi) inside the ranges (where ranges overlap, more: an upper bound)."""
    return sum(max(0, min(end, hi) - max(start, lo)) for start, end in ranges)


class Quarantine:
    """The quarantined rows' positions ahead of the run, and the stream that knows them."""

    def __init__(self, order: SampleOrder, events_path: str, rank: int):
        self.order, self.events_path, self.rank = order, events_path, rank
        self.positions = np.empty(0, dtype=np.int64)  # sorted: where the rows come round, ahead of the run
        self.stream_valid_until: Optional[int] = None  # the first position the stream in flight does not know

    def ranges(self) -> list[list[int]]:
        return _ranges(self.positions)

    def place(self, state: TrainState, remaining: int, skip: list[list[int]]) -> None:
        """Find the rows' positions from the run's position to as far as its `remaining` samples
        can reach past every position left out (`skip`, and the quarantine's own)."""
        lo, hi, rows = state.position, state.position, np.asarray(state.quarantine, dtype=np.int64)
        if not len(rows):
            self.positions = np.empty(0, dtype=np.int64)
            return
        for _ in range(16):  # each pass reaches past what the last one found left out; a bound for the absurd
            reach = lo + remaining + _covered(skip, lo, hi) + len(self.positions)
            if reach <= hi:
                break
            hi = reach
            self.positions = self.order.positions_of(rows, lo, hi)

    def stream_started(self) -> None:
        self.stream_valid_until = None

    def add(self, state: TrainState, indices: list[int], after: int, remaining: int, skip: list[list[int]]) -> None:
        """The rows at the global `indices` (a skipped batch's) are quarantined. The stream in flight
        was planned without their later positions: it is good up to the first of them (all lie
        past `after`, the skipped batch's end)."""
        dataset, shards, rows = self.order.locate_many(indices)
        quarantined = {tuple(r) for r in state.quarantine} | set(zip(dataset.tolist(), shards.tolist(), rows.tolist()))
        state.quarantine = [list(r) for r in sorted(quarantined)]
        before = self.positions
        self.place(state, remaining, skip)
        new = np.setdiff1d(self.positions, before)
        new = new[new >= after]
        if len(new):
            first = int(new[0])
            self.stream_valid_until = first if self.stream_valid_until is None else min(self.stream_valid_until, first)

    def stream_stale(self, next_position: int) -> bool:
        """Whether a batch that ends before `next_position` may hold a position the stream did not know."""
        return self.stream_valid_until is not None and next_position > self.stream_valid_until

    def pass_over(self, state: TrainState, step: int, to: int) -> None:
        """The run moves from its position to `to`: the quarantined positions between that its skip
        ranges do not yet hold join them, with an event."""
        ahead = self.positions[np.searchsorted(self.positions, state.position):np.searchsorted(self.positions, to)]
        if not len(ahead):
            return
        held = np.zeros(len(ahead), dtype=bool)
        for start, end in state.skip:
            held |= (ahead >= start) & (ahead < end)
        passed = _ranges(ahead[~held])
        if not passed:
            return
        state.skip = merge_ranges([*state.skip, *passed])
        if self.rank == 0:
            append_event(self.events_path, {"event": "samples_quarantined", "time": time.time(), "step": step,
                                            "samples": passed, "count": sum(end - start for start, end in passed)})
