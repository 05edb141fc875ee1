"""A checkpoint's files against its manifest: what the manifest records of each file (size, sha256,
the sha256 of each block), how the manifest is read, how a file is hashed and checked against its
entry, and the bytes this process has read from checkpoints (what a resume cost: the `resumed`
event).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from raylm.config import StorageConfig
from raylm.data import storage
from raylm.train.checkpoint.errors import CheckpointError
from raylm.train.checkpoint.metadata import is_inside

MANIFEST = "checkpoint_manifest.json"
_HASH_BLOCK = 8 << 20  # bytes read at a time: shards are hashed as streams, never whole in memory
# A file's blocks: at most 16 per file up to 8 MiB each, so that a rank reading a small part of
# another rank's file (the replicated entries at its start) reads little of it, while the manifest
# of a 2 TB checkpoint lists about 250,000 of them (17 MB).
_MIN_BLOCK, _MAX_BLOCK, _BLOCKS_PER_FILE = 64 << 10, 8 << 20, 16


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: Optional[str]  # None only in manifests written before checksums were recorded
    block_bytes: Optional[int] = None  # None (and no block_sha256) in manifests written before blocks were
    block_sha256: Optional[tuple[str, ...]] = None


def block_bytes(size: int) -> int:
    """The length of the blocks a file of `size` bytes is hashed in (the last one may be shorter)."""
    return min(_MAX_BLOCK, max(_MIN_BLOCK, -(-size // _BLOCKS_PER_FILE)))


def _digests(f: Any, length: int) -> tuple[str, tuple[str, ...]]:
    """The sha256 of the file `f` reads, whole and of each block of `length` bytes, in one pass."""
    whole, blocks = hashlib.sha256(), []
    while block := f.read(length):
        whole.update(block)
        blocks.append(hashlib.sha256(block).hexdigest())
    return whole.hexdigest(), tuple(blocks)


def file_entry(path: str) -> FileEntry:
    """A local file's size, sha256 and block hashes."""
    size = os.path.getsize(path)
    length = block_bytes(size)
    with open(path, "rb") as f:
        whole, blocks = _digests(f, length)
    return FileEntry(size, whole, length, blocks)


# Bytes this process has read from checkpoints.
_read_lock = threading.Lock()
_read_total = 0


def bytes_read() -> int:
    """Bytes read from checkpoint files by this process so far (discovery, loads)."""
    return _read_total


def count_read(n: int) -> None:
    global _read_total
    with _read_lock:
        _read_total += n


def read_file(uri: str, storage_cfg: Optional[StorageConfig] = None) -> bytes:
    """The bytes of a checkpoint's file, counted in `bytes_read`."""
    data = storage.read_bytes(uri, storage_cfg)
    count_read(len(data))
    return data


def checksum_problem(name: str, actual: str, recorded: str, where: str = "") -> str:
    """How a file (or, `where`, a range of it) that does not match its manifest entry is named."""
    return f"{name} has sha256 {actual[:16]}...{where}, {MANIFEST} records {recorded[:16]}..."


def file_problem(uri: str, name: str, entry: FileEntry, storage_cfg: Optional[StorageConfig] = None,
                 checksum: bool = True) -> Optional[str]:
    """What is wrong with file `name` of the checkpoint at `uri` against its manifest entry."""
    try:
        size = storage.file_size(storage.join(uri, name), storage_cfg)
    except FileNotFoundError:
        return f"{name} is missing, though {MANIFEST} lists it"
    if size != entry.size:
        return f"{name} is {size} bytes, {MANIFEST} records {entry.size}"
    if not checksum or entry.sha256 is None:
        return None
    length = entry.block_bytes or _HASH_BLOCK
    with storage.open_input(storage.join(uri, name), storage_cfg) as f:
        actual, blocks = _digests(f, length)
    count_read(size)
    if actual != entry.sha256:
        return checksum_problem(name, actual, entry.sha256)
    # The blocks too: resuming checks them, not the whole, and they must describe the same bytes.
    for i, (block, recorded) in enumerate(zip(blocks, entry.block_sha256 or ())):
        if block != recorded:
            where = f" in bytes {i * length}-{min((i + 1) * length, size) - 1}"
            return checksum_problem(name, block, recorded, where)
    return None


def checked_bytes(uri: str, name: str, manifest: Optional[dict[str, FileEntry]],
                  storage_cfg: Optional[StorageConfig]) -> bytes:
    """File `name` of the checkpoint, whole, matching its manifest entry (size, sha256)."""
    entry = manifest.get(name) if manifest is not None else None
    if manifest is not None and entry is None:
        raise CheckpointError(f"no {name} in the manifest")
    try:
        data = read_file(storage.join(uri, name), storage_cfg)
    except storage.StorageNotFoundError:
        raise CheckpointError(f"{name} is missing, though {MANIFEST} lists it" if entry
                              else f"no {name} (the save did not finish)") from None
    if entry is None:
        return data
    if len(data) != entry.size:
        raise CheckpointError(f"{name} is {len(data)} bytes, {MANIFEST} records {entry.size}")
    if entry.sha256 is not None and (actual := hashlib.sha256(data).hexdigest()) != entry.sha256:
        raise CheckpointError(checksum_problem(name, actual, entry.sha256))
    return data


def parse_manifest(raw: bytes) -> dict[str, FileEntry]:
    """The files a manifest's bytes list; CheckpointError when they are no manifest."""
    try:
        listed = json.loads(raw)["files"]
        entries = {name: _parse_entry(e) for name, e in listed.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{MANIFEST} is not a valid manifest ({type(e).__name__}: {e})") from e
    outside = [name for name in entries if not is_inside(name)]
    if outside:
        raise CheckpointError(f"{MANIFEST} names files outside the checkpoint: {outside[:3]}")
    return entries


def _parse_entry(e) -> FileEntry:
    if type(e) is int:
        return FileEntry(e, None)
    size, sha256 = int(e["size"]), str(e["sha256"])
    if e.get("block_sha256") is None:  # written before blocks were hashed: checked whole
        return FileEntry(size, sha256)
    length, blocks = int(e["block_bytes"]), tuple(map(str, e["block_sha256"]))
    if length <= 0 or len(blocks) != -(-size // length):
        raise ValueError(f"{len(blocks)} block hashes of {length} bytes for a file of {size}")
    return FileEntry(size, sha256, length, blocks)


def read_manifest(uri: str, storage_cfg: Optional[StorageConfig] = None) -> dict[str, FileEntry]:
    """The files the manifest at `uri` lists; CheckpointError when it is missing or unparseable."""
    try:
        raw = read_file(storage.join(uri, MANIFEST), storage_cfg)
    except FileNotFoundError as e:
        raise CheckpointError(f"no {MANIFEST} (the save did not finish)") from e
    return parse_manifest(raw)
