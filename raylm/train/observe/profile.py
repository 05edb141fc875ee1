"""Profiles on demand (`train.profile`): a PyTorch profiler trace of chosen steps, one
Chrome/Perfetto JSON file per rank in `<run>/profile/`, and on CUDA with `memory` a snapshot of
the allocator's history. A hook that the loop adds only when the run asks for one, so the other
steps pay nothing: the profiler starts in the first profiled step's `on_step_begin` and stops
after the last one's `on_step_end`, or earlier when a step is abandoned (a guard rollback) or
the run ends. Each invocation profiles once; a restart into the range profiles what is left.

In the trace, each profiled step is a span `step N` (N as metrics.jsonl counts steps), and each
model part's forward and backward per micro-batch a span `forward` / `backward`, around the
operators (`aten::mm`, ...). Rank 0 records a `profile` event naming every rank's files, which
`raylm report` links. Open a trace in https://ui.perfetto.dev or chrome://tracing, a snapshot
in https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity

from raylm.config import ProfileConfig, StorageConfig
from raylm.data import storage
from raylm.train.hooks import Hook, Run
from raylm.train.observe.records import EVENTS_FILE, PROFILE_DIR, append_event

SNAPSHOT_ENTRIES = 100_000  # allocator events the CUDA history keeps (torch's own example's size)


def trace_name(rank: int) -> str:
    return f"rank_{rank:05d}.trace.json"


def snapshot_name(rank: int) -> str:
    return f"rank_{rank:05d}.memory.pickle"


class _Spans:
    """`forward` and `backward` spans of each part per micro-batch, as module hooks that exist only
    while the profiler runs. Backward's span opens when the part's output gets its gradient and
    closes when that backward pass ends."""

    def __init__(self, parts: list[torch.nn.Module]):
        self.open: list[record_function] = []
        self.handles = [h for part in parts for h in (part.register_forward_pre_hook(self._forward_begins),
                                                      part.register_forward_hook(self._forward_ends))]

    def _forward_begins(self, module: torch.nn.Module, args: tuple) -> None:
        self.open.append(record_function("forward").__enter__())

    def _forward_ends(self, module: torch.nn.Module, args: tuple, output) -> None:
        if self.open:
            self.open.pop().__exit__(None, None, None)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._backward_begins)

    def _backward_begins(self, grad: torch.Tensor) -> None:
        span = record_function("backward").__enter__()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: span.__exit__(None, None, None))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        while self.open:  # a forward that raised
            self.open.pop().__exit__(None, None, None)


class ProfileHook(Hook):
    """Profile steps [start_step, start_step + steps) of metrics.jsonl's count into
    `run_dir/profile/`; a copy goes to `run_uri/profile/` when the run lives on S3."""

    def __init__(self, profile: ProfileConfig, run_dir: str, run_uri: str,
                 storage_cfg: Optional[StorageConfig] = None):
        self.first = profile.start_step - 1  # hooks count steps from 0, metrics.jsonl from 1
        self.last = self.first + profile.steps - 1
        self.memory = profile.memory
        self.run_dir, self.run_uri, self.storage_cfg = run_dir, run_uri, storage_cfg
        self.profiler: Optional[torch.profiler.profile] = None
        self.step_span: Optional[record_function] = None
        self.spans: Optional[_Spans] = None
        self.started_at: Optional[int] = None  # the first step profiled, as metrics.jsonl counts
        self.done = False

    def _cuda_memory(self, run: Run) -> bool:
        return self.memory and run.world.device.type == "cuda"

    def needs_read(self, step: int) -> bool:
        return step == self.last  # the trace ends with the last profiled step, not the ones queued after it

    def on_step_begin(self, run: Run, step: int) -> None:
        if self.done or not self.first <= step <= self.last:
            return
        if self.profiler is None:
            self._start(run, step)
        if self.step_span is not None:  # the step before, queued ahead of its read: its host work ends here
            self.step_span.__exit__(None, None, None)
        self.step_span = record_function(f"step {step + 1}").__enter__()

    def _start(self, run: Run, step: int) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.world.device.type == "cuda" else [])
        if self._cuda_memory(run):
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                               profile_memory=self.memory)
        self.profiler.start()
        self.spans = _Spans(run.model.parts)
        self.started_at = step + 1

    def on_step_end(self, run: Run, step: int, metrics: dict) -> None:
        if self.profiler is not None and step >= self.last:
            self._stop(run, step + 1)
        elif self.step_span is not None:
            self.step_span.__exit__(None, None, None)
            self.step_span = None

    def on_step_abandoned(self, run: Run, step: int) -> None:
        """A rollback: the trace so far is written, and the steps trained again are not profiled."""
        if self.profiler is not None:
            self._stop(run, step + 1)

    def on_train_end(self, run: Run, metrics: dict) -> None:
        if self.profiler is not None:  # the run ended inside the range (train.stop_at_step)
            self._stop(run, run.state.step)

    def _stop(self, run: Run, last_step: int) -> None:
        """Stop, write this rank's files and, on rank 0, the event (last_step: the last step in
        the files, as metrics.jsonl counts)."""
        if self.step_span is not None:
            self.step_span.__exit__(None, None, None)
            self.step_span = None
        self.spans.remove()
        self.profiler.stop()
        self._write(run)
        self.profiler, self.spans, self.done = None, None, True
        if run.world.rank == 0:
            ranks = range(run.world.world_size)
            names = [trace_name(r) for r in ranks]
            names += [snapshot_name(r) for r in ranks] if self._cuda_memory(run) else []
            append_event(os.path.join(self.run_dir, EVENTS_FILE),
                         {"event": "profile", "time": time.time(), "step": self.started_at, "last_step": last_step,
                          "files": [f"{PROFILE_DIR}/{name}" for name in names]})

    def _write(self, run: Run) -> None:
        directory = os.path.join(self.run_dir, PROFILE_DIR)
        os.makedirs(directory, exist_ok=True)
        written = [os.path.join(directory, trace_name(run.world.rank))]
        self.profiler.export_chrome_trace(written[0])
        if self._cuda_memory(run):
            written.append(os.path.join(directory, snapshot_name(run.world.rank)))
            torch.cuda.memory._dump_snapshot(written[-1])
            torch.cuda.memory._record_memory_history(enabled=None)
        if storage.is_s3(self.run_uri):  # the run directory is on S3; run_dir is its local mirror
            for path in written:
                with open(path, "rb") as f:
                    storage.write_bytes(storage.join(self.run_uri, PROFILE_DIR, os.path.basename(path)), f.read(),
                                        self.storage_cfg)
