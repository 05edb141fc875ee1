"""Checkpoint state that reads back without running code from storage.

torch 2.13's `FileSystemReader.read_metadata` reads a checkpoint's `.metadata` with a plain
`pickle.load`, and `DefaultLoadPlanner.load_bytes` reads every non-tensor entry of the state
(the optimizer's lr, betas, flags) with `torch.load(weights_only=False)`: anyone who can write
to the checkpoint's storage could run code on every rank at the next resume. The one safe
reader torch ships, `HuggingFaceStorageReader`, reads a different format (safetensors files,
tensors only, no optimizer hyperparameters) and would change what a checkpoint is. So raylm
keeps DCP's format and reads it through two small subclasses:

- `SafeReader`: `.metadata` through `MetadataUnpickler`, a `pickle.Unpickler` whose
  `find_class` admits only the classes DCP's own metadata is made of (the dataclasses of
  `torch.distributed.checkpoint.metadata`, `filesystem._StorageInfo`, `torch.Size`, dtypes and
  layouts, `pathlib` paths); any other global, such as `os.system`, is refused before it is
  looked up. Shard paths must stay inside the checkpoint directory.
- `SafeLoadPlanner`: non-tensor entries through `torch.load(weights_only=True)`. Tensor
  shards are already read with `weights_only=True` by DCP.

The RNG states (`rng_state`) are plain tensors and numbers, loaded with `weights_only=True`
too: numpy's and Python's generator states become int64 tensors rather than pickled objects.
"""

from __future__ import annotations

import io
import pickle
import posixpath
import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    *((_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                          "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                          "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided")
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory it was saved to
    ("pathlib", "PurePosixPath"),
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint's metadata names something DCP's metadata never holds: refused unread."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"refusing to load {module}.{name}: not a class of DCP's metadata")


def read_metadata(data: bytes) -> Metadata:
    """DCP metadata from the bytes of a `.metadata` file; raises `pickle.UnpicklingError` (or
    `UnsafeCheckpointError`) when they are not DCP metadata or name a file outside the checkpoint."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # truncated or garbled: EOFError, ValueError, TypeError, ...
        raise pickle.UnpicklingError(f"not a DCP metadata file ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"not a DCP metadata file (holds a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not is_inside(path):
            raise UnsafeCheckpointError(f"refusing shard path {path!r}: it must name a file inside the checkpoint")
    return metadata


def is_inside(relative_path: str) -> bool:
    """A path that names a file inside its directory: relative, no `..`, no backslashes."""
    if not relative_path or "\\" in relative_path or posixpath.isabs(relative_path):
        return False
    normal = posixpath.normpath(relative_path)
    return normal == relative_path and normal != "." and not normal.startswith("../") and normal != ".."


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
