"""Where the training loop meets storage and the cluster: the `TrainEnv` protocol, and `LocalEnv`,
the loop on plain files without Ray (tests, benchmarks, sweeps' trials, debugging). The Ray
Train one is `raylm.launch.worker.RayTrainEnv`."""

from __future__ import annotations

import contextlib
import os
from typing import Callable, ContextManager, Iterator, Optional, Protocol, TypeVar

import torch

from raylm.parallel.world import World
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.resume import load_latest
from raylm.train.observe.records import EVENTS_FILE
from raylm.train.resilience.preemption import Notice

T = TypeVar("T")


class TrainEnv(Protocol):
    run_dir: str  # local directory for metrics.jsonl and TensorBoard (rank 0 writes)
    checkpoint_root: str  # where published checkpoints live (local path or s3:// URI)

    def device(self) -> torch.device:
        """The device this rank trains on."""

    def restore(self, load: Callable[[str], T], allow_none_usable: bool = False) -> Optional[T]:
        """`load(uri)` of the newest usable checkpoint (a local path or s3:// URI, read where it
        lies), on every rank together, or None when there is none; finished checkpoints all
        unusable are an error unless allowed (`raylm.train.checkpoint.resume.load_latest`)."""

    def staging_dir(self, step: int) -> ContextManager[str]:
        """A local directory for this rank's part of the checkpoint of `step`."""

    def publish(self, step: int, directory: str) -> str:
        """Make this rank's staged part of the checkpoint durable; returns the checkpoint's URI.
        Raises OSError when storage cannot take it (a full disk)."""

    def announce(self, step: int, metrics: dict) -> None:
        """Tell the cluster's bookkeeping of the checkpoint of `step`, published and finalized."""

    def report(self, metrics: dict) -> None:
        """Progress for the cluster's bookkeeping (not every step: it may block)."""

    def preemption_notice(self) -> Optional[Notice]:
        """The cluster's notice that it takes nodes of the run back, the same on every rank (all
        ranks call it together), or None."""


class LocalEnv:
    """Checkpoints go straight into `run_dir/checkpoint_<step, 8 digits>` (all ranks share the disk).

    Resuming takes the newest checkpoint whose files match its manifest (checksums included, of
    what each rank reads); rank 0 reports each one passed over (stderr and events.jsonl).
    Finished checkpoints that are all unusable stop the run unless `allow_none_usable`."""

    def __init__(self, run_dir: str, use_gpu: bool = False):
        self.run_dir, self.use_gpu = run_dir, use_gpu
        self.checkpoint_root = run_dir
        os.makedirs(run_dir, exist_ok=True)

    def device(self) -> torch.device:
        if self.use_gpu:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")

    def restore(self, load: Callable[[str], T], allow_none_usable: bool = False) -> Optional[T]:
        world = World.current(self.device())
        events = os.path.join(self.run_dir, EVENTS_FILE) if world.rank == 0 else None
        return load_latest(self.run_dir, load, agree=lambda ok: world.agree(ok, "all"),
                           allow_none_usable=allow_none_usable, events_path=events)

    @contextlib.contextmanager
    def staging_dir(self, step: int) -> Iterator[str]:
        directory = os.path.join(self.run_dir, checkpoint.dir_name(step))
        yield directory  # ranks share the disk: each writes its part in place

    def publish(self, step: int, directory: str) -> str:
        return directory

    def announce(self, step: int, metrics: dict) -> None:
        pass

    def report(self, metrics: dict) -> None:
        pass

    def preemption_notice(self) -> Optional[Notice]:
        return None  # no cluster takes its nodes back
