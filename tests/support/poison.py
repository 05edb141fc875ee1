"""Crafted bad data: a copy of a prepared dataset whose rows that chosen training steps read are
replaced by random bytes, the manifest's checksums updated so the dataset still verifies."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raylm.config import DataConfig
from raylm.data.manifest import TOKENS_COLUMN
from raylm.data.stream import Datasets


def poisoned_copy(dataset: str, out: str, data: DataConfig, global_batch: int, steps: range, seed: int = 0) -> str:
    """`dataset` copied to `out`, with every row of the global batches of `steps` (in the run's
    sample order, no skips) replaced by uniform random byte tokens."""
    return poisoned_rows(dataset, out, data, range(steps.start * global_batch, steps.stop * global_batch), seed)


def poisoned_rows(dataset: str, out: str, data: DataConfig, positions: Sequence[int], seed: int = 0) -> str:
    """`dataset` copied to `out`, with the rows at these global positions of the run's sample order
    replaced by uniform random byte tokens."""
    shutil.copytree(dataset, out)
    source = Datasets.load(DataConfig(path=out, seed=data.seed, chunk_rows=data.chunk_rows), None).open_split(
        "train", DataConfig(path=out, seed=data.seed, chunk_rows=data.chunk_rows), None)
    _, shards, rows = source.order.locate_many(np.asarray(positions))
    rng = np.random.default_rng(seed)
    manifest_path = os.path.join(out, "manifest.json")
    manifest = json.load(open(manifest_path))
    for shard in sorted(set(shards.tolist())):
        info = manifest["splits"]["train"]["shards"][shard]
        path = os.path.join(out, info["file"])
        table = pq.read_table(path)
        tokens = table.column(TOKENS_COLUMN).combine_chunks()
        width = tokens.type.list_size
        array = tokens.flatten().to_numpy().reshape(len(tokens), width).copy()
        for row in rows[shards == shard].tolist():
            array[row] = rng.integers(0, 256, size=width, dtype=np.int32)
        column = pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1), pa.int32()), width)
        pq.write_table(pa.table({TOKENS_COLUMN: column}), path, row_group_size=64)
        info["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
        # documents: end-of-text tokens among the targets, as prepare counts them
        eot = manifest["tokenizer"]["eot_id"]
        info["documents"] = int(np.count_nonzero(array[:, 1:] == eot))
    for split in manifest["splits"].values():
        split["documents"] = sum(s["documents"] for s in split["shards"])
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=2)
    return out
