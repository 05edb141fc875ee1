"""Faults injected on purpose, for drills (`benchmarks/drill.py`, the guard's panel): what a
real run meets, made to happen at a chosen step through the run's own code path."""

from __future__ import annotations

import torch

from raylm.train.hooks import Hook, Run


class NonFiniteLoss(Hook):
    """`train.inject_nonfinite`: at each given step (as metrics.jsonl numbers them), the first forward pass this process runs
    makes the final norm's output NaN, so the loss and every gradient are non-finite once (a
    transient fault: the step computed again is clean). Each step fires once per process; a
    restart that trains the step again meets it again."""

    def __init__(self, steps: list[int]):
        self.steps, self.armed, self.handles = set(steps), False, []

    def on_step_begin(self, run: Run, step: int) -> None:
        if step + 1 not in self.steps:  # the loop counts from 0, metrics.jsonl from 1
            return
        self.steps.discard(step + 1)
        self.armed = True
        for part in run.model.parts:
            if getattr(part, "norm", None) is not None:  # the last pipeline stage's part
                self.handles.append(part.norm.register_forward_hook(self._nan))

    def _nan(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            return output * float("nan")
        return output

    def on_step_end(self, run: Run, step: int, metrics: dict) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.armed = [], False

    def on_step_abandoned(self, run: Run, step: int) -> None:
        self.on_step_end(run, step, {})
