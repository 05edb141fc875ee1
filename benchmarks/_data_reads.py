"""The reads that benchmarks/data_throughput.py times: raylm's stream, and pyarrow alone.

Every cold read starts with nothing in memory: the Ray engine starts a new reader actor per
stream, and the other reads run in a new process (`in_fresh_process`), since the stream's shard
cache and pyarrow's S3 client belong to the process. The S3 credentials come from the AWS_*
environment.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import posixpath
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raylm.config import DataConfig, StorageConfig
from raylm.data.manifest import SplitInfo, load_manifest
from raylm.data.manifest import ROW_GROUP_ROWS
from raylm.data.storage import filesystem_for
from raylm.data.stream import Datasets, RowSource, TokenStream

SHARD_CACHE_BYTES = DataConfig().shard_cache_mb << 20  # the default cache of a reading process

T = TypeVar("T")


@dataclass
class Rate:
    tokens_per_s: float
    server_ms_per_mtok: float  # SeaweedFS CPU per million tokens: the cost of the requests made


@dataclass
class StreamRun:
    """One fresh reader streaming the train split: its first steps cold, the rest warm."""
    first_batch_s: float  # from the call to the first batch
    cold: Rate  # the cold steps, from the call: the reader's start-up and its S3 reads
    warm: Optional[Rate]  # the steps after: every shard in the reader's cache, no S3 read


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_fresh_process(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a new Python process that imports only what `fn` needs. Not fork: the
    caller runs Ray's threads; not multiprocessing's spawn: that imports the caller's whole
    main module (torch, the training loop) first, 20 s on a loaded machine."""
    with tempfile.TemporaryDirectory(prefix="raylm-bench-") as scratch:
        call, result = os.path.join(scratch, "call.pkl"), os.path.join(scratch, "result.pkl")
        with open(call, "wb") as f:
            pickle.dump((fn, args), f)
        code = ("import pickle, sys; fn, args = pickle.load(open(sys.argv[1], 'rb')); "
                "pickle.dump(fn(*args), open(sys.argv[2], 'wb'))")
        done = subprocess.run([sys.executable, "-c", code, call, result], stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        if done.returncode:
            raise RuntimeError(f"{fn.__name__} in a new process exited with {done.returncode}:\n"
                               f"{done.stderr.decode()[-3000:]}")
        with open(result, "rb") as f:
            return pickle.load(f)


def timed_read(server_pid: int, read: Callable[..., tuple[int, float]], *args: object) -> Rate:
    """`read(*args)` returns (tokens, seconds); adds the server CPU spent meanwhile."""
    server = cpu_seconds(server_pid)
    tokens, seconds = read(*args)
    return Rate(tokens / seconds, (cpu_seconds(server_pid) - server) * 1e9 / tokens)


def stream_run(dataset: str, storage: StorageConfig, engine: str, batch_rows: int, cold_steps: int,
               warm_steps: int, server_pid: int) -> StreamRun:
    """One rank's TokenStream over `cold_steps` + `warm_steps` steps of the train split, with a
    reader that has read nothing yet (run the local engine `in_fresh_process`)."""
    data = DataConfig(path=dataset)
    source = Datasets.load(data, storage).open_split("train", data, storage)
    stream = TokenStream(source, batch_rows, dp_rank=0, dp_size=1, skip=[], engine=engine, prefetch=4)
    row_tokens = source.row_tokens - 1  # targets, as the training loop counts tokens
    server_start = cpu_seconds(server_pid)
    start = time.perf_counter()
    first = cold_end = server_cold = None
    for i, _ in enumerate(stream.batches(0, 0, cold_steps + warm_steps)):
        first = first or time.perf_counter()
        if i == cold_steps - 1:
            cold_end, server_cold = time.perf_counter(), cpu_seconds(server_pid)
    end, server_end = time.perf_counter(), cpu_seconds(server_pid)
    cold, warm = (steps * batch_rows * row_tokens for steps in (cold_steps, warm_steps))
    return StreamRun(first - start,
                     Rate(cold / (cold_end - start), (server_cold - server_start) * 1e9 / cold),
                     Rate(warm / (end - cold_end), (server_end - server_cold) * 1e9 / warm) if warm else None)


def pyarrow_s3(endpoint_url: str) -> pafs.S3FileSystem:
    """The client a user would make for the server without raylm."""
    return pafs.S3FileSystem(endpoint_override=endpoint_url.split("://", 1)[1], scheme="http")


def _rows(table, row_tokens: int) -> np.ndarray:
    return table.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, row_tokens)


def pyarrow_whole_shards(endpoint_url: str, dataset: str, row_tokens: int) -> tuple[int, float]:
    """Cold pyarrow: a new S3 client lists the train shards and reads each whole, one after
    another (pyarrow keeps nothing between reads)."""
    start = time.perf_counter()
    fs = pyarrow_s3(endpoint_url)
    listed = fs.get_file_info(pafs.FileSelector(dataset[len("s3://"):]))
    rows = sum(len(_rows(pq.read_table(path, filesystem=fs, columns=["tokens"]), row_tokens))
               for path in sorted(f.path for f in listed if posixpath.basename(f.path).startswith("train-")))
    return rows * (row_tokens - 1), time.perf_counter() - start


def stream_row_groups(source: RowSource, rows: int) -> list[tuple[str, int]]:
    """(shard path in the bucket, row group) in the order the stream's first `rows` rows touch them."""
    _, shards, shard_rows = source.order.locate_many(np.arange(rows))
    touched = {(source.shard_uris[0][shard][len("s3://"):], row // ROW_GROUP_ROWS): None
               for shard, row in zip(shards.tolist(), shard_rows.tolist())}
    return list(touched)


def pyarrow_row_groups(endpoint_url: str, groups: list[tuple[str, int]], row_tokens: int) -> tuple[int, float]:
    """Cold pyarrow reading `groups` one by one: the stream's access pattern without its shard
    cache (what a reader does that fetches only the rows it needs)."""
    start = time.perf_counter()
    fs = pyarrow_s3(endpoint_url)
    files: dict[str, pq.ParquetFile] = {}
    rows = 0
    for path, group in groups:
        if path not in files:
            files[path] = pq.ParquetFile(fs.open_input_file(path))
        rows += len(_rows(files[path].read_row_group(group, columns=["tokens"]), row_tokens))
    return rows * (row_tokens - 1), time.perf_counter() - start


def beyond_cache_dataset(dataset: str, storage: StorageConfig) -> str:
    """A dataset whose train split is copies of `dataset`'s train shards (S3 server-side copies),
    enough of them that the split is 1.25x the reader's shard cache."""
    manifest = load_manifest(dataset, storage)
    copies = math.ceil(1.25 * SHARD_CACHE_BYTES / (manifest.splits["train"].rows * manifest.row_tokens * 4))
    output = f"{dataset}-x{copies}"
    fs, source = filesystem_for(dataset, storage)
    target = filesystem_for(output, storage)[1]
    shards = []
    for k in range(copies):
        for shard in manifest.splits["train"].shards:
            shards.append(dataclasses.replace(shard, file=f"copy{k:03d}/{shard.file}"))
            fs.copy_file(f"{source}/{shard.file}", f"{target}/{shards[-1].file}")
    for name in [manifest.tokenizer.file] + [s.file for s in manifest.splits["val"].shards]:
        fs.copy_file(f"{source}/{name}", f"{target}/{name}")
    splits = {**manifest.splits, "train": SplitInfo.of_shards(shards)}
    dataclasses.replace(manifest, splits=splits).save(output, storage)
    return output
