"""safetensors files written one tensor at a time, and read back from a Hugging Face directory.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header length,
a JSON header giving each tensor's dtype, shape and byte range, then the raw bytes. Every
shape is known before any tensor is read (from DCP's metadata), so the header is written first
and each tensor streamed after it: memory holds one tensor, whatever the model's size. Large
models are split into shards with Hugging Face's index file, as `save_pretrained` does.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from raylm.config import StorageConfig
from raylm.errors import DeterministicError
from raylm.data import storage
from raylm.progress import Progress

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


@dataclass
class Planned:
    """One output tensor: its name, a meta tensor with its shape and dtype, and how to make it."""

    name: str
    meta: torch.Tensor
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.meta.shape) * self.meta.dtype.itemsize


def plan_shards(tensors: list[Planned], max_shard_bytes: int) -> list[list[Planned]]:
    """Consecutive tensors grouped into shards of at most `max_shard_bytes` (a larger tensor gets
    a shard of its own)."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(shard: list[Planned]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        if t.meta.dtype not in DTYPES:
            raise ValueError(f"{t.name}: dtype {t.meta.dtype} cannot be written (supported: {list(DTYPES)})")
        header[t.name] = {"dtype": DTYPES[t.meta.dtype], "shape": list(t.meta.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def write_sharded(directory: str, tensors: list[Planned], max_shard_bytes: int,
                  storage_cfg: Optional[StorageConfig] = None) -> list[str]:
    """Write `tensors` as model.safetensors, or as model-0000k-of-0000n.safetensors shards plus
    model.safetensors.index.json; returns the file names written. Counts the tensors as they go
    (`raylm.progress`)."""
    shards = plan_shards(tensors, max_shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    with Progress("export", len(tensors), "tensors") as progress:
        for name, shard in zip(names, shards):
            with storage.open_output(storage.join(directory, name), storage_cfg) as f:
                f.write(_header(shard))
                for t in shard:
                    value = t.make()
                    if value.shape != t.meta.shape or value.dtype != t.meta.dtype:
                        raise AssertionError(f"{t.name}: made {tuple(value.shape)} {value.dtype}, planned "
                                             f"{tuple(t.meta.shape)} {t.meta.dtype}")
                    f.write(value.contiguous().reshape(-1).view(torch.uint8).numpy())
                    progress.update()
                    del value
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        storage.write_bytes(storage.join(directory, INDEX_FILE), json.dumps(index, indent=2).encode(), storage_cfg)
        names.append(INDEX_FILE)
    return names


class ModelFileError(DeterministicError):
    """A Hugging Face model file that cannot be read (cut short, not safetensors, a broken index);
    the message names it."""

    exit_code = 2


class HFTensors:
    """The tensors of a local Hugging Face model directory (model.safetensors or an index of
    shards), by name, read lazily one at a time."""

    def __init__(self, directory: str):
        index = os.path.join(directory, INDEX_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = dict(json.load(f)["weight_map"])
            except (ValueError, KeyError, TypeError) as e:
                raise ModelFileError(f"{index}: not a safetensors index with a weight_map ({e!r})") from None
        elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
            weight_map = {name: SINGLE_FILE for name in _open(os.path.join(directory, SINGLE_FILE)).keys()}
        else:
            others = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth")))
            hint = (f" (found {', '.join(others)}: re-save it with transformers' save_pretrained, which writes "
                    "safetensors)") if others else ""
            raise FileNotFoundError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
        self.weight_map: dict[str, str] = weight_map
        self._paths = {file: os.path.join(directory, file) for file in sorted(set(weight_map.values()))}
        self._files = {file: _open(path) for file, path in self._paths.items()}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def read(self, name: str) -> torch.Tensor:
        file = self.weight_map[name]
        try:
            return self._files[file].get_tensor(name)
        except Exception as e:  # safetensors raises its own error type for a file cut short
            raise ModelFileError(f"{self._paths[file]}: cannot read tensor {name} ({e})") from None


def _open(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except FileNotFoundError:
        raise
    except Exception as e:  # a file cut short or not safetensors: the library's own error type
        raise ModelFileError(f"{path}: not a readable safetensors file ({e})") from None
