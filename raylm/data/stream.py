"""Prepared shards -> the token batches of one data-parallel rank, resumable at any sample.

The order comes from `raylm.data.order`; this module reads the rows. Two engines share one
row reader: `ray` runs the reads in a reader actor per rank that stays a few spans of steps
ahead (the engine for cluster runs), `local` reads with pyarrow on a thread in the training
process (for runs and tests without Ray). Both yield exactly the same batches.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import numpy as np
import pyarrow.parquet as pq

from raylm.config import ConfigError, DataConfig, MixtureComponent, StorageConfig
from raylm.data import storage
from raylm.data.manifest import DatasetError, Manifest, load_manifest, manifest_from_dict
from raylm.data.order import MIX_BLOCK, DatasetOrder, SampleOrder, batch_indices, block_counts, rank_slice


STEPS_PER_READ = 16
# The reader reserves no CPU: the worker it feeds stands for it (give cpus_per_worker room for
# the reads). Any reservation of its own can be starved: restarted on a node whose CPUs the
# training workers then filled, a 0.25-CPU reader never started and the run hung.
READER_CPUS = 0


@dataclass
class Batch:
    step: int
    tokens: np.ndarray  # (local_batch, row_tokens) int32; inputs are [:, :-1], targets [:, 1:]
    indices: list[int]  # global sample indices of the rows, for audits and tests
    next_position: int  # global position after this whole global batch
    global_batch: int  # sequences in this step's whole global batch


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch in sequences as a function of the samples consumed so far: constant, or
    Megatron's ramp-up (`--rampup-batch-size start increment samples`), growing from `start` by
    `increment` in equal shares of `ramp_samples`, then `final`. A pure function of the samples
    consumed, so resumes and resizes see the same sizes."""

    final: int
    start: Optional[int] = None
    increment: int = 1
    ramp_samples: int = 0

    def size(self, consumed: int) -> int:
        if self.start is None or consumed >= self.ramp_samples:
            return self.final
        per_increment = self.ramp_samples / ((self.final - self.start) // self.increment)
        return min(self.final, self.start + int(consumed // per_increment) * self.increment)

    def sizes(self) -> list[int]:
        """Every size a run goes through."""
        return [self.final] if self.start is None else list(range(self.start, self.final + 1, self.increment))

    def samples(self, steps: int) -> int:
        """The samples `steps` steps consume (stepping only through the ramp)."""
        consumed = step = 0
        while step < steps and self.size(consumed) != self.final:
            consumed += self.size(consumed)
            step += 1
        return consumed + (steps - step) * self.final


_shards: OrderedDict[str, np.ndarray] = OrderedDict()


def _tokens(table) -> "np.ndarray":
    return table.column("tokens").combine_chunks().flatten().to_numpy(zero_copy_only=False)


class ShardReader:
    """Reads rows of Parquet shards by row number: whole shards through a per-process cache of
    `cache_bytes` (the caller sets it only when the whole split fits), else the row groups
    that hold the rows. A cache smaller than the split would fetch a whole shard for every
    chunk of the shuffled order: many times the bytes the rows need."""

    def __init__(self, row_tokens: int, storage_cfg: Optional[StorageConfig], cache_bytes: int):
        self.row_tokens, self.storage_cfg, self.cache_bytes = row_tokens, storage_cfg, cache_bytes
        self._files: dict[str, pq.ParquetFile] = {}

    def _file(self, uri: str) -> pq.ParquetFile:
        if uri not in self._files:
            fs, path = storage.filesystem_for(uri, self.storage_cfg)
            self._files[uri] = pq.ParquetFile(fs.open_input_file(path), pre_buffer=True)
        return self._files[uri]

    def _whole(self, uri: str) -> Optional[np.ndarray]:
        if not self.cache_bytes:
            return None
        if uri in _shards:
            _shards.move_to_end(uri)
            return _shards[uri]
        fs, path = storage.filesystem_for(uri, self.storage_cfg)
        rows = _tokens(pq.read_table(path, filesystem=fs, columns=["tokens"])).reshape(-1, self.row_tokens)
        _shards[uri] = rows
        while sum(r.nbytes for r in _shards.values()) > self.cache_bytes:
            _shards.popitem(last=False)
        return rows

    def read_rows(self, uri: str, rows: np.ndarray) -> np.ndarray:
        """The token rows at `rows` (row numbers within the shard), in that order."""
        pf = self._file(uri)
        if len(rows) and (rows.min() < 0 or rows.max() >= pf.metadata.num_rows):
            # Not a read that a restart could cure: the shard is not the one its manifest lists.
            raise DatasetError(f"{uri}: rows {rows.min()}..{rows.max()} asked for, but the shard holds "
                               f"{pf.metadata.num_rows}: it was replaced or cut short since the dataset was "
                               "prepared (`raylm data verify` checks every shard against its manifest)")
        whole = self._whole(uri)
        if whole is not None:
            return whole[rows]
        sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
        starts = np.concatenate([[0], np.cumsum(sizes)])
        groups = np.unique(np.searchsorted(starts, rows, side="right") - 1)
        block = _tokens(pf.read_row_groups(groups.tolist(), columns=["tokens"])).reshape(-1, self.row_tokens)
        offsets = np.concatenate([[0], np.cumsum([sizes[g] for g in groups])])
        index = {g: (starts[g], offsets[i]) for i, g in enumerate(groups.tolist())}
        picked = [index[int(g)][1] + r - index[int(g)][0]
                  for g, r in zip(np.searchsorted(starts, rows, side="right") - 1, rows)]
        return block[np.asarray(picked, dtype=np.int64)]


class RowSource:
    """Everything needed to turn global indices into token rows; small and picklable."""

    def __init__(self, order: SampleOrder, shard_uris: list[list[str]], row_tokens: int,
                 storage_cfg: Optional[StorageConfig], cache_bytes: int = 0):
        self.order, self.shard_uris, self.row_tokens, self.storage_cfg = order, shard_uris, row_tokens, storage_cfg
        self.cache_bytes = cache_bytes
        self._reader: Optional[ShardReader] = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None}  # open files stay in the process that opened them

    def rows(self, indices: list[int]) -> np.ndarray:
        if self._reader is None:
            self._reader = ShardReader(self.row_tokens, self.storage_cfg, self.cache_bytes)
        datasets, shards, rows = self.order.locate_many(indices)
        out = np.empty((len(indices), self.row_tokens), dtype=np.int32)
        for d, shard in {(int(d), int(s)) for d, s in zip(datasets, shards)}:
            mine = (datasets == d) & (shards == shard)
            out[mine] = self._reader.read_rows(self.shard_uris[d][shard], rows[mine])
        return out


@dataclass(frozen=True)
class Datasets:
    """The prepared datasets a run reads (`data.path`, or the components of `data.mixture`),
    with their manifests: loaded once, then handed on (driver to workers) as they are."""

    uris: tuple[str, ...]
    weights: tuple[float, ...]
    manifests: tuple[Manifest, ...]

    @classmethod
    def load(cls, data: DataConfig, storage_cfg: Optional[StorageConfig]) -> "Datasets":
        """Read each dataset's manifest; the datasets must share a tokenizer and seq_len."""
        components = data.mixture or [MixtureComponent(data.path)]
        manifests: list[Manifest] = []
        for i, c in enumerate(components):
            key = f"data.mixture[{i}].path" if data.mixture else "data.path"
            if not c.path:
                raise ConfigError(f"{key} is empty: point it at a dataset written by `raylm prepare`")
            try:
                manifests.append(load_manifest(c.path, storage_cfg))
            except DatasetError as e:
                raise DatasetError(f"{e}, given as {key}") from None
        first, first_uri = manifests[0], components[0].path
        for i, (c, m) in enumerate(zip(components, manifests)):
            if m.seq_len != first.seq_len or m.tokenizer.sha256 != first.tokenizer.sha256:
                raise ConfigError(
                    f"data.mixture[{i}] ({c.path}: seq_len {m.seq_len}, tokenizer {m.tokenizer.kind} "
                    f"{m.tokenizer.sha256[:12]}) differs from data.mixture[0] ({first_uri}: seq_len "
                    f"{first.seq_len}, tokenizer {first.tokenizer.kind} {first.tokenizer.sha256[:12]}); "
                    "prepare every component with the same tokenizer and --seq-len")
        if len(components) > 1:
            for i, count in enumerate(block_counts([c.weight for c in components])):
                if count == 0:  # its share rounds to no sample of a block: never trained on, silently
                    raise ConfigError(f"data.mixture[{i}].weight={components[i].weight:g} is less than 1/{MIX_BLOCK} "
                                      f"of the weights' sum ({sum(c.weight for c in components):g}): the mixture "
                                      f"interleaves blocks of {MIX_BLOCK} samples, and that dataset would get none")
        return cls(tuple(c.path for c in components), tuple(c.weight for c in components), tuple(manifests))

    @property
    def manifest(self) -> Manifest:
        """The first dataset's manifest: seq_len, vocabulary and tokenizer are the same in all."""
        return self.manifests[0]

    def digest(self) -> str:
        """One hash over every manifest: two processes that agree on it read the same data."""
        return hashlib.sha256("".join(m.to_json() for m in self.manifests).encode()).hexdigest()

    def to_dict(self) -> dict:
        return {"uris": list(self.uris), "weights": list(self.weights),
                "manifests": [m.to_dict() for m in self.manifests]}

    @classmethod
    def from_dict(cls, d: dict) -> "Datasets":
        return cls(tuple(d["uris"]), tuple(d["weights"]),
                   tuple(manifest_from_dict(m, uri) for m, uri in zip(d["manifests"], d["uris"])))

    def open_split(self, split: str, data: DataConfig, storage_cfg: Optional[StorageConfig],
                   shuffle: bool = True) -> RowSource:
        """The row source of one split, in the order `data.seed` and `data.chunk_rows` give."""
        orders, shard_uris = [], []
        for d, (uri, m) in enumerate(zip(self.uris, self.manifests)):
            shard_uris.append(m.shard_uris(uri, split))
            orders.append(DatasetOrder(shard_uris[-1], [s.rows for s in m.splits[split].shards], data.seed,
                                       data.chunk_rows, shuffle=shuffle, salt=d))
        split_bytes = sum(m.splits[split].rows for m in self.manifests) * self.manifest.row_tokens * 4
        cache = data.shard_cache_mb << 20
        return RowSource(SampleOrder(orders, list(self.weights), data.seed), shard_uris, self.manifest.row_tokens,
                         storage_cfg, cache if split_bytes <= cache else 0)


def step_positions(position: int, first_step: int, last_step: int, schedule: BatchSchedule,
                   skip: list[list[int]], consumed: int = 0) -> list[tuple[int, int, int]]:
    """(step, start position, global batch) for each step in [first_step, last_step), the first
    one after `consumed` samples."""
    out = []
    for step in range(first_step, last_step):
        size = schedule.size(consumed)
        out.append((step, position, size))
        position = batch_indices(position, size, skip)[1]
        consumed += size
    return out


class TokenStream:
    """Batches for one data-parallel rank from a global position onward."""

    def __init__(self, source: RowSource, global_batch: Union[int, BatchSchedule], dp_rank: int, dp_size: int,
                 skip: list[list[int]], engine: str = "local", prefetch: int = 4):
        self.schedule = global_batch if isinstance(global_batch, BatchSchedule) else BatchSchedule(global_batch)
        uneven = [size for size in self.schedule.sizes() if size % dp_size]
        if uneven:
            raise ValueError(f"global batch {uneven[0]} is not divisible by the {dp_size} data-parallel ranks")
        self.source, self.skip = source, skip
        self.dp_rank, self.dp_size, self.engine, self.prefetch = dp_rank, dp_size, engine, prefetch

    def batch_at(self, step: int, position: int, size: Optional[int] = None) -> Batch:
        """This rank's share of the global batch of `step` (`size` sequences, the final size by
        default), which starts at global `position`."""
        return self.batch_of(step, *batch_indices(position, size or self.schedule.final, self.skip))

    def batch_of(self, step: int, indices: list[int], next_position: int) -> Batch:
        """This rank's share of the global batch of `step` made of `indices`, global sample indices
        (`batch_indices`), followed by `next_position`."""
        mine = rank_slice(indices, self.dp_rank, self.dp_size)
        return Batch(step, self.source.rows(mine), mine, next_position, len(indices))

    def batches(self, position: int, first_step: int, last_step: int, consumed: int = 0) -> Iterator[Batch]:
        """The batches of steps [first_step, last_step), the first at `position` after `consumed`
        samples (which decide the sizes while the batch ramps up)."""
        plan = step_positions(position, first_step, last_step, self.schedule, self.skip, consumed)
        if not plan:
            return iter(())
        if self.engine == "ray":
            return self._ray_batches(plan)
        return self._thread_batches(plan)

    def _thread_batches(self, plan: list[tuple[int, int, int]]) -> Iterator[Batch]:
        q: queue.Queue = queue.Queue(maxsize=max(1, self.prefetch))
        stop = threading.Event()

        def produce() -> None:
            try:
                for step, pos, size in plan:
                    if stop.is_set():
                        return
                    q.put(self.batch_at(step, pos, size))
                q.put(None)
            except BaseException as e:  # surfaced in the consumer, which owns error handling
                q.put(e)

        thread = threading.Thread(target=produce, daemon=True, name="raylm-data")
        thread.start()
        try:
            while (item := q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()

    def _ray_batches(self, plan: list[tuple[int, int, int]]) -> Iterator[Batch]:
        import ray

        # One read per span of steps: a Ray call per step would cost more than the read.
        span = max(1, min(STEPS_PER_READ, len(plan) // max(1, self.prefetch)))
        # A span never mixes batch sizes (a ramp-up stage ends it): its batches stack into one block.
        spans: list[list[tuple[int, int, int]]] = []
        for entry in plan:
            if not spans or len(spans[-1]) == span or spans[-1][-1][2] != entry[2]:
                spans.append([])
            spans[-1].append(entry)
        # One long-lived reader actor per rank, on its node when it has room (it needs no CPU
        # there), asked for spans in order with a bounded number in flight: the consumer's pace
        # is the reader's. A Ray Data pipeline ahead of its consumer and out of object-store
        # budget turns its scheduling loop into a busy wait in the training process (no sleep
        # when nothing can move): a 20,000-step run on 2 cores took 2.68x the local loader's step time.
        node = ray.get_runtime_context().get_node_id()
        reader = ray.remote(_SpanReader).options(
            num_cpus=READER_CPUS, label_selector={"ray.io/node-id": node},
            fallback_strategy=[{"label_selector": {"ray.io/node-id": f"!{node}"}}]).remote(self, spans)
        asked = min(len(spans), max(2, -(-self.prefetch // span) + 1))
        pending = deque(reader.read.remote(k) for k in range(asked))
        try:
            while pending:
                block = _wait(pending.popleft())
                if asked < len(spans):
                    pending.append(reader.read.remote(asked))
                    asked += 1
                for i in range(len(block["step"])):
                    yield Batch(int(block["step"][i]), block["tokens"][i], block["indices"][i].tolist(),
                                int(block["next_position"][i]), int(block["global_batch"][i]))
        finally:
            ray.kill(reader)


def _wait(ref) -> dict:
    """The reader's answer; waits in short slices so that the training thread runs Python
    between them (the progress watchdog's exception lands there, not in a wait without end)."""
    import ray

    while True:
        ready, _ = ray.wait([ref], timeout=0.5)
        if ready:
            return ray.get(ready[0])


class _SpanReader:
    """The reader actor of one rank's stream: turns a span number into that span's batches."""

    def __init__(self, stream: TokenStream, spans: list[list[tuple[int, int, int]]]):
        self.stream, self.spans = stream, spans

    def read(self, k: int) -> dict:
        batches = [self.stream.batch_at(step, pos, size) for step, pos, size in self.spans[k]]
        return {"step": np.array([b.step for b in batches]),
                "next_position": np.array([b.next_position for b in batches]),
                "global_batch": np.array([b.global_batch for b in batches]),
                "indices": np.stack([np.array(b.indices) for b in batches]),
                "tokens": np.stack([b.tokens for b in batches])}
