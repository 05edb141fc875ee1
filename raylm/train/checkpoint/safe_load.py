"""Checkpoint state that reads back without running code from storage.

torch 2.13's `FileSystemReader.read_metadata` reads a checkpoint's `.metadata` with a plain
`pickle.load`, and `DefaultLoadPlanner.load_bytes` reads every non-tensor entry of the state
(the optimizer's lr, betas, flags) with `torch.load(weights_only=False)`: anyone who can write
to the checkpoint's storage could run code on every rank at the next resume. The one safe
reader torch ships, `HuggingFaceStorageReader`, reads a different format (safetensors files,
tensors only, no optimizer hyperparameters) and would change what a checkpoint is. So raylm
keeps DCP's format and reads it through two small subclasses:

- `SafeReader`: `.metadata` through `raylm.train.checkpoint.metadata.read_metadata`, a
  restricted unpickler (only the classes DCP's own metadata is made of; shard paths inside the
  checkpoint).
- `SafeLoadPlanner`: non-tensor entries through `torch.load(weights_only=True)`. Tensor
  shards are already read with `weights_only=True` by DCP.

The RNG states (`rng_state`) are plain tensors and numbers, loaded with `weights_only=True`
too: numpy's and Python's generator states become int64 tensors rather than pickled objects.
"""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from raylm.train.checkpoint.metadata import read_metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = read_metadata(f.read())
        # As FileSystemReader does: the load's id goes into the metadata it hands the planner.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries read by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def rng_state() -> dict:
    """Every RNG the step may draw from, as tensors and numbers (loadable with weights_only)."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
             "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
