"""A checkpoint read in part, each part checked before it is used, and saved to be read so.

A resuming rank needs its own share of the state, not the whole checkpoint: on 992 ranks of
OPT-175B, 2 GB of 2.1 TB. The manifest records, beside each file's sha256, the sha256 of each of
its blocks (`integrity.block_bytes`). `BlockReader`, a DCP storage reader over local files and
s3:// alike, reads the blocks that cover the byte ranges its load plan asks for (ranged reads,
a few blocks at a time) and checks each against the manifest before anything in it is
deserialized; a block that differs raises CorruptCheckpointError naming the file and the range.
A file whose manifest entry has no block hashes (a checkpoint written before them) is checked
whole, once, before its first read: still only the files this rank reads.

`SavePlanner` lays the files out for it. DCP stores an entry that several ranks hold (the
optimizer's step counts and learning rates, replicated tensors) once, in the file of whichever
rank had written least, and in the order of the state dict, between the large shards; every rank
loads every such entry, so each rank would read a block of every other rank's file. Here the
small ones go to the lowest rank that holds them, and every file holds its entries smallest first:
what a rank reads beyond its own file is the first block or two of rank 0's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
from collections import OrderedDict
from typing import Any, Iterator, Optional

from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, WriteItem
from torch.futures import Future

from raylm.config import StorageConfig
from raylm.data import storage
from raylm.train.checkpoint.errors import CorruptCheckpointError
from raylm.train.checkpoint.integrity import MANIFEST, FileEntry, checksum_problem, count_read

_SMALL_ENTRY = 64 << 10  # bytes: entries up to this size are kept by the lowest rank that holds them
_FETCH_BLOCKS = 8  # blocks fetched by one ranged read, at most
_CACHED_BLOCKS = _FETCH_BLOCKS + 4  # the last ones fetched, kept for the entries that share them
_WHOLE_READ = 8 << 20  # bytes read at a time to check a file whole


def _entry_bytes(item: WriteItem) -> int:
    return item.tensor_storage_size() or 0  # non-tensor entries (a learning rate) are small; DCP writes them first


class SavePlanner(DefaultSavePlanner):
    """DCP's save planner with the file layout of the module docstring."""

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        held: set = set()
        thinned = []
        for plan in all_plans:  # in rank order
            small = {item.index for item in plan.items if _entry_bytes(item) <= _SMALL_ENTRY}
            lower = small & held
            thinned.append(dataclasses.replace(plan, items=[i for i in plan.items if i.index not in lower]))
            held |= small
        return super()._dedup_save_plans(thinned)  # the large ones as DCP spreads them

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self.plan = dataclasses.replace(plan, items=sorted(plan.items, key=_entry_bytes))
        return self.plan


class _CheckedFile(io.RawIOBase):
    """One file of a checkpoint, readable and seekable, whose bytes are checked against its
    manifest entry before they are returned: by block, or whole at opening for an entry without
    block hashes; `entry` None (a save nobody finalized) checks nothing. `wanted`: the blocks the
    load plan reads, fetched by runs of consecutive ones."""

    def __init__(self, source: Any, uri: str, name: str, entry: Optional[FileEntry], wanted: set[int]):
        super().__init__()
        self.source, self.uri, self.name, self.entry, self.wanted = source, uri, name, entry, wanted
        self.size, self.pos = source.size(), 0
        self.blocks: OrderedDict[int, memoryview] = OrderedDict()
        if entry is None:
            return
        if self.size != entry.size:
            raise self._corrupt(f"{name} is {self.size} bytes, {MANIFEST} records {entry.size}")
        if entry.block_sha256 is None and entry.sha256 is not None:
            digest = hashlib.sha256()
            for start in range(0, self.size, _WHOLE_READ):
                digest.update(self._fetch(start, min(_WHOLE_READ, self.size - start)))
            if digest.hexdigest() != entry.sha256:
                raise self._corrupt(checksum_problem(name, digest.hexdigest(), entry.sha256))

    def _corrupt(self, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(self.uri, problem)

    def _fetch(self, offset: int, length: int) -> bytes:
        data = self.source.read_at(length, offset)
        count_read(len(data))
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        if self.entry is None or self.entry.block_sha256 is None:
            data = self._fetch(self.pos, n)
            n = len(data)  # shorter: the file shrank since it was opened
            out[:n] = data
        else:
            done, length = 0, self.entry.block_bytes
            while done < n:
                at = self.pos + done
                block = self._block(at // length)
                piece = block[at % length:at % length + n - done]
                out[done:done + len(piece)] = piece
                done += len(piece)
        self.pos += n
        return n

    def _block(self, index: int) -> memoryview:
        """Block `index`, checked; fetched with the wanted ones that follow it, in one read."""
        if index not in self.blocks:
            length, hashes = self.entry.block_bytes, self.entry.block_sha256
            end = index + 1
            while end < index + _FETCH_BLOCKS and end in self.wanted and end not in self.blocks:
                end += 1
            data = memoryview(self._fetch(index * length, min(end * length, self.size) - index * length))
            for i in range(index, end):
                block = data[(i - index) * length:(i - index + 1) * length]
                actual = hashlib.sha256(block).hexdigest()
                if actual != hashes[i]:
                    where = f" in bytes {i * length}-{i * length + len(block) - 1}"
                    raise self._corrupt(checksum_problem(self.name, actual, hashes[i], where))
                self.blocks[i] = block
        self.blocks.move_to_end(index)
        while len(self.blocks) > _CACHED_BLOCKS:
            self.blocks.popitem(last=False)
        return self.blocks[index]


class _CheckedFiles:
    """What DCP's FileSystemReader asks of its file system, over storage, with checked files."""

    def __init__(self, uri: str, manifest: Optional[dict[str, FileEntry]], storage_cfg: Optional[StorageConfig]):
        self.uri, self.manifest, self.storage_cfg = uri, manifest, storage_cfg
        self.wanted: dict[str, set[int]] = {}  # by file: the blocks the load plan reads

    def init_path(self, path: str) -> str:
        return path

    def concat_path(self, path: str, name: str) -> str:
        return name  # the names inside the checkpoint, which the manifest lists

    @contextlib.contextmanager
    def create_stream(self, name: str, mode: str) -> Iterator[_CheckedFile]:
        entry = self.manifest.get(name) if self.manifest is not None else None
        if self.manifest is not None and entry is None:
            raise CorruptCheckpointError(self.uri, f"{name} is not in {MANIFEST}")
        try:
            with storage.open_input(storage.join(self.uri, name), self.storage_cfg) as source:
                yield _CheckedFile(source, self.uri, name, entry, self.wanted.get(name, set()))
        except storage.StorageNotFoundError:
            if entry is None:
                raise
            raise CorruptCheckpointError(self.uri, f"{name} is missing, though {MANIFEST} lists it") from None


class BlockReader(FileSystemReader):
    """DCP's reader of the checkpoint at `uri` (local or s3://) for `metadata`, already read and
    checked by the caller, reading only the checked blocks its load plan needs (module docstring)."""

    def __init__(self, uri: str, metadata: Metadata, manifest: Optional[dict[str, FileEntry]],
                 storage_cfg: Optional[StorageConfig] = None):
        super().__init__(".")
        self.fs = _CheckedFiles(uri, manifest, storage_cfg)  # type: ignore[assignment]
        self.path, self.metadata = uri, metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # As FileSystemReader does: the load's id goes into the metadata it hands the planner.
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        infos = [self.storage_data[item.storage_index] for item in plan.items]
        for info in infos:
            entry = self.fs.manifest.get(info.relative_path) if self.fs.manifest is not None else None
            if entry is not None and entry.block_bytes:
                first, last = info.offset // entry.block_bytes, (info.offset + info.length - 1) // entry.block_bytes
                self.fs.wanted.setdefault(info.relative_path, set()).update(range(first, last + 1))
        # In file order (DCP reads a file's entries in the plan's): each block is fetched once.
        order = sorted(range(len(infos)), key=lambda i: (infos[i].relative_path, infos[i].offset))
        return super().read_data(dataclasses.replace(plan, items=[plan.items[i] for i in order]), planner)
