"""DCP's `.metadata` index, read without running code from storage, and without torch where only
the files it names are wanted.

torch 2.13's `FileSystemReader.read_metadata` unpickles the file with a plain `pickle.load`:
anyone who can write to the checkpoint's storage could run code on every rank at the next resume.
`MetadataUnpickler`'s `find_class` admits only the classes DCP's own metadata is made of (the
dataclasses of `torch.distributed.checkpoint.metadata`, `filesystem._StorageInfo`, `torch.Size`,
dtypes and layouts, `pathlib` paths); any other global, such as `os.system`, is refused before it
is looked up, and shard paths must stay inside the checkpoint directory.

An admitted global stands for DCP's real class when the metadata is handed to DCP
(`read_metadata`, on the ranks, which have torch), or for an inert stand-in that only keeps its
fields when a command looks for checkpoints (`shard_files`): the driver, `raylm status` and `raylm
checkpoint verify` need the shard files' names, and importing torch for them cost 2-3 s at every
start of a command that found a checkpoint.
"""

from __future__ import annotations

import importlib
import io
import pickle
import posixpath
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS = frozenset({
    *((_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                          "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                          "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided")
    ("pathlib", "PosixPath"),  # the type of StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
})
# torch 2.13's dtypes, as a dtype pickles: `torch.<name>`. A name outside it is judged by torch
# itself (whether `torch.<name>` is a dtype), so a newer torch's dtypes cost a torch import, no more.
KNOWN_DTYPES = frozenset((
    "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble", "cfloat", "chalf",
    "complex128", "complex32", "complex64", "double", "float", "float16", "float32", "float4_e2m1fn_x2", "float64",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int", "int1",
    "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64", "int7", "int8", "long", "qint32", "qint8",
    "quint2x4", "quint4x2", "quint8", "short", "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5",
    "uint6", "uint64", "uint7", "uint8"))


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint's metadata names something DCP's metadata never holds: refused unread."""


class _UnknownDtype(Exception):
    """`torch.<name>` that KNOWN_DTYPES lacks: only torch can say whether it is a dtype."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else. `resolve(module, name)` gives what an admitted
    global stands for; `is_dtype(name)` says whether `torch.<name>` is a dtype."""

    def __init__(self, data: bytes, resolve: Callable[[str, str], Any], is_dtype: Callable[[str], bool]):
        super().__init__(io.BytesIO(data))
        self._resolve, self._is_dtype = resolve, is_dtype

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or (module == "torch" and self._is_dtype(name)):
            return self._resolve(module, name)
        raise UnsafeCheckpointError(f"refusing to load {module}.{name}: not a class of DCP's metadata")


def _parse(data: bytes, resolve: Callable[[str, str], Any], is_dtype: Callable[[str], bool]) -> Any:
    """DCP metadata from the bytes of a `.metadata` file, its globals resolved by `resolve`;
    raises `pickle.UnpicklingError` (or `UnsafeCheckpointError`) when they are not DCP metadata or
    name a file outside the checkpoint."""
    try:
        metadata = MetadataUnpickler(data, resolve, is_dtype).load()
    except (pickle.UnpicklingError, _UnknownDtype):
        raise
    except Exception as e:  # truncated or garbled: EOFError, ValueError, TypeError, ...
        raise pickle.UnpicklingError(f"not a DCP metadata file ({type(e).__name__}: {e})") from e
    # Only the allowed globals could have made it, so the name is the class.
    if type(metadata).__name__ != "Metadata":
        raise pickle.UnpicklingError(f"not a DCP metadata file (holds a {type(metadata).__name__})")
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not is_inside(path):
            raise UnsafeCheckpointError(f"refusing shard path {path!r}: it must name a file inside the checkpoint")
    return metadata


class _Fields:
    """An inert stand-in for a global of DCP's metadata: it holds the fields it is given and runs
    no code."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        # A dataclass's __dict__, (dict, slots), or TensorProperties' own tuple.
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict):
                self.__dict__.update(part)


_STAND_INS: dict[str, type] = {}


def _stand_in(module: str, name: str) -> type:
    if name not in _STAND_INS:
        _STAND_INS[name] = type(name, (_Fields,), {})
    return _STAND_INS[name]


def _known_dtype(name: str) -> bool:
    if name in KNOWN_DTYPES:
        return True
    raise _UnknownDtype(name)


def read_metadata(data: bytes) -> "Metadata":
    """DCP metadata from the bytes of a `.metadata` file, as DCP's own classes; raises
    `pickle.UnpicklingError` (or `UnsafeCheckpointError`) when they are not DCP metadata or name a
    file outside the checkpoint."""
    return _parse(data, lambda module, name: getattr(importlib.import_module(module), name), _torch_dtype)


def _torch_dtype(name: str) -> bool:
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def shard_files(data: bytes) -> set[str]:
    """The files (relative paths) the `.metadata` bytes index, read by the rules above; raises
    `pickle.UnpicklingError` as `read_metadata` would."""
    try:
        metadata = _parse(data, _stand_in, _known_dtype)
    except _UnknownDtype:
        metadata = read_metadata(data)
    return {info.relative_path for info in (getattr(metadata, "storage_data", None) or {}).values()}


def is_inside(relative_path: str) -> bool:
    """A path that names a file inside its directory: relative, no `..`, no backslashes."""
    if not relative_path or "\\" in relative_path or posixpath.isabs(relative_path):
        return False
    normal = posixpath.normpath(relative_path)
    return normal == relative_path and normal != "." and not normal.startswith("../") and normal != ".."
