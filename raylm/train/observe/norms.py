"""Activation and parameter norms every N steps, as metrics: the final layer's activation norm
was OPT's early warning of a divergence. A hook, so the steps in between pay nothing.

Activation norms are root mean squares of each block's output and of the final norm's input
(the residual stream the head reads), averaged over this rank's micro-batches; parameter norms
are each block's full L2 norm (shards and TP slices included). Rank 0 reports the blocks it
holds: under pipelining, its stages' blocks.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raylm.train.hooks import Hook, Run


def _rms(x: torch.Tensor) -> float:
    x = x.full_tensor() if isinstance(x, DTensor) else x
    return float(x.detach().float().pow(2).mean().sqrt())


def _norm(params: list[torch.Tensor]) -> float:
    squares = torch.zeros(())
    for p in params:
        value = torch.linalg.vector_norm(p.detach().float())
        squares += (value.full_tensor() if isinstance(value, DTensor) else value).cpu() ** 2
    return float(squares.sqrt())


class NormsProbe(Hook):
    def __init__(self, every: int):
        self.every = every
        self.handles: list = []
        self.sums: dict[str, list[float]] = {}
        self.step: Optional[int] = None  # the step whose activations the handles record

    def _record(self, key: str):
        def hook(module: nn.Module, args: tuple, output) -> None:
            value = args[0] if key.endswith("final") else output
            self.sums.setdefault(key, []).append(_rms(value))
        return hook

    def needs_read(self, step: int) -> bool:
        return (step + 1) % self.every == 0  # the weights as the step leaves them

    def on_step_begin(self, run: Run, step: int) -> None:
        if not self.needs_read(step):
            return
        self.sums, self.step = {}, step
        for part in run.model.parts:
            for name, block in part.layers.items():
                self.handles.append(block.register_forward_hook(self._record(f"act_norm/layer_{int(name):03d}")))
            if part.norm is not None:  # its input is the last block's output, the head's input
                self.handles.append(part.norm.register_forward_hook(self._record("act_norm/final")))

    def on_step_abandoned(self, run: Run, step: int) -> None:
        if step != self.step:  # a step queued before it ends: the handles are the later step's
            return
        for handle in self.handles:
            handle.remove()
        self.handles, self.step = [], None

    def on_step_end(self, run: Run, step: int, metrics: dict) -> None:
        if step != self.step:
            return
        self.on_step_abandoned(run, step)
        for key, values in self.sums.items():
            metrics[key] = sum(values) / len(values)
        for part in run.model.parts:  # every rank: a sharded norm is a collective
            for name, block in part.layers.items():
                metrics[f"param_norm/layer_{int(name):03d}"] = _norm(list(block.parameters()))
