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
2. stream    `TokenStream(engine="ray")` over the byte dataset's train split on S3, one rank
             with the whole --batch-rows global batch, --steps steps, first batch excluded.
             Baseline: pyarrow reading the same train shards from S3 whole, one after another.
             Goal >= 0.5x. The local engine is shown for information.
3. headroom  what configs/demo-cpu.yaml's training step consumes: `train()` without Ray on the
             byte dataset (data.loader=local), median tokens/s of metrics.jsonl after step 1.
             That is the demo's global batch (16 x 256) in one process on --cpus threads, which
             is what its 2 one-thread workers do together. Goal: stream rate >= 10x that.
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
from typing import Callable, Optional

import pyarrow.parquet as pq
import ray
import ray.data
import torch

from _common import load_average, print_table, read_metrics
from raylm.config import DataConfig, StorageConfig, load_config
from raylm.data.corpus import builtin_sources, iter_documents
from raylm.data.manifest import Manifest
from raylm.data.prepare import ROW_GROUP_ROWS, prepare_dataset
from raylm.data.storage import ensure_bucket, filesystem_for, write_bytes
from raylm.data.stream import Datasets, TokenStream
from raylm.ray_runtime import use_loopback
from cluster.seaweedfs import SeaweedFS
from raylm.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_json, train_bpe
from raylm.train.local_env import LocalEnv
from raylm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo-cpu.yaml"
SEQ_LEN = 256  # the demo's
BUCKET = "s3://bench"
ENCODE_BATCH_DOCS = 256  # prepare's own batch (raylm.data.prepare._DOCUMENTS_PER_BATCH)
POOL_BATCH_DOCS = 8  # small pool tasks keep both processes busy over documents of uneven size
GOALS = {"prepare": 0.7, "stream": 0.5, "headroom": 10.0}

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

@dataclass
class Rate:
    tokens_per_s: float
    server_ms_per_mtok: float  # SeaweedFS CPU per million tokens: the cost of the requests made


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_read(s3: SeaweedFS, read: Callable[[], tuple[int, float]]) -> Rate:
    """`read()` returns (tokens, seconds); adds the server CPU spent meanwhile."""
    server = cpu_seconds(s3.pid)
    tokens, seconds = read()
    return Rate(tokens / seconds, (cpu_seconds(s3.pid) - server) * 1e9 / tokens)


def alternating(repeats: int, reads: dict[str, Callable[[], tuple[int, float]]],
                s3: SeaweedFS) -> tuple[dict[str, list[Rate]], str]:
    """`repeats` runs of each read, the reads taking turns so that a change in the machine's
    load hits them all; and the load average before the first."""
    load = load_average()
    runs: dict[str, list[Rate]] = {name: [] for name in reads}
    for _ in range(repeats):
        for name, read in reads.items():
            runs[name].append(timed_read(s3, read))
    return runs, load


def paired_note(ratios: list[float]) -> str:
    """Ratios of runs made next to each other: under a changing load, steadier than best/best."""
    return "paired runs: " + ", ".join(f"{r:.2f}x" for r in ratios)


def stream_read(dataset: str, storage: StorageConfig, engine: str, args: argparse.Namespace) -> tuple[int, float]:
    """One rank's TokenStream from its first batch to its last (start-up is reported apart)."""
    data = DataConfig(path=dataset)
    source = Datasets.load(data, storage).open_split("train", data, storage)
    stream = TokenStream(source, args.batch_rows, dp_rank=0, dp_size=1, skip=[], engine=engine, prefetch=4)
    rows, first = 0, None
    start = time.perf_counter()
    for batch in stream.batches(0, 0, args.steps):
        if first is None:
            first = time.perf_counter()
        else:
            rows += len(batch.tokens)
    seconds = time.perf_counter() - first
    log(f"stream {engine}: first batch after {first - start:.1f} s, then "
        f"{rows * SEQ_LEN / seconds:,.0f} tokens/s")
    return rows * SEQ_LEN, seconds


def whole_shards_read(uris: list[str], storage: StorageConfig) -> tuple[int, float]:
    """pyarrow reading each shard whole, one after another."""
    rows = 0
    start = time.perf_counter()
    for uri in uris:
        fs, path = filesystem_for(uri, storage)
        with fs.open_input_file(path) as f:
            column = pq.read_table(f, columns=["tokens"]).column("tokens").combine_chunks()
        rows += len(column.flatten().to_numpy().reshape(-1, SEQ_LEN + 1))
    return rows * SEQ_LEN, time.perf_counter() - start


def stream_row_groups(dataset: str, storage: StorageConfig, args: argparse.Namespace) -> list[tuple[str, int]]:
    """(shard URI, row group) in the order the stream's first --steps steps touch them."""
    data = DataConfig(path=dataset)
    source = Datasets.load(data, storage).open_split("train", data, storage)
    touched: dict[tuple[str, int], None] = {}
    for g in range(args.steps * args.batch_rows):
        _, shard, row = source.order.locate(g)
        touched[(source.shard_uris[0][shard], row // ROW_GROUP_ROWS)] = None
    return list(touched)


def row_groups_read(groups: list[tuple[str, int]], storage: StorageConfig) -> tuple[int, float]:
    """pyarrow reading `groups` one by one: the stream's access pattern without the stream."""
    files: dict[str, pq.ParquetFile] = {}
    rows = 0
    start = time.perf_counter()
    for uri, group in groups:
        if uri not in files:
            fs, path = filesystem_for(uri, storage)
            files[uri] = pq.ParquetFile(fs.open_input_file(path))
        column = files[uri].read_row_group(group, columns=["tokens"]).column("tokens").combine_chunks()
        rows += len(column.flatten().to_numpy().reshape(-1, SEQ_LEN + 1))
    return rows * SEQ_LEN, time.perf_counter() - start


def bench_stream(dataset: str, manifest: Manifest, args: argparse.Namespace, storage: StorageConfig,
                 s3: SeaweedFS) -> list[Row]:
    shards = manifest.shard_uris(dataset, "train")
    groups = stream_row_groups(dataset, storage, args)
    runs, load = alternating(args.repeats, {
        "whole": lambda: whole_shards_read(shards, storage),
        "groups": lambda: row_groups_read(groups, storage),
        "ray": lambda: stream_read(dataset, storage, "ray", args),
        "local": lambda: stream_read(dataset, storage, "local", args),
    }, s3)
    base, same, ray_, local = (max(runs[name], key=lambda r: r.tokens_per_s)
                               for name in ("whole", "groups", "ray", "local"))
    paired = [r.tokens_per_s / b.tokens_per_s for r, b in zip(runs["ray"], runs["whole"])]
    what = f"{args.steps} steps x {args.batch_rows} rows x {SEQ_LEN}"
    server = lambda r: f"SeaweedFS CPU {r.server_ms_per_mtok:,.0f} ms/Mtok"  # noqa: E731
    return [
        Row("stream, Ray Data engine", ray_.tokens_per_s, base.tokens_per_s, GOALS["stream"],
            f"{what}; baseline: pyarrow, whole shards in sequence; {paired_note(paired)}; "
            f"{server(ray_)}", load),
        Row("stream, local engine", local.tokens_per_s, base.tokens_per_s,
            note=f"{what}; for information; {server(local)}", load=load),
        Row("  pyarrow, whole train shards in sequence", base.tokens_per_s,
            note=f"{manifest.splits['train'].rows} rows in {len(shards)} shards; {server(base)}",
            load=load),
        Row("  pyarrow, the stream's row groups one by one", same.tokens_per_s, base.tokens_per_s,
            note=f"{len(groups)} row groups of {ROW_GROUP_ROWS} rows in stream order (no shuffling "
                 f"or batching): the cost of the access pattern; {server(same)}", load=load),
    ]


# -- 3. headroom -------------------------------------------------------------------------------

def training_rate(dataset: str, s3: SeaweedFS, args: argparse.Namespace, scratch: str) -> float:
    """Median tokens/s of the demo config's training steps (after the first), without Ray."""
    run_dir = os.path.join(scratch, "demo-run")
    cfg = load_config(DEMO_CONFIG, [
        f"data.path={dataset}", "data.loader=local", f"storage.endpoint_url={s3.endpoint_url}",
        f"train.steps={args.train_steps}", "schedule.warmup_steps=1", "train.eval_every=0",
        "checkpoint.every_steps=0", "train.tensorboard=false", f"train.log_every={args.train_steps}"])
    train(cfg, LocalEnv(run_dir))
    rates = [m["tokens_per_s"] for m in read_metrics(os.path.join(run_dir, "metrics.jsonl"))[1:]]
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
    p.add_argument("--steps", type=int, default=120, help="streaming steps per measurement")
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
        source_manifest = Datasets.load(DataConfig(path=byte_dataset), storage).manifest
        rows += bench_stream(byte_dataset, source_manifest, args, storage, s3)
    if not args.skip_headroom:
        load = load_average()
        consumed = training_rate(byte_dataset, s3, args, scratch)
        log(f"demo training step consumes {consumed:,.0f} tokens/s")
        rows.append(Row("demo-cpu training step consumes", consumed,
                        note=f"median of {args.train_steps - 1} steps, global batch 16 x {SEQ_LEN}, "
                             f"1 process, {torch.get_num_threads()} threads", load=load))
        stream = next((r for r in rows if r.figure == "stream, Ray Data engine"), None)
        if stream is not None:
            rows.append(Row("headroom: Ray Data stream / training", stream.value, consumed,
                            GOALS["headroom"], "stream rate over what the demo consumes", load))
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
