"""What a step costs beside its arithmetic: host syncs (the points where the host waits for the
device to hand it a value) and collectives. The training loop makes neither on a steady step but
the collectives of its forward and backward (`raylm.train.loop`, train.read_every); the tests,
`benchmarks/gpu_check.py` and `benchmarks/scale_costs.py` count them with `StepCosts`.

On a GPU, CUDA's own sync debug mode names each synchronizing operation torch makes (a copy to the
host, `.item()`, a stream synchronize). On a CPU nothing waits, so the count is of the calls that
would read a device tensor's value on a GPU (`READS`): the same code path, judged by what it asks.
Collectives are the torch.distributed calls of the training thread, those made inside a
`forward_backward` (the model's: gradient reductions, the loss's mean) apart from the rest.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from raylm.train.hooks import Hook, Run

# Tensor methods and functions that hand a tensor's value (or a shape that depends on it) to the host.
READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__",
                   "nonzero", "equal", "allclose", "unique", "masked_select"})
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


class _Reads(TorchFunctionMode):
    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            self.counter.count += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """`start()`, run code, `stop()`: `count` holds the host syncs it made (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.count = 0
        self._mode: Optional[_Reads] = None
        self._show = None

    def start(self) -> None:
        if self.cuda:
            self._show = warnings.showwarning
            warnings.filterwarnings("always", message=f".*{CUDA_SYNC_WARNING}")
            warnings.showwarning = self._warned
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._mode = _Reads(self)
            self._mode.__enter__()

    def _warned(self, message, category, filename, lineno, file=None, line=None) -> None:
        if CUDA_SYNC_WARNING in str(message):
            self.count += 1
        else:
            self._show(message, category, filename, lineno, file, line)

    def stop(self) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._show
        else:
            self._mode.__exit__(None, None, None)


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce_scatter_tensor", "barrier", "gather", "scatter")


def _in_forward_backward() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "forward_backward":
            return True
        frame = frame.f_back
    return False


class CollectiveCounter:
    """`start()`, run code, `stop()`: the torch.distributed collectives the starting thread called,
    by name, in `model` (inside a forward_backward) and `loop` (the rest). Other threads' (an async
    save's writer, on its own process group) are not the loop's and are not counted."""

    def __init__(self):
        self.model: list[str] = []
        self.loop: list[str] = []
        self._originals: dict = {}

    def start(self) -> None:
        thread = threading.get_ident()
        for name in COLLECTIVES:
            original = self._originals[name] = getattr(dist, name)

            def counted(*args, _original=original, _name=name, **kwargs):
                if threading.get_ident() == thread:
                    (self.model if _in_forward_backward() else self.loop).append(_name)
                return _original(*args, **kwargs)
            setattr(dist, name, counted)

    def stop(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


class StepCosts(Hook):
    """Per step, from its queueing to the next one's (hooks see steps begin as they are queued): its
    host syncs, and its collectives in the loop and in the model (`CollectiveCounter`). The last
    step's run to the end of training."""

    def __init__(self):
        self.syncs: dict[int, int] = {}
        self.loop: dict[int, list[str]] = {}
        self.model: dict[int, list[str]] = {}
        self.step: Optional[int] = None

    def on_train_start(self, run: Run) -> None:
        self.syncs_counter, self.collectives = HostSyncCounter(run.world.device), CollectiveCounter()
        self.syncs_counter.start()
        self.collectives.start()

    def on_step_begin(self, run: Run, step: int) -> None:
        self._close()
        self.step = step

    def _close(self) -> None:
        if self.step is not None:
            self.syncs[self.step] = self.syncs_counter.count
            self.loop[self.step], self.model[self.step] = list(self.collectives.loop), list(self.collectives.model)
        self.syncs_counter.count = 0
        self.collectives.loop.clear()
        self.collectives.model.clear()

    def on_train_end(self, run: Run, metrics: dict) -> None:
        self._close()
        self.syncs_counter.stop()
        self.collectives.stop()

    def summary(self, steps: Iterable[int], read: set[int]) -> dict:
        """Per step of `steps` (the steady ones: past the start, before the last, whose count holds
        the end of the run), of those the loop did not read after and of those it did (`read`):
        host syncs, the loop's collectives, the model's."""
        def mean(values: list) -> Optional[float]:
            return sum(values) / len(values) if values else None
        steady = [s for s in steps if s in self.syncs and s not in read]
        reads = [s for s in steps if s in self.syncs and s in read]
        return {"host_syncs_per_step": mean([self.syncs[s] for s in steady]),
                "collectives_per_step": mean([len(self.loop[s]) for s in steady]),
                "model_collectives_per_step": mean([len(self.model[s]) for s in steady]),
                "host_syncs_per_read": mean([self.syncs[s] for s in reads]),
                "collectives_per_read": mean([len(self.loop[s]) for s in reads]),
                "steps_counted": len(steady), "reads_counted": len(reads)}
