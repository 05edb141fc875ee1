"""raylm's two kinds of error, told apart by what a restart of the worker group can do about them.

- Retryable: a worker or node died, a network or storage hiccup, an OOM kill, a hung step. Ray
  Train restarts the worker group from the latest checkpoint, up to `run.max_failures` times.
- Deterministic (`DeterministicError` and its subclasses): the same input fails the same way on
  every attempt. A config or data error, a guard stop, a full disk after its retries, an
  incompatible, missing or corrupt checkpoint, a corrupt record, a run that diverged with the
  guard off. The run ends at the first one: `raylm.launch.recovery` tells Ray Train not to
  restart, `events.jsonl` records it, and the CLI prints its one line (`raylm: error: ...`) and
  exits with its `exit_code`: 2 for what the user gave (a config, a dataset, a path), 1 otherwise.

Subclasses live beside the code that raises them (`CheckpointError` with the checkpoint format,
`GuardStopped` with the guard); all are importable without torch, since Ray Train's controller
unpickles a worker's error to decide.

A third outcome is no error of the run: `Preempted`, raised by every rank once it has saved
ahead of a node reclaim.
"""

from __future__ import annotations

import time
from typing import Optional


class DeterministicError(Exception):
    """An error that a restart cannot cure: the run ends on its first occurrence."""

    exit_code = 1

    def __init__(self, *args: object):
        super().__init__(*args)
        # Its message as raised. Ray Data appends retry advice to the message of an error raised in
        # its task ("... configure DataContext ... if you believe this to be transient"): wrong for
        # an error no retry cures. Kept through pickling, in the instance's state.
        self._message = str(args[0]) if len(args) == 1 else super().__str__()

    def __str__(self) -> str:
        return self._message


class ConfigError(DeterministicError, ValueError):
    """A configuration value or key that cannot be used; the message names it."""

    exit_code = 2


class DivergedError(DeterministicError, FloatingPointError):
    """The loss or gradient turned non-finite (or fp16's loss scale collapsed) with the stability
    guard off: replaying the same steps would diverge again."""


class RecordError(DeterministicError, ValueError):
    """A run record (metrics.jsonl, events.jsonl, the run's lease) that cannot be read; the
    message names the file and line."""


class RunFailedError(DeterministicError):
    """Ray Train gave up on the run after `run.max_failures` restarts; the message names the last
    failure of each rank."""


class RunInterrupted(Exception):
    """The user stopped the run (Ctrl-C, or a SIGTERM from `ray job stop`, Kubernetes or Slurm):
    its workers were aborted, its checkpoints stay, and the same command resumes from the last one.
    Exit status 128 + the signal's number, as a shell gives: 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


class Preempted(Exception):
    """The cluster is taking nodes of the run back (a spot reclaim, announced by a drain with a
    deadline): every rank stopped at the same step boundary after saving a checkpoint there, so
    that Ray Train restarts the worker group from it without those nodes. Neither kind above:
    the restart counts against `run.max_preemptions`, not `run.max_failures`
    (`raylm.launch.recovery`)."""

    def __init__(self, node_ranks: dict[str, list[int]], deadline: Optional[float], step: int, saved: bool):
        self.node_ranks, self.deadline, self.step, self.saved = node_ranks, deadline, step, saved
        left = "no deadline given" if deadline is None else f"deadline {deadline - time.time():+.0f} s"
        super().__init__(f"node(s) {', '.join(sorted(node_ranks))} preempted ({left}); "
                         + (f"saved step {step}" if saved else f"no checkpoint could be saved at step {step}"))

    def __reduce__(self):  # the controller unpickles it with its fields, not the message alone
        return type(self), (self.node_ranks, self.deadline, self.step, self.saved)
