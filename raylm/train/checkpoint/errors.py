"""The errors of a checkpoint that cannot be used, or could not be written."""

from __future__ import annotations

from raylm.errors import DeterministicError


class CheckpointError(DeterministicError, ValueError):
    """A checkpoint that cannot be used as it is; the message names it and the file."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files are not what its manifest records, or that lacks a file it needs:
    resuming passes over it for the previous one. Raised on every rank together by `load`."""

    def __init__(self, uri: str, problem: str):
        super().__init__(f"checkpoint {uri} cannot be used: {problem}")
        self.uri, self.problem = uri, problem

    def __reduce__(self):  # crosses ranks pickled, inside DCP's gathered failures
        return type(self), (self.uri, self.problem)


class UnusableCheckpointsError(CheckpointError):
    """The run directory holds finished checkpoints, and none of them can be used."""


class CheckpointWriteError(DeterministicError, RuntimeError):
    """A checkpoint could not be written after its retries (a full disk, storage refusing writes);
    training stops rather than go on unprotected."""
