"""A point for the stability guard to return to: a rank's weights and optimizer state in host
memory, the RNG, and the run state (`raylm.train.resilience.guard`); and the guard's evidence, with
its snapshot, which a replica group that heals takes from its peer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from raylm.train.state import TrainState


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Snapshot:
    """A point to return to: this rank's shards of the weights and optimizer state, copied to host
    memory, the RNG, and the train state."""

    state: TrainState
    params: list[torch.Tensor]
    optim: list[dict]
    rng: torch.Tensor
    cuda_rng: Optional[torch.Tensor]

    @classmethod
    def take(cls, state: TrainState, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> "Snapshot":
        copy = lambda t: _local(t).detach().to("cpu", copy=True) if torch.is_tensor(t) else t  # noqa: E731
        return cls(copy_state(state), [copy(p) for p in params],
                   [{k: copy(v) for k, v in optimizer.state[p].items()} for p in params],
                   torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)

    def restore(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for p, saved in zip(params, self.params):
                _local(p).copy_(saved)
            for p, saved in zip(params, self.optim):
                state = optimizer.state[p]
                if not saved:  # taken before the first step: the optimizer starts afresh
                    state.clear()
                for k, v in saved.items():  # in place: the state keeps its types (DTensor or plain)
                    if torch.is_tensor(v):
                        _local(state[k]).copy_(v)
                    else:
                        state[k] = v
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng)

    def to_dict(self) -> dict:
        """Tensors in plain dicts and lists, as torchft's transport sends a state (a healing replica group)."""
        return {**vars(self), "state": dict(vars(self.state))}

    @classmethod
    def from_dict(cls, d: dict) -> "Snapshot":
        """`to_dict`'s, its tensors back in host memory (a transport receives them on the device)."""
        host = lambda t: t.to("cpu") if torch.is_tensor(t) else t  # noqa: E731
        return cls(TrainState(**d["state"]), [host(p) for p in d["params"]],
                   [{k: host(v) for k, v in o.items()} for o in d["optim"]], host(d["rng"]), host(d["cuda_rng"]))


@dataclass
class Evidence:
    """What a guard judges by beyond the run state's history: its snapshot, its start (the snapshot
    and canary it may go back to while at the unigram level), the recent steps (samples, loss) and
    the suspects. A replica group that heals takes its peer's, so that the two decide alike."""

    snapshot: Snapshot
    reference: float
    origin: Optional[tuple[Snapshot, float]]
    recent: list[tuple[list[int], float]]
    suspects: list[list[int]]

    def to_dict(self) -> dict:
        """As torchft's transport sends it; the origin, most often the snapshot itself, once."""
        origin = None if self.origin is None else {
            "snapshot": None if self.origin[0] is self.snapshot else self.origin[0].to_dict(), "canary": self.origin[1]}
        return {"snapshot": self.snapshot.to_dict(), "reference": self.reference, "origin": origin,
                "recent": [[list(samples), loss] for samples, loss in self.recent], "suspects": self.suspects}

    @classmethod
    def from_dict(cls, d: dict) -> "Evidence":
        snapshot, origin = Snapshot.from_dict(d["snapshot"]), d["origin"]
        if origin is not None:
            origin = (snapshot if origin["snapshot"] is None else Snapshot.from_dict(origin["snapshot"]), origin["canary"])
        return cls(snapshot, d["reference"], origin, [(list(s), loss) for s, loss in d["recent"]],
                   [list(s) for s in d["suspects"]])


def copy_state(state: TrainState) -> TrainState:
    """`state` with its lists and dicts copied: a snapshot's must not change with the run's."""
    return dataclasses.replace(state, skip=[list(r) for r in state.skip], rollbacks=list(state.rollbacks),
                               quarantine=[list(r) for r in state.quarantine], guard=dict(state.guard))
