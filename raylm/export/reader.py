"""A checkpoint's model tensors, read one at a time.

A checkpoint (see `raylm.train.checkpoint.format`) is a DCP directory whose state dict is
{"model": {...}, "optim": {...}}, flattened by DCP to "model.<parameter name>" entries. DCP's
metadata gives every tensor's global shape and dtype whatever layout wrote it (FSDP, TP,
pipeline stages); loading one entry into a plain tensor reassembles it from the shards that
hold it. So an exporter needs memory for one tensor at a time, not for the model. Reads go
through raylm's safe DCP reader: nothing from storage is unpickled beyond DCP's metadata.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from raylm.train.checkpoint.safe_load import SafeReader

MODEL_PREFIX = "model."


class _CachedReader(SafeReader):
    """Parses `.metadata` once, not on every one-tensor load."""

    def __init__(self, path: str):
        super().__init__(path)
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        self._metadata.storage_meta.load_id = self.load_id  # as each fresh read would set it
        return self._metadata


class CheckpointTensors:
    """The model tensors of a local checkpoint directory, by parameter name, read one at a time."""

    def __init__(self, directory: str):
        self.directory = directory
        self._reader = _CachedReader(directory)
        entries = self._reader.read_metadata().state_dict_metadata
        self.entries: dict[str, TensorStorageMetadata] = {
            key[len(MODEL_PREFIX):]: value for key, value in entries.items()
            if key.startswith(MODEL_PREFIX) and isinstance(value, TensorStorageMetadata)}

    def names(self) -> list[str]:
        return list(self.entries)

    def meta(self, name: str) -> torch.Tensor:
        """A meta-device stand-in with the tensor's shape and dtype (no data)."""
        entry = self.entries[name]
        return torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""
        entry = self.entries[name]
        out = torch.empty(entry.size, dtype=entry.properties.dtype)
        with warnings.catch_warnings():  # one process is the point here; DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": {name: out}}, storage_reader=self._reader, no_dist=True)
        return out
