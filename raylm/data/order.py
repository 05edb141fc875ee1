"""The global sample order: a pure function of (dataset manifests, seed, epoch).

Samples are addressed by one global index g = 0, 1, 2, ... that runs across epochs. Nothing
here depends on the number of workers: a global batch is the next `global_batch` indices
(minus skipped ranges), and only the split of a batch among data-parallel ranks uses the
rank. That is what makes resume exact at any world size.

Shuffling is two-level so that a rank reads a few contiguous chunks rather than scattered
rows: each epoch permutes chunks of `chunk_rows` consecutive rows, then the rows inside each
chunk. Mixtures interleave datasets in blocks of `MIX_BLOCK` positions whose per-dataset
counts are fixed by the weights, so proportions hold exactly over every block.
"""

from __future__ import annotations

import bisect
import hashlib
from functools import lru_cache
from typing import Optional

import numpy as np

MIX_BLOCK = 1000


def _rng(*key: int) -> np.random.Generator:
    """A generator seeded by a tuple of ints, stable across processes and Python versions."""
    digest = hashlib.sha256(",".join(map(str, key)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


class DatasetOrder:
    """The order of one prepared dataset's split, epoch by epoch."""

    def __init__(self, shard_uris: list[str], shard_rows: list[int], seed: int, chunk_rows: int,
                 shuffle: bool = True, salt: int = 0):
        if not shard_uris or sum(shard_rows) == 0:
            raise ValueError(f"dataset split has no rows (shards: {shard_uris[:3]}...)")
        self.shard_uris = list(shard_uris)
        self.seed, self.shuffle, self.salt = seed, shuffle, salt
        # Chunks as arrays, not objects: a dataset of a billion rows has millions of chunks, and
        # this object is pickled into every rank's Ray Data reader.
        starts = [np.arange(0, rows, chunk_rows, dtype=np.int64) for rows in shard_rows]
        self.chunk_shard = np.concatenate([np.full(len(s), i, dtype=np.int32) for i, s in enumerate(starts)])
        self.chunk_start = np.concatenate(starts)
        self.chunk_size = np.concatenate([np.minimum(chunk_rows, rows - s) for rows, s in zip(shard_rows, starts)])
        self.shard_first_chunk = np.concatenate([[0], np.cumsum([len(s) for s in starts])[:-1]]).astype(np.int64)
        self.chunk_rows = chunk_rows
        self.num_samples = sum(shard_rows)

    @lru_cache(maxsize=4)
    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk order for `epoch` and the first position of each chunk in it."""
        n = len(self.chunk_start)
        perm = _rng(self.seed, self.salt, epoch).permutation(n) if self.shuffle else np.arange(n)
        return perm, np.concatenate([[0], np.cumsum(self.chunk_size[perm])])

    @lru_cache(maxsize=1024)
    def _within(self, epoch: int, chunk: int) -> np.ndarray:
        """The order of a chunk's rows in `epoch`."""
        return _rng(self.seed, self.salt, epoch, chunk).permutation(int(self.chunk_size[chunk]))

    def locate_many(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) arrays for positions of this dataset's own sequence."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, pos = np.divmod(positions, self.num_samples)
        shards, rows = np.empty_like(positions), np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            sel = np.flatnonzero(epochs == epoch)
            perm, starts = self._epoch(epoch)
            slots = np.searchsorted(starts, pos[sel], side="right") - 1
            chunk_ids, offsets = perm[slots], pos[sel] - starts[slots]
            shards[sel] = self.chunk_shard[chunk_ids]
            rows[sel] = self.chunk_start[chunk_ids] + offsets
            if not self.shuffle:
                continue
            # A one-row chunk has one order; the others shuffle their rows.
            for c in np.unique(chunk_ids[self.chunk_size[chunk_ids] > 1]).tolist():
                mine = chunk_ids == c
                rows[sel[mine]] = self.chunk_start[c] + self._within(epoch, c)[offsets[mine]]
        return shards, rows

    def positions_of(self, shards: np.ndarray, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """The positions in [lo, hi) of this dataset's own sequence that hold the rows (`shards`,
        `rows`): one per epoch each, found by inverting the epochs' permutations (no scan of the
        positions, whose number is the run's length)."""
        shards, rows = np.asarray(shards, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        if hi <= lo or not len(rows):
            return np.empty(0, dtype=np.int64)
        chunks = self.shard_first_chunk[shards] + rows // self.chunk_rows
        offsets = rows - self.chunk_start[chunks]
        found = []
        for epoch in range(lo // self.num_samples, (hi - 1) // self.num_samples + 1):
            perm, starts = self._epoch(epoch)
            slot = np.empty_like(perm)
            slot[perm] = np.arange(len(perm))
            within = offsets.copy()
            if self.shuffle:
                for c in np.unique(chunks[self.chunk_size[chunks] > 1]).tolist():
                    mine = chunks == c
                    within[mine] = np.argsort(self._within(epoch, c))[offsets[mine]]
            found.append(epoch * self.num_samples + starts[slot[chunks]] + within)
        positions = np.sort(np.concatenate(found))
        return positions[(positions >= lo) & (positions < hi)]


def chunking_warning(chunk_rows: int, batch_rows: int, batch: str) -> Optional[str]:
    """Chunks are shuffled as units, so a batch of fewer rows than a chunk trains several steps in
    a row on one passage of consecutive rows. Measured (benchmarks/RESULTS.md): the README's demo,
    16 rows a step, ended at a val loss of 4.17-4.20 in chunks of 64 and 3.40-3.42 row by row, at
    the same tokens/s; a sweep's 201k rung, 4 rows a step, 14% worse, its seeds spread 10% against
    2.3%. Not an error: a run may mean it, and a big dataset's order grows with its chunks' number."""
    if chunk_rows <= batch_rows:
        return None
    return (f"data.chunk_rows={chunk_rows} is more than {batch} ({batch_rows} rows): {chunk_rows // batch_rows} steps "
            "in a row train on one passage of consecutive rows, which costs loss; set data.chunk_rows to at most "
            f"{batch_rows} (1 draws every row on its own)")


def block_counts(weights: list[float]) -> list[int]:
    """Each dataset's positions in a mix block of MIX_BLOCK, in proportion to its weight (largest
    remainder: the block holds exactly MIX_BLOCK positions)."""
    quotas = [w / sum(weights) * MIX_BLOCK for w in weights]
    counts = [int(q) for q in quotas]
    for i in sorted(range(len(quotas)), key=lambda i: counts[i] - quotas[i])[: MIX_BLOCK - sum(counts)]:
        counts[i] += 1
    return counts


class SampleOrder:
    """Global index -> (dataset, shard, row) for one dataset or a weighted mixture."""

    def __init__(self, datasets: list[DatasetOrder], weights: list[float], seed: int):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("need one weight per dataset")
        if any(w <= 0 for w in weights):
            raise ValueError(f"mixture weights must be positive, got {weights}")
        self.datasets, self.seed = datasets, seed
        self.block_counts = block_counts(weights)

    @lru_cache(maxsize=8)
    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """For each position of a mix block: its dataset, and its rank among that dataset's."""
        owner = np.repeat(np.arange(len(self.block_counts)), self.block_counts)
        if len(self.datasets) > 1:
            owner = _rng(self.seed, -1, block).permutation(owner)
        rank = np.zeros_like(owner)
        for d in range(len(self.block_counts)):
            rank[owner == d] = np.arange(self.block_counts[d])
        return owner, rank

    def locate_many(self, indices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dataset, shard, row) arrays for global sample indices."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(self.datasets) == 1:
            return (np.zeros_like(indices), *self.datasets[0].locate_many(indices))
        blocks, pos = np.divmod(indices, MIX_BLOCK)
        owners, local = np.empty_like(indices), np.empty_like(indices)
        for block in np.unique(blocks).tolist():
            sel = np.flatnonzero(blocks == block)
            owner, rank = self._block(block)
            owners[sel] = owner[pos[sel]]
            local[sel] = block * np.asarray(self.block_counts)[owners[sel]] + rank[pos[sel]]
        shards, rows = np.empty_like(indices), np.empty_like(indices)
        for d in np.unique(owners).tolist():
            sel = np.flatnonzero(owners == d)
            shards[sel], rows[sel] = self.datasets[d].locate_many(local[sel])
        return owners, shards, rows

    def positions_of(self, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """The global indices in [lo, hi) that hold `rows` ((dataset, shard, row) triples, as
        `locate_many` gives them), sorted: where those rows come round again."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        if len(self.datasets) == 1:
            return self.datasets[0].positions_of(rows[:, 1], rows[:, 2], lo, hi)
        found = []
        for d, dataset in enumerate(self.datasets):
            mine = rows[rows[:, 0] == d]
            local = dataset.positions_of(mine[:, 1], mine[:, 2], self._local(d, lo), self._local(d, hi))
            blocks, ranks = np.divmod(local, self.block_counts[d])
            glob = np.empty_like(local)
            for block in np.unique(blocks).tolist():
                sel = blocks == block
                owner, _ = self._block(block)
                glob[sel] = block * MIX_BLOCK + np.flatnonzero(owner == d)[ranks[sel]]
            found.append(glob)
        return np.sort(np.concatenate(found))

    def _local(self, dataset: int, index: int) -> int:
        """How many of the global indices before `index` belong to `dataset`."""
        block, pos = divmod(index, MIX_BLOCK)
        owner, _ = self._block(block)
        return block * self.block_counts[dataset] + int(np.count_nonzero(owner[:pos] == dataset))


def merge_ranges(ranges: list[list[int]]) -> list[list[int]]:
    """Sample ranges, sorted, overlapping and touching ones joined."""
    out: list[list[int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def batch_indices(position: int, count: int, skip: list[list[int]]) -> tuple[list[int], int]:
    """The next `count` global indices at or after `position` outside the skip ranges, and
    the position after them."""
    merged = merge_ranges(skip)  # one jump clears each
    starts, ends = [start for start, _ in merged], [end for _, end in merged]
    out: list[int] = []
    g = position
    while len(out) < count:
        k = bisect.bisect_right(starts, g) - 1
        if k >= 0 and g < ends[k]:
            g = ends[k]
        out.append(g)
        g += 1
    return out, g


def rank_slice(indices: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """This data-parallel rank's contiguous share of a global batch."""
    if len(indices) % dp_size:
        raise ValueError(f"global batch of {len(indices)} sequences does not split evenly over "
                         f"{dp_size} data-parallel ranks")
    per = len(indices) // dp_size
    return indices[dp_rank * per:(dp_rank + 1) * per]
