"""The data-preparation job: text -> tokens -> packed rows -> Parquet shards + manifest.

    inputs ──Ray Data map_batches (one task per file, in parallel)──> documents' tokens
           ──driver, in corpus order──> one token stream per split ──> rows ──Ray tasks──> shards

Each document's tokens are followed by exactly one end-of-text token (empty documents are
skipped), so consecutive documents are separated by one end-of-text token, never two.

Split: a document goes to val iff the first 8 bytes of blake2b(UTF-8 text), read as an unsigned
big-endian integer, are below val_fraction * 2**64 (duplicates land in the same split). The same
number finds exact duplicate documents: each split counts them in the manifest
(`duplicate_documents`, `duplicate_tokens`), so that "unique tokens" means what it says. A corpus
of a single document is split by position instead: the first (1 - val_fraction) of its tokens
train, the rest val, as nanoGPT does with tinyshakespeare.

Quality filter (opt-in, `quality_filter="gopher"`; `raylm.data.quality`): each document is judged
on the worker that reads it, before it is tokenized; a dropped one travels to the driver as a row
without tokens that names its file, filter and reason, is counted there and packed nowhere.

Determinism: Ray Data runs with preserve_order, and each split's stream is packed sequentially
by the driver, so the same inputs give byte-identical shards whatever the scheduling.
Shards and the tokenizer are written first and manifest.json last: an interrupted prepare
leaves no manifest, and `load_manifest` refuses the directory. See `raylm.data.manifest` for
the layout and the meaning of the counts.
"""

from __future__ import annotations

import hashlib
import logging
import re
from functools import lru_cache
from itertools import chain
from typing import Iterator, Optional, Union

import numpy as np
import pyarrow as pa
import ray

from raylm.config import ConfigError, StorageConfig
from raylm.data import rowstats
from raylm.data.corpus import (BUILTIN_CORPUS, InputError, Source, builtin_sources, check_sources, find_sources,
                               iter_documents)
from raylm.data.manifest import (MANIFEST_FILE, SPLITS, TOKENS_COLUMN, VERIFIED_FILE, DataCheck, DatasetError,
                                 Manifest, QualityFilterInfo, RowStatistic, ShardInfo,
                                 SplitInfo, TokenizerInfo, shard_bytes, shard_table)
from raylm.data.quality import DropCounts, check_quality_filter, dropped_column, judge
from raylm.data.storage import claim_output, join, read_bytes, write_bytes, writing_over
from raylm.data.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer, tokenizer_from_json
from raylm.progress import Progress
from raylm.ray_runtime import start_ray

log = logging.getLogger(__name__)

DEFAULT_SHARD_ROWS = 8192
_DOCUMENTS_PER_BATCH = 256
_MAX_PENDING_WRITES = 4
"""Shards handed to writer tasks and not yet written, per split: bounds the driver's memory."""


def prepare_dataset(
    inputs: list[str],
    output: str,
    tokenizer: Union[str, Tokenizer] = "byte",
    seq_len: int = 256,
    val_fraction: float = 0.1,
    lines_as_documents: bool = False,
    storage: Optional[StorageConfig] = None,
    max_documents: Optional[int] = None,
    shard_rows: int = DEFAULT_SHARD_ROWS,
    overwrite: bool = False,
    ray_address: Optional[str] = None,
    quality_filter: Optional[str] = None,
) -> Manifest:
    """Tokenize `inputs` and write a prepared dataset to `output` (a directory or s3:// prefix).

    inputs: .txt, .jsonl ("text" field) and .parquet ("text" column) files, or directories of
        them (walked recursively); empty: the built-in corpus (Python's standard library).
    tokenizer: "byte", the path/URI of a tokenizer.json, or a Tokenizer.
    seq_len: tokens per training sequence; rows hold seq_len + 1 tokens.
    lines_as_documents: each line of a .txt file is a document (else the whole file is one).
    max_documents: keep only the first documents of the corpus (for tests and quick runs); with a
        quality filter, the first documents read, those it drops among them.
    shard_rows: rows per shard file (the last shard of a split may hold fewer).
    overwrite: replace a prepared dataset already at `output`, or what an interrupted prepare
        left there (else that is an error); a directory holding other files is always refused.
    ray_address: the cluster to join (`raylm.ray_runtime.start_ray`'s rule when None).
    quality_filter: "gopher" drops the documents datatrove's Gopher quality and repetition
        filters drop, counted in the manifest (`raylm.data.quality`; the `quality` extra); None
        (the default) keeps every document.

    Uses the connected Ray cluster, or joins or starts one (and afterwards leaves it); every check
    that needs no cluster (arguments, the tokenizer, the inputs' first bytes) runs before.
    An overwrite writes the new dataset beside the old one and replaces it only once it is
    whole: a failed one leaves the old dataset as it was; a failed fresh one leaves nothing.
    """
    for name, value, least in (("seq_len", seq_len, 1), ("shard_rows", shard_rows, 1),
                               ("max_documents", max_documents or 1, 1)):
        if value < least:
            raise ConfigError(f"{name} must be at least {least}, got {value}")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    check_quality_filter(quality_filter)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer, storage)
    replacing = claim_output(output, "a prepared dataset", _dataset_file, overwrite, storage)
    if inputs:
        sources = check_sources(find_sources(inputs, lines_as_documents, storage), storage)
        source_names = list(inputs)
    else:
        sources, source_names = builtin_sources(max_documents), [BUILTIN_CORPUS]
    with writing_over(output, storage, replacing, commit=MANIFEST_FILE) as target:
        return _prepare(sources, source_names, tok, target, seq_len, val_fraction, storage, max_documents,
                        shard_rows, ray_address, quality_filter)


_SHARD_NAME = re.compile(r"(train|val)-\d{5}\.parquet")


def _dataset_file(name: str) -> bool:
    """Whether `name` is one a prepare writes at the top of its output."""
    return name in (MANIFEST_FILE, TOKENIZER_FILE, VERIFIED_FILE) or _SHARD_NAME.fullmatch(name) is not None


def _prepare(sources: list[Source], source_names: list[str], tok: Tokenizer, output: str, seq_len: int,
             val_fraction: float, storage: Optional[StorageConfig], max_documents: Optional[int],
             shard_rows: int, ray_address: Optional[str], quality_filter: Optional[str]) -> Manifest:
    """Tokenize, pack and write the dataset into `output`, the manifest last."""
    started_ray = not ray.is_initialized()
    if started_ray:
        start_ray(ray_address, address_name="--ray-address")
    try:
        splits, split_rule, quality = _write_shards(sources, tok, output, seq_len, val_fraction,
                                                    storage, max_documents, shard_rows, quality_filter)
        data_check = _data_check(output, splits["train"], tok.vocab_size, seq_len, storage) \
            if splits["train"].rows else None
    finally:
        if started_ray:
            ray.shutdown()

    if splits["train"].rows == 0:
        raise DatasetError(f"the train split has fewer than seq_len + 1 = {seq_len + 1} tokens; "
                           f"give more input or a smaller --seq-len")
    if val_fraction > 0 and splits["val"].rows == 0:
        log.warning("the val split of %s is empty: too few documents or tokens for val_fraction=%s",
                    output, val_fraction)
    tok.save(join(output, TOKENIZER_FILE), storage)
    manifest = Manifest(tokenizer=TokenizerInfo.of(tok), seq_len=seq_len, splits=splits,
                        sources=source_names, split_rule=split_rule, val_fraction=val_fraction,
                        data_check=data_check, quality_filter=quality)
    manifest.save(output, storage)
    return manifest


def _write_shards(sources: list[Source], tok: Tokenizer, output: str, seq_len: int,
                  val_fraction: float, storage: Optional[StorageConfig],
                  max_documents: Optional[int], shard_rows: int,
                  quality_filter: Optional[str]) -> tuple[dict[str, SplitInfo], str, Optional[QualityFilterInfo]]:
    """Pack each split's token stream into shards; returns the splits, the split rule and what
    the quality filter dropped."""
    packers = {split: _Packer(output, split, seq_len, shard_rows, tok.eot_id, storage) for split in SPLITS}
    progress = Progress(f"prepare ({len(sources)} file(s))", unit="documents")
    batches = map(lambda batch: _counted(progress, batch),
                  _tokenized_documents(sources, tok, val_fraction, storage, max_documents, quality_filter))
    drops = DropCounts(quality_filter) if quality_filter else None
    if drops is not None:
        batches = map(drops.kept, batches)
    # Hold the first batches back until a second document shows this is not a one-document corpus.
    held, documents = [], 0
    for batch in batches:
        held.append(batch)
        documents += batch.num_rows
        if documents > 1:
            break
    if documents == 0:
        if drops is not None and drops.total:
            raise InputError(f"{drops.summary()}: no document is left to prepare")
        raise InputError("the inputs hold no documents (every file or record is empty)")
    if documents == 1:
        split_rule = "position"
        stream = np.concatenate([batch["tokens"].combine_chunks().flatten().to_numpy() for batch in held])
        train_tokens = len(stream) - int(len(stream) * val_fraction)
        packers["train"].add(stream[:train_tokens])
        packers["val"].add(stream[train_tokens:])
    else:
        split_rule = "hash"
        for batch in chain(held, batches):
            is_val = batch["val"].to_numpy(zero_copy_only=False)
            for split, mask in (("train", ~is_val), ("val", is_val)):
                if mask.any():
                    chosen = batch.filter(pa.array(mask))
                    tokens = chosen["tokens"].combine_chunks()
                    packers[split].add(tokens.flatten().to_numpy(),
                                       chosen["digest"].to_numpy(), np.diff(tokens.offsets.to_numpy()))
    progress.close()
    if drops is not None:
        print(f"raylm: prepare: {drops.summary()}", flush=True)
    splits = {split: packer.finish() for split, packer in packers.items()}
    for split, info in splits.items():
        if info.duplicate_documents:
            print(f"raylm: prepare: {info.duplicate_documents:,} documents of the {split} split repeat an earlier one "
                  f"exactly ({info.duplicate_tokens:,} tokens): packed, but not counted as unique", flush=True)
    return splits, split_rule, drops.info() if drops is not None else None


def _counted(progress: Progress, batch: pa.Table) -> pa.Table:
    # Ray Data's own progress blocks are off unless verbose: seven lines every 10 s on a console
    # that is not a terminal.
    progress.update(batch.num_rows, tokens=len(batch["tokens"].combine_chunks().flatten()))
    return batch


def _tokenized_documents(sources: list[Source], tok: Tokenizer, val_fraction: float,
                         storage: Optional[StorageConfig], max_documents: Optional[int],
                         quality_filter: Optional[str]) -> Iterator[pa.Table]:
    """Tables of (val: bool, digest: uint64, tokens: list<int32>), one row per document in corpus
    order; each document's tokens end with the end-of-text token. With a quality filter, a
    `dropped` column too: null for a kept document, else its {file, filter, reason} (no tokens)."""
    context = ray.data.DataContext.get_current()
    preserve_order, progress_bars = context.execution_options.preserve_order, context.enable_progress_bars
    context.execution_options.preserve_order = True
    context.enable_progress_bars = logging.getLogger("ray.data").isEnabledFor(logging.INFO)  # shown when verbose
    try:
        files = ray.data.from_items([{"uri": s.uri, "kind": s.kind} for s in sources])
        documents = files.map_batches(
            _tokenize_file, batch_size=1, batch_format="pyarrow",
            fn_kwargs={"tokenizer_json": tok.to_json(), "val_fraction": val_fraction, "storage": storage,
                       "quality_filter": quality_filter})
        if max_documents is not None:
            documents = documents.limit(max_documents)
        yield from documents.iter_batches(batch_size=None, batch_format="pyarrow")
    except Exception as e:  # a bad input found deep in a file: its one line, not Ray's task traceback
        if (found := _input_error(e)) is None:
            raise
        raise type(found)(str(found)) from None
    finally:
        context.execution_options.preserve_order, context.enable_progress_bars = preserve_order, progress_bars


def _input_error(error: BaseException) -> Optional[Union[InputError, ConfigError]]:
    """The InputError a Ray task raised (or ConfigError: a worker without the quality filter's
    libraries), under Ray's wrappers (whose own message is a traceback)."""
    found = None
    while error is not None:
        if isinstance(error, (InputError, ConfigError)):
            found = error
        error = getattr(error, "cause", None) or error.__cause__
    return found


@lru_cache(maxsize=2)
def _cached_tokenizer(tokenizer_json: str) -> Tokenizer:
    # Ray reuses worker processes: build a large BPE once per worker, not once per file.
    return tokenizer_from_json(tokenizer_json)


def _digest(text: str) -> int:
    """blake2b-64 of the UTF-8 text: the split rule's number, and what finds exact duplicates."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def _is_val(digest: int, val_fraction: float) -> bool:
    return digest < val_fraction * 2**64


def _tokenize_file(files: pa.Table, tokenizer_json: str, val_fraction: float,
                   storage: Optional[StorageConfig], quality_filter: Optional[str]) -> Iterator[pa.Table]:
    """Ray Data UDF: the documents of one input file, tokenized, in batches."""
    tok = _cached_tokenizer(tokenizer_json)
    source = Source(files["uri"][0].as_py(), files["kind"][0].as_py())
    texts: list[str] = []
    for text in iter_documents(source, storage):
        texts.append(text)
        if len(texts) == _DOCUMENTS_PER_BATCH:
            yield _token_table(source, tok, texts, val_fraction, quality_filter)
            texts = []
    if texts:
        yield _token_table(source, tok, texts, val_fraction, quality_filter)


def _token_table(source: Source, tok: Tokenizer, texts: list[str], val_fraction: float,
                 quality_filter: Optional[str]) -> pa.Table:
    verdicts = [judge(quality_filter, text) for text in texts] if quality_filter else [None] * len(texts)
    try:
        encoded = iter(tok.encode_batch([text for text, verdict in zip(texts, verdicts) if verdict is None]))
    except Exception as e:  # the tokenizer's own limits (no unknown token): no restart or retry cures them
        raise InputError(f"input {source.uri}: the tokenizer cannot tokenize it ({e})") from e
    # A text of only characters the tokenizer drops encodes to nothing; skipping it keeps one
    # end-of-text token between documents. A dropped document keeps its row, without tokens, so
    # that max_documents counts it where it was read.
    rows = []  # (text, tokens, verdict)
    for text, verdict in zip(texts, verdicts):
        if verdict is not None:
            rows.append((text, [], verdict))
        elif ids := next(encoded):
            rows.append((text, ids + [tok.eot_id], None))
    lengths = [len(ids) for _, ids, _ in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(chain.from_iterable(ids for _, ids, _ in rows), dtype=np.int32, count=int(offsets[-1]))
    digests = [_digest(text) for text, _, _ in rows]
    columns = {
        "val": pa.array([_is_val(digest, val_fraction) for digest in digests], type=pa.bool_()),
        "digest": pa.array(digests, type=pa.uint64()),
        "tokens": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values)),
    }
    if quality_filter:
        columns["dropped"] = dropped_column(source.uri, [verdict for _, _, verdict in rows])
    return pa.table(columns)


class _Packer:
    """Cuts one split's token stream into rows of seq_len + 1 tokens (consecutive rows share a
    token) and hands each full shard of rows to a writer task."""

    def __init__(self, output: str, split: str, seq_len: int, shard_rows: int, eot_id: int,
                 storage: Optional[StorageConfig]) -> None:
        self.output, self.split, self.seq_len, self.shard_rows = output, split, seq_len, shard_rows
        self.eot_id, self.storage = eot_id, storage
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.writes: list[ray.ObjectRef] = []
        # Each document's digest and length: 16 bytes a document on the driver, to count the
        # exact duplicates at the end (10 million documents: 160 MB).
        self.digests: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, digests: Optional[np.ndarray] = None,
            lengths: Optional[np.ndarray] = None) -> None:
        """The next tokens of the stream, and the documents they hold (none for a split by position)."""
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        if digests is not None:
            self.digests.append(digests)
            self.lengths.append(lengths)
        while self.pending_tokens >= self.shard_rows * self.seq_len + 1:
            self._cut(self.shard_rows)

    def finish(self) -> SplitInfo:
        rows = (self.pending_tokens - 1) // self.seq_len
        if rows > 0:
            self._cut(rows)
        duplicates = duplicate_tokens = 0
        if self.digests:
            digests, lengths = np.concatenate(self.digests), np.concatenate(self.lengths)
            _, first = np.unique(digests, return_index=True)
            duplicates = len(digests) - len(first)
            duplicate_tokens = int(lengths.sum() - lengths[first].sum())
        return SplitInfo.of_shards(ray.get(self.writes), duplicates, duplicate_tokens)

    def _cut(self, rows: int) -> None:
        stream = np.concatenate(self.pending)
        end = rows * self.seq_len
        windows = np.lib.stride_tricks.sliding_window_view(stream[:end + 1], self.seq_len + 1)
        shard = np.ascontiguousarray(windows[::self.seq_len])  # (rows, seq_len + 1)
        # The last token of this shard's last row is also the first of the next shard's first row.
        self.pending = [stream[end:]]
        self.pending_tokens = len(stream) - end
        if len(self.writes) >= _MAX_PENDING_WRITES:
            ray.wait(self.writes, num_returns=len(self.writes) - _MAX_PENDING_WRITES + 1)
        name = f"{self.split}-{len(self.writes):05d}.parquet"
        self.writes.append(_write_shard.remote(self.output, name, shard, self.eot_id, self.storage))


def _data_check(output: str, train: SplitInfo, vocab_size: int, seq_len: int,
                storage: Optional[StorageConfig]) -> DataCheck:
    """The train split's statistics for the guard's data check (`raylm.data.rowstats`), from its
    shards read back: their token counts, then each row's statistics under them."""
    files = [shard.file for shard in train.shards]
    counts = np.sum(ray.get([_shard_counts.remote(output, f, vocab_size, storage) for f in files]), axis=0)
    logp = rowstats.log_probs(counts)
    hist = np.sum(ray.get([_shard_histograms.remote(output, f, logp, storage) for f in files]), axis=0)
    return DataCheck(unigram=[int(c) for c in counts],
                     cross_entropy=RowStatistic(*rowstats.median_and_deviation(hist[0], rowstats.CE_RANGE)),
                     entropy=RowStatistic(*rowstats.median_and_deviation(hist[1], float(np.log(seq_len)))))


def _shard_targets(output: str, name: str, storage: Optional[StorageConfig]) -> np.ndarray:
    """(rows, seq_len) the targets of a shard's rows."""
    column = shard_table(read_bytes(join(output, name), storage)).column(TOKENS_COLUMN)
    tokens = column.combine_chunks()
    return tokens.flatten().to_numpy().reshape(len(tokens), tokens.type.list_size)[:, 1:].astype(np.int64)


@ray.remote
def _shard_counts(output: str, name: str, vocab_size: int, storage: Optional[StorageConfig]) -> np.ndarray:
    return np.bincount(_shard_targets(output, name, storage).reshape(-1), minlength=vocab_size)


@ray.remote
def _shard_histograms(output: str, name: str, logp: np.ndarray, storage: Optional[StorageConfig]) -> np.ndarray:
    return rowstats.histograms(_shard_targets(output, name, storage), logp)


@ray.remote
def _write_shard(output: str, name: str, rows: np.ndarray, eot_id: int,
                 storage: Optional[StorageConfig]) -> ShardInfo:
    data = shard_bytes(rows)
    write_bytes(join(output, name), data, storage)
    return ShardInfo(file=name, rows=len(rows), tokens=len(rows) * (rows.shape[1] - 1),
                     documents=int(np.count_nonzero(rows[:, 1:] == eot_id)),
                     sha256=hashlib.sha256(data).hexdigest())
