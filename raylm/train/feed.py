"""The run's batches, in the order the loop queues them: a stream from the run's state (its
position, step and skip ranges), the batches a withheld step sent back first, and a new stream
where the skip ranges grew under the one running (a rollback, a quarantine)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from raylm.data.order import batch_indices
from raylm.data.stream import Batch, TokenStream


class BatchFeed:
    """The stream side of `raylm.train.loop.Trainer` (a part of it: the run's state, config, data
    source and quarantine are the trainer's); `raylm.train.replica` replaces it with a batch per
    quorum."""

    def _open_stream(self) -> None:
        """The run's batches from its current state; the guard's skip ranges grow at each rollback."""
        cfg, state, model = self.cfg, self.state, self.model
        self._take_skips()
        # An auto loader left undecided means no launch onto a cluster decided it: a run in one process.
        stream = TokenStream(self.source, self.spec.batch_schedule, model.dp_rank, model.dp_size,
                             self._skip(), engine="ray" if cfg.data.loader == "ray" else "local",
                             prefetch=cfg.data.prefetch_chunks)
        self.batches = stream.batches(state.position, state.step, self.last, state.tokens_seen // self.spec.seq_len)
        self.behind = 0  # steps the stream's labels run ahead of the run: batches skipped without a new stream

    def _take_skips(self) -> None:
        """The skip ranges a stream from the run's state leaves out, as they are now."""
        state = self.state
        self.stream_skip = [list(r) for r in state.skip]
        if self.quarantine is not None:
            self.quarantine.place(state, self._remaining_samples(), [*self.cfg.data.skip, *state.skip])
            self.quarantine.stream_started()

    def _restart_stream(self) -> None:
        self.batches.close()
        self.replay.clear()
        self._open_stream()

    def _skip(self) -> list[list[int]]:
        """Every sample range the data order leaves out: data.skip, the guard's, the quarantine's."""
        quarantined = self.quarantine.ranges() if self.quarantine is not None else []
        return [*self.cfg.data.skip, *self.state.skip, *quarantined]

    def _remaining_samples(self) -> int:
        return (self.last - self.state.step) * self.spec.batch_schedule.final

    def _next_batch(self) -> Optional[tuple[Batch, Batch]]:
        """The next batch to queue, as the stream gave it and labelled with its step (batches sent
        back by a withheld step first); None at the stream's end, or where the queued steps must be
        read before the run knows what comes next."""
        while True:
            raw = self.replay.popleft() if self.replay else next(self.batches, None)
            # Planned before the rows it would reach were quarantined: a new stream, from the run's state.
            stale = raw is not None and self.quarantine is not None and self.quarantine.stream_stale(raw.next_position)
            if raw is not None and not stale:
                return raw, dataclasses.replace(raw, step=raw.step - self.behind) if self.behind else raw
            if self.queued:  # a new stream starts where the run is: the steps in flight are read first
                if stale:
                    self.replay.appendleft(raw)
                return None
            if stale or self.behind and self.state.step < self.last:  # or the steps the skips left at the end
                self._restart_stream()
                continue
            return None

    def _stream_goes_on(self, batch: Batch) -> bool:
        """Whether the batches in flight are those a stream restarted from the run's state would
        give, one step behind their labels: after a skipped batch, at a constant batch size, when
        the skip ranges added since the stream began all end where the batch ends. A restart
        costs seconds with the ray loader (a new reader actor), and a poisoned window skips batch after batch."""
        state, schedule = self.state, self.spec.batch_schedule
        if state.step != batch.step or schedule.start is not None and \
                state.tokens_seen // self.spec.seq_len < schedule.ramp_samples:
            return False
        if any(end > batch.next_position for start, end in state.skip if [start, end] not in self.stream_skip):
            return False
        skip = self._skip()
        return batch_indices(state.position, 1, skip)[0] == batch_indices(batch.next_position, 1, skip)[0]

    def _send_back(self, later: list[Batch]) -> None:
        self.replay.extendleft(reversed(later))
