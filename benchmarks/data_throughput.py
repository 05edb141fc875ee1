"""Data-path throughput against a real S3 server (SeaweedFS on 127.0.0.1) and a local Ray.

    .venv/bin/python benchmarks/data_throughput.py [--corpus-docs N] [--tokenizer byte|bpe|both]

A token is one training target: a row of seq_len + 1 tokens counts seq_len, as the training
loop's tokens/s does. Each rate is the best of --repeats runs; a goal's figure and its baseline
run in turns, and the notes give the ratio of each such pair too (this machine's cores are
shared: read every figure next to its load averages).

1. prepare   `prepare_dataset` of the built-in corpus (this Python's stdlib sources, read from
             local disk, or with --inputs-on-s3 uploaded to s3://bench/corpus/ first) into
             s3://bench/stdlib-<tokenizer>-<seq_len>, end to end, fixed costs included.
             Baseline: the same documents' text already in memory, `Tokenizer.encode_batch` on
             the same cores, the faster of (a) in process (a BPE tokenizer's own Rust threads)
             and (b) a pool of --cpus spawned processes, one thread each. Goal >= 0.7x (BPE).
2. stream    `TokenStream` over the byte dataset's train split on S3, one rank with the whole
             --batch-rows global batch, each run with a reader that has read nothing yet (the
             Ray engine starts a new reader actor per stream; the local engine runs in a new
             process), over 1 + --warm-epochs epochs.
             COLD: the first epoch, timed from the call, so the window holds the reader's
             start-up and the S3 read of every shard (the reader caches whole shards of up to
             data.shard_cache_mb per process). WARM: the later epochs, every
             shard in the reader's cache, no S3 read (SeaweedFS's CPU shows it).
             Baseline: COLD pyarrow with no raylm code, in a new process: a new
             pyarrow.fs.S3FileSystem lists the train shards and reads each whole, one after
             another. Goal: the Ray engine's COLD stream >= 0.5x. The local engine and the
             WARM rates are shown for information.
             COLD beyond the cache: --beyond-cache-steps steps of a train split 1.25x the shard
             cache (server-side copies of the shards), against cold pyarrow reading only the row
             groups those steps need: where a real run's data is.
3. headroom  what configs/demo-cpu.yaml's training step consumes: `train()` without Ray on the
             byte dataset (data.loader=local), median tokens/s of metrics.jsonl after step 1, of
             the demo's global batch (16 x 256) on one thread, times the demo's 2 one-thread
             workers (an upper bound: perfect scaling). Measured in the same run as the stream.
             Goal: the Ray engine's COLD stream rate >= 10x that.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

import numpy as np
import ray
import ray.data
import torch

from _common import load_average, print_table
from _data_reads import (Rate, StreamRun, beyond_cache_dataset, in_fresh_process, pyarrow_row_groups,
                         pyarrow_whole_shards, stream_row_groups, stream_run, timed_read)
from cluster.seaweedfs import SeaweedFS
from raylm.config import DataConfig, StorageConfig, load_config
from raylm.data.corpus import builtin_sources, iter_documents
from raylm.data.manifest import Manifest
from raylm.data.manifest import ROW_GROUP_ROWS
from raylm.data.prepare import prepare_dataset
from raylm.data.storage import ensure_bucket, write_bytes
from raylm.data.stream import Datasets
from raylm.ray_runtime import use_loopback
from raylm.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_json, train_bpe
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo-cpu.yaml"
SEQ_LEN = 256  # the demo's
BUCKET = "s3://bench"
ENCODE_BATCH_DOCS = 256  # prepare's own batch (raylm.data.prepare._DOCUMENTS_PER_BATCH)
POOL_BATCH_DOCS = 8  # small pool tasks keep both processes busy over documents of uneven size
GOALS = {"prepare": 0.7, "stream": 0.5, "headroom": 10.0}

T = TypeVar("T")

_POOL_TOKENIZER: Optional[Tokenizer] = None  # one per pool process, built by _pool_init


@dataclass
class Row:
    figure: str
    value: float  # tokens/s
    baseline: Optional[float] = None
    goal: Optional[float] = None
    note: str = ""
    load: str = ""

    def cells(self) -> list[str]:
        ratio = self.value / self.baseline if self.baseline else None
        verdict = "" if ratio is None or self.goal is None else ("met" if ratio >= self.goal else "MISSED")
        return [self.figure, f"{self.value:,.0f}", f"{self.baseline:,.0f}" if self.baseline else "",
                f"{ratio:.2f}x" if ratio is not None else "", f">= {self.goal}x" if self.goal else "",
                verdict, self.load, self.note]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {load_average()}] {message}", flush=True)


# -- 1. prepare --------------------------------------------------------------------------------

def _pool_init(tokenizer_json: str) -> None:
    # One thread per process: the pool, not the tokenizer's Rust threads, spreads the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _POOL_TOKENIZER
    _POOL_TOKENIZER = tokenizer_from_json(tokenizer_json)


def _pool_count(texts: list[str]) -> int:
    assert _POOL_TOKENIZER is not None, "a pool process runs _pool_init first"
    return sum(len(ids) for ids in _POOL_TOKENIZER.encode_batch(texts))


def encode_baselines(tok: Tokenizer, texts: list[str], cpus: int) -> dict[str, float]:
    """tokens/s of encode_batch over `texts` (in memory): in process, and in a process pool."""
    start = time.perf_counter()
    tokens = sum(len(ids) for i in range(0, len(texts), ENCODE_BATCH_DOCS)
                 for ids in tok.encode_batch(texts[i:i + ENCODE_BATCH_DOCS]))
    rates = {"in process": tokens / (time.perf_counter() - start)}
    # spawn, not fork: this process runs Ray's threads.
    with multiprocessing.get_context("spawn").Pool(cpus, _pool_init, (tok.to_json(),)) as pool:
        pool.map(_pool_count, [["warm-up"]] * cpus * 4, chunksize=1)  # processes up, tokenizer built
        batches = [texts[i:i + POOL_BATCH_DOCS] for i in range(0, len(texts), POOL_BATCH_DOCS)]
        start = time.perf_counter()
        pooled = sum(pool.imap_unordered(_pool_count, batches))
        rates[f"{cpus}-process pool"] = pooled / (time.perf_counter() - start)
    return rates


def corpus_inputs(args: argparse.Namespace, storage: StorageConfig) -> tuple[list[str], list[str]]:
    """The inputs to give prepare_dataset, and the corpus documents' texts in order."""
    sources = builtin_sources(args.corpus_docs)
    texts = [text for source in sources for text in iter_documents(source)]
    if not args.inputs_on_s3:
        return [], texts
    # prepare reads .txt files (a .py is an unknown extension); the paths keep the sorted order.
    root = f"{BUCKET}/corpus"
    for i, text in enumerate(texts):
        write_bytes(f"{root}/{i:05d}.txt", text.encode("utf-8"), storage)
    return [root], texts


def prepare(kind: str, tok: Tokenizer, inputs: list[str], args: argparse.Namespace,
            storage: StorageConfig) -> tuple[str, Manifest, float]:
    """Prepare the corpus with `tok` into the bucket; returns the URI, manifest and seconds."""
    output = f"{BUCKET}/stdlib-{kind}-{SEQ_LEN}"
    start = time.perf_counter()
    manifest = prepare_dataset(inputs, output, tok, SEQ_LEN, val_fraction=0.1, storage=storage,
                               max_documents=args.corpus_docs, overwrite=True)
    return output, manifest, time.perf_counter() - start


def bench_prepare(kind: str, tok: Tokenizer, inputs: list[str], texts: list[str],
                  args: argparse.Namespace, storage: StorageConfig) -> tuple[str, list[Row]]:
    # A few documents first: starts the Ray Data workers and shows the fixed cost of a prepare.
    start = time.perf_counter()
    prepare_dataset(inputs, f"{BUCKET}/warm-up-{kind}", tok, SEQ_LEN, val_fraction=0.1,
                    storage=storage, max_documents=4, overwrite=True)
    fixed = time.perf_counter() - start
    load = load_average()
    # Alternated, so that a change in the machine's load hits both sides.
    seconds, baselines, paired = float("inf"), {}, []
    for _ in range(args.repeats):
        output, manifest, took = prepare(kind, tok, inputs, args, storage)
        seconds = min(seconds, took)
        tokens = manifest.splits["train"].tokens + manifest.splits["val"].tokens
        log(f"prepare {kind}: {tokens:,} tokens in {took:.1f} s (4-document prepare: {fixed:.1f} s)")
        rates = encode_baselines(tok, texts, args.cpus)
        log(f"encode_batch {kind}: " + ", ".join(f"{k} {v:,.0f} tokens/s" for k, v in rates.items()))
        baselines = {k: max(v, baselines.get(k, 0.0)) for k, v in rates.items()}
        paired.append(tokens / took / max(rates.values()))
    best = max(baselines, key=baselines.get)
    source = "S3 .txt files" if args.inputs_on_s3 else "local stdlib files"
    rows = [Row(f"prepare, {kind} ({tok.vocab_size} vocab)", tokens / seconds,
                baselines[best], GOALS["prepare"] if kind == "bpe" else None,
                f"{len(texts)} docs from {source}, {seconds:.1f} s (a 4-doc prepare: {fixed:.1f} s); "
                f"baseline: encode_batch {best}; {paired_note(paired)}", load)]
    rows += [Row(f"  encode_batch {name}, {kind}", rate, note="baseline candidate")
             for name, rate in baselines.items()]
    return output, rows


# -- 2. stream ---------------------------------------------------------------------------------

def alternating(repeats: int, measures: dict[str, Callable[[], T]]) -> tuple[dict[str, list[T]], str]:
    """`repeats` runs of each measure, taking turns so that a change in the machine's load hits
    them all; and the load average before the first."""
    load = load_average()
    runs: dict[str, list[T]] = {name: [] for name in measures}
    for _ in range(repeats):
        for name, measure in measures.items():
            runs[name].append(measure())
            if isinstance(runs[name][-1], StreamRun):
                run = runs[name][-1]
                log(f"stream {name}: first batch after {run.first_batch_s:.2f} s, cold {run.cold.tokens_per_s:,.0f}"
                    + (f", warm {run.warm.tokens_per_s:,.0f}" if run.warm else "") + " tokens/s")
    return runs, load


def paired_note(ratios: list[float]) -> str:
    """Ratios of runs made next to each other: under a changing load, steadier than best/best."""
    return "paired runs: " + ", ".join(f"{r:.2f}x" for r in ratios)


def server_note(rate: Rate) -> str:
    return f"SeaweedFS CPU {rate.server_ms_per_mtok:,.0f} ms/Mtok"


def stream_measures(dataset: str, storage: StorageConfig, s3: SeaweedFS, batch_rows: int, cold_steps: int,
                    warm_steps: int) -> dict[str, Callable[[], StreamRun]]:
    """Both engines, each with a reader that has read nothing yet."""
    shape = (batch_rows, cold_steps, warm_steps, s3.pid)
    return {"ray": lambda: stream_run(dataset, storage, "ray", *shape),
            "local": lambda: in_fresh_process(stream_run, dataset, storage, "local", *shape)}


ENGINES = {"ray": "Ray Data engine", "local": "local engine"}


def bench_stream(dataset: str, args: argparse.Namespace, storage: StorageConfig, s3: SeaweedFS) -> list[Row]:
    data = DataConfig(path=dataset)
    datasets = Datasets.load(data, storage)
    split, row_tokens = datasets.manifest.splits["train"], datasets.manifest.row_tokens
    epoch_steps = split.rows // args.batch_rows
    groups = stream_row_groups(datasets.open_split("train", data, storage), epoch_steps * args.batch_rows)
    runs, load = alternating(args.repeats, {
        "whole": lambda: in_fresh_process(timed_read, s3.pid, pyarrow_whole_shards, s3.endpoint_url, dataset,
                                          row_tokens),
        "groups": lambda: in_fresh_process(timed_read, s3.pid, pyarrow_row_groups, s3.endpoint_url, groups,
                                           row_tokens),
        **stream_measures(dataset, storage, s3, args.batch_rows, epoch_steps, epoch_steps * args.warm_epochs),
    })
    base, same = (max(runs[name], key=lambda r: r.tokens_per_s) for name in ("whole", "groups"))
    rows = []
    for name, engine in ENGINES.items():
        cold = max(runs[name], key=lambda r: r.cold.tokens_per_s)
        warm = max(runs[name], key=lambda r: r.warm.tokens_per_s)
        paired = [r.cold.tokens_per_s / b.tokens_per_s for r, b in zip(runs[name], runs["whole"])]
        rows += [
            Row(f"stream COLD, {engine}", cold.cold.tokens_per_s, base.tokens_per_s,
                GOALS["stream"] if name == "ray" else None,
                f"epoch 1 ({epoch_steps} steps x {args.batch_rows} rows x {row_tokens - 1}) from the call, "
                f"so with the reader's start-up (first batch after {cold.first_batch_s:.2f} s) and every "
                f"shard's S3 read; baseline: pyarrow COLD, whole shards; {paired_note(paired)}; "
                f"{server_note(cold.cold)}", load),
            Row(f"stream WARM, {engine}", warm.warm.tokens_per_s, base.tokens_per_s,
                note=f"epochs 2-{1 + args.warm_epochs} of the same reader: every shard in its cache, no S3 "
                     f"read; against the COLD pyarrow read (not like for like); {server_note(warm.warm)}",
                load=load)]
    return rows + [
        Row("  pyarrow COLD, whole train shards in sequence", base.tokens_per_s,
            note=f"the baseline: {split.rows} rows in {len(split.shards)} shards; {server_note(base)}", load=load),
        Row("  pyarrow COLD, the stream's row groups one by one", same.tokens_per_s, base.tokens_per_s,
            note=f"{len(groups)} row groups of {ROW_GROUP_ROWS} rows in epoch 1's order (no shuffling or "
                 f"batching): only the rows needed, without a shard cache; {server_note(same)}", load=load)]


def bench_beyond_cache(dataset: str, args: argparse.Namespace, storage: StorageConfig, s3: SeaweedFS) -> list[Row]:
    """Cold streaming where a real run's data is: a train split larger than the shard cache."""
    start = time.perf_counter()
    big = beyond_cache_dataset(dataset, storage)
    data = DataConfig(path=big)
    datasets = Datasets.load(data, storage)
    split, row_bytes = datasets.manifest.splits["train"], datasets.manifest.row_tokens * 4
    log(f"{big}: {len(split.shards)} shards, {split.rows * row_bytes / 2**30:.2f} GiB, copied in "
        f"{time.perf_counter() - start:.1f} s")
    rows = args.beyond_cache_steps * args.batch_rows
    source = datasets.open_split("train", data, storage)
    groups = stream_row_groups(source, rows)
    touched = len(np.unique(source.order.locate_many(np.arange(rows))[1]))
    runs, load = alternating(args.repeats, {
        "groups": lambda: in_fresh_process(timed_read, s3.pid, pyarrow_row_groups, s3.endpoint_url, groups,
                                           datasets.manifest.row_tokens),
        **stream_measures(big, storage, s3, args.batch_rows, args.beyond_cache_steps, 0),
    })
    base = max(runs["groups"], key=lambda r: r.tokens_per_s)
    fetched_mb = touched * split.rows / len(split.shards) * row_bytes / 1e6
    out = []
    for name, engine in ENGINES.items():
        best = max(runs[name], key=lambda r: r.cold.tokens_per_s)
        paired = [r.cold.tokens_per_s / b.tokens_per_s for r, b in zip(runs[name], runs["groups"])]
        out.append(Row(
            f"stream COLD beyond the cache, {engine}", best.cold.tokens_per_s, base.tokens_per_s,
            note=f"{args.beyond_cache_steps} steps x {args.batch_rows} rows of a {len(split.shards)}-shard split "
                 f"1.25x the shard cache, from the call (first batch after {best.first_batch_s:.2f} s): "
                 f"{touched} shards touched, each fetched whole ({fetched_mb:,.0f} MB for "
                 f"{rows * row_bytes / 1e6:.1f} MB of rows); baseline: pyarrow COLD, those rows' row "
                 f"groups; {paired_note(paired)}; {server_note(best.cold)}", load=load))
    return out + [Row("  pyarrow COLD, those steps' row groups one by one", base.tokens_per_s,
                      note=f"{len(groups)} row groups of {ROW_GROUP_ROWS} rows; {server_note(base)}", load=load)]


# -- 3. headroom -------------------------------------------------------------------------------

def training_rate(dataset: str, s3: SeaweedFS, args: argparse.Namespace, scratch: str) -> float:
    """Median tokens/s of the demo config's training steps (after the first), without Ray, in
    this process on one thread."""
    run_dir = os.path.join(scratch, "demo-run")
    cfg = load_config(DEMO_CONFIG, [
        f"data.path={dataset}", "data.loader=local", f"storage.endpoint_url={s3.endpoint_url}",
        f"train.steps={args.train_steps}", "schedule.warmup_steps=1", "train.eval_every=0",
        "checkpoint.every_steps=0", "train.tensorboard=false", f"train.log_every={args.train_steps}"])
    # One thread, as each of the demo's workers has: two threads of one process on two cores
    # that other jobs load spin against each other (10x slower steps seen at load 30).
    torch.set_num_threads(1)
    train_local(cfg, run_dir)
    rates = [m["tokens_per_s"] for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[1:]]
    return statistics.median(rates)


# -- main --------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-docs", type=int, default=None, help="first N documents of the built-in corpus")
    p.add_argument("--tokenizer", choices=("byte", "bpe", "both"), default="both",
                   help="tokenizers whose prepare is timed (the byte dataset is always made: "
                        "streaming and the demo read it)")
    p.add_argument("--bpe-vocab", type=int, default=4096)
    p.add_argument("--bpe-train-docs", type=int, default=150, help="documents the BPE is trained on")
    p.add_argument("--inputs-on-s3", action="store_true", help="upload the corpus to S3 and prepare from there")
    p.add_argument("--cpus", type=int, default=2, help="Ray's logical CPUs, and the baseline pool's processes")
    p.add_argument("--warm-epochs", type=int, default=2,
                   help="epochs each stream runs after its first (cold) one, from its cache")
    p.add_argument("--beyond-cache-steps", type=int, default=16,
                   help="steps streamed cold from a train split larger than the shard cache (0: skip)")
    p.add_argument("--batch-rows", type=int, default=256, help="streaming global batch in rows")
    p.add_argument("--repeats", type=int, default=2, help="measurements of each rate; the best counts")
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--skip-prepare", action="store_true", help="make the byte dataset without timing it")
    p.add_argument("--skip-stream", action="store_true")
    p.add_argument("--skip-headroom", action="store_true")
    return p.parse_args()


def run(args: argparse.Namespace, s3: SeaweedFS, scratch: str) -> list[Row]:
    storage = StorageConfig(endpoint_url=s3.endpoint_url)
    ensure_bucket(BUCKET, storage)
    inputs, texts = corpus_inputs(args, storage)
    log(f"corpus: {len(texts)} documents, {sum(len(t.encode()) for t in texts):,} bytes")
    rows: list[Row] = []
    timed = [] if args.skip_prepare else (["byte", "bpe"] if args.tokenizer == "both" else [args.tokenizer])
    byte_dataset = None
    for kind in timed:
        if kind == "bpe":
            start = time.perf_counter()
            tok = train_bpe([], args.bpe_vocab, os.path.join(scratch, "bpe.json"),
                            max_documents=args.bpe_train_docs)
            log(f"BPE of {args.bpe_vocab} trained on {args.bpe_train_docs} documents in "
                f"{time.perf_counter() - start:.1f} s")
        else:
            tok = load_tokenizer("byte")
        output, prepared = bench_prepare(kind, tok, inputs, texts, args, storage)
        rows += prepared
        byte_dataset = output if kind == "byte" else byte_dataset
    if byte_dataset is None and not (args.skip_stream and args.skip_headroom):
        byte_dataset, _, _ = prepare("byte", load_tokenizer("byte"), inputs, args, storage)
    if not args.skip_stream:
        rows += bench_stream(byte_dataset, args, storage, s3)
        if args.beyond_cache_steps:
            rows += bench_beyond_cache(byte_dataset, args, storage, s3)
    if not args.skip_headroom:
        load = load_average()
        one = training_rate(byte_dataset, s3, args, scratch)
        # The demo's workers split the global batch: together at most `workers` times one
        # thread's rate (perfect scaling, no all-reduce), which overstates the consumption.
        workers = load_config(DEMO_CONFIG, []).parallel.num_workers
        consumed = one * workers
        log(f"demo training step: {one:,.0f} tokens/s on one thread, x {workers} workers = {consumed:,.0f}")
        rows.append(Row("demo-cpu training step consumes (upper bound)", consumed,
                        note=f"{workers} x the median of {args.train_steps - 1} steps of the whole global "
                             f"batch (16 x {SEQ_LEN}) on 1 thread without Ray ({one:,.0f} tokens/s)",
                        load=load))
        # The cold stream is the one that counts: a run's first epoch reads every shard from S3.
        for state in ("COLD", "WARM"):
            stream = next((r for r in rows if r.figure == f"stream {state}, Ray Data engine"), None)
            if stream is not None:
                rows.append(Row(f"headroom {state}: Ray Data stream / training", stream.value, consumed,
                                GOALS["headroom"] if state == "COLD" else None,
                                f"stream {state.lower()} over what the demo's step consumes, "
                                "both from this run", load))
    return rows


def main() -> None:
    args = parse_args()
    use_loopback()
    # A developer's profile or endpoint must not redirect the benchmark away from SeaweedFS.
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)
    started = datetime.datetime.now().astimezone()
    with SeaweedFS() as s3, tempfile.TemporaryDirectory(prefix="raylm-data-bench-") as scratch:
        os.environ.update(s3.env())  # before ray.init: Ray's workers inherit the credentials
        # address="local": never join a cluster someone else started on this machine.
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False,
                 object_store_memory=1 << 30,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        # Ray Data's per-dataset INFO lines would bury the figures.
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            rows = run(args, s3, scratch)
        finally:
            ray.shutdown()
    print(f"\n{started:%Y-%m-%d %H:%M %Z}, {platform.node()}, {os.cpu_count()} cores, "
          f"Ray {ray.__version__}, load at the end {load_average()}")
    print_table(["figure", "tokens/s", "baseline tokens/s", "ratio", "goal", "", "load 1/5/15 min",
                 "notes"], [row.cells() for row in rows])


if __name__ == "__main__":
    main()
