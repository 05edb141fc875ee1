"""Counting host syncs: the points where the host waits for the device to hand it a value. The
training loop makes none on a steady step (`raylm.train.loop`, train.read_every); the tests and
`benchmarks/gpu_check.py` count them with this.

On a GPU, CUDA's own sync debug mode names each synchronizing operation torch makes (a copy to the
host, `.item()`, a stream synchronize). On a CPU nothing waits, so the count is of the calls that
would read a device tensor's value on a GPU (`READS`): the same code path, judged by what it asks.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

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
