"""This process's place in the job: rank, world size, device, and agreeing on a decision."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist


@dataclass
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @staticmethod
    def current(device: Optional[torch.device] = None) -> "World":
        if dist.is_available() and dist.is_initialized():
            rank, size = dist.get_rank(), dist.get_world_size()
        else:
            rank, size = 0, 1
        local = int(os.environ.get("LOCAL_RANK", 0))
        return World(rank, size, local, device or torch.device("cpu"))

    def agree(self, flag: bool, op: Literal["all", "rank0"]) -> bool:
        """One decision for every rank: "all" is true when every rank's flag is; "rank0" is
        rank 0's flag. Ranks must take the same branches around collectives and reports."""
        if op == "rank0":
            return bool(self.from_rank0([int(flag)])[0])
        if self.world_size == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def max_of(self, values: list[int]) -> list[int]:
        """The largest of every rank's `values`, element by element (one collective): rank 0's
        values where the others give 0, or whether any rank's flag is set."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def from_rank0(self, values: list[int]) -> list[int]:
        """Rank 0's `values` on every rank (one collective)."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return t.tolist()
