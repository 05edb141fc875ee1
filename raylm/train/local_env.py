"""A `TrainEnv` on plain files: the loop without Ray, for tests, benchmarks and debugging."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from raylm.train import checkpoint


class LocalEnv:
    """Checkpoints go straight into `run_dir/checkpoint_<step, 8 digits>` (all ranks share the disk)."""

    def __init__(self, run_dir: str, resume: bool = True, use_gpu: bool = False):
        self.run_dir, self.resume, self.use_gpu = run_dir, resume, use_gpu
        self.checkpoint_root = run_dir
        os.makedirs(run_dir, exist_ok=True)

    def device(self) -> torch.device:
        if self.use_gpu:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")

    @contextlib.contextmanager
    def restore_dir(self) -> Iterator[Optional[str]]:
        yield checkpoint.latest_complete(self.run_dir) if self.resume else None

    @contextlib.contextmanager
    def staging_dir(self, step: int) -> Iterator[str]:
        directory = os.path.join(self.run_dir, checkpoint.dir_name(step))
        yield directory  # ranks share the disk: each writes its part in place

    def publish(self, step: int, directory: str, metrics: dict) -> str:
        return directory

    def report(self, metrics: dict) -> None:
        pass
