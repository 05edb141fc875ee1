"""Look at a prepared dataset (`raylm data inspect`) and check it end to end (`raylm data verify`)."""

from __future__ import annotations

import hashlib
import json
from typing import Optional

import numpy as np
import pyarrow as pa

from raylm.config import StorageConfig
from raylm.data.manifest import (MANIFEST_FILE, TOKENS_COLUMN, VERIFIED_FILE, DatasetError, Manifest, ShardInfo,
                                 load_dataset_tokenizer, load_manifest, shard_table)
from raylm.data.storage import StorageError, StorageNotFoundError, file_versions, join, read_bytes, write_bytes
from raylm.progress import Progress

_STATS_MAX_ROWS = 4096
_TOP_TOKENS = 10
_SAMPLE_CHARS = 600


def _read_rows(uri: str, storage: Optional[StorageConfig]) -> np.ndarray:
    table = shard_table(read_bytes(uri, storage), columns=[TOKENS_COLUMN])
    column = table[TOKENS_COLUMN].combine_chunks()
    return column.flatten().to_numpy().reshape(len(column), column.type.list_size)  # (rows, row_tokens)


def inspect_dataset(uri: str, storage: Optional[StorageConfig] = None) -> str:
    """A readable summary: the manifest, per-split counts, token statistics from the first
    train shard (up to 4096 rows), its most frequent tokens, and its first row decoded."""
    manifest = load_manifest(uri, storage)
    tokenizer = load_dataset_tokenizer(uri, storage, manifest)
    t = manifest.tokenizer
    lines = [
        f"dataset      {uri}",
        f"tokenizer    {t.kind} ({tokenizer.name}), vocab {t.vocab_size}, "
        f"end-of-text {tokenizer.eot_token!r} = {t.eot_id}, sha256 {t.sha256[:12]}",
        f"rows         {manifest.row_tokens} tokens (seq_len {manifest.seq_len} + 1), int32",
        f"sources      {', '.join(manifest.sources)}",
        f"split rule   {manifest.split_rule}, val_fraction {manifest.val_fraction}",
    ]
    if (quality := manifest.quality_filter) is not None:
        lines.append(f"quality      the {quality.name} filter ({quality.library}) dropped {quality.documents:,} documents"
                     + (f" ({quality.reasons()}) from {len(quality.files)} file(s)" if quality.documents else ""))
    for name, split in manifest.splits.items():
        if manifest.split_rule == "position":  # one document cut in two: `documents` counts end-of-text tokens
            documents = "part of the one document"
        else:
            per_document = f"{split.tokens / split.documents:,.1f}" if split.documents else "-"
            documents = f"{split.documents:,} documents ({per_document} tokens each)"
        lines.append(f"{name:<12} {split.tokens:,} tokens, {split.rows:,} rows, {documents}, "
                     f"{len(split.shards)} shards"
                     + (f"; {split.duplicate_documents:,} documents repeat an earlier one exactly "
                        f"({split.duplicate_tokens:,} tokens): {split.unique_tokens:,} unique tokens"
                        if split.duplicate_documents else ""))
    train = manifest.splits["train"]
    if not train.shards:
        return "\n".join(lines)

    first = manifest.shard_uri(uri, "train", 0)
    if problems := _shard_problems(first, train.shards[0], manifest, storage):  # its statistics would be garbage
        raise DatasetError("; ".join(problems))
    rows = _read_rows(first, storage)[:_STATS_MAX_ROWS]
    targets = rows[:, 1:]  # each token of the stream once
    counts = np.bincount(targets.reshape(-1), minlength=manifest.vocab_size)
    lines.append(f"statistics   first {len(rows)} rows of {train.shards[0].file}: "
                 f"{int(np.count_nonzero(counts))} distinct tokens, "
                 f"{np.count_nonzero(targets == t.eot_id, axis=1).mean():.2f} end-of-text per row")
    lines.append("most frequent tokens")
    for token in np.argsort(-counts, kind="stable")[:_TOP_TOKENS]:
        if counts[token]:
            lines.append(f"  {int(token):>7} {counts[token] / targets.size:7.2%}  "
                         f"{tokenizer.decode([int(token)])!r}")
    sample = tokenizer.decode(rows[0].tolist())
    lines.append(f"first row, decoded ({len(sample)} characters):")
    lines.append(sample[:_SAMPLE_CHARS] + (" ..." if len(sample) > _SAMPLE_CHARS else ""))
    return "\n".join(lines)


def _shard_problems(uri: str, shard: ShardInfo, manifest: Manifest,
                    storage: Optional[StorageConfig]) -> list[str]:
    try:
        data = read_bytes(uri, storage)
    except StorageError:
        return [f"{uri}: missing"]
    sha256 = hashlib.sha256(data).hexdigest()
    if sha256 != shard.sha256:
        # The content cannot be trusted: further checks would only restate this.
        return [f"{uri}: sha256 {sha256} differs from the manifest's {shard.sha256}"]
    try:
        column = shard_table(data)[TOKENS_COLUMN]
    except (pa.ArrowException, OSError, KeyError) as e:  # pyarrow raises OSError for a corrupt page or footer
        return [f"{uri}: not a readable shard with a {TOKENS_COLUMN!r} column ({e})"]
    expected_type = pa.list_(pa.int32(), manifest.row_tokens)
    if column.type != expected_type:
        return [f"{uri}: column {TOKENS_COLUMN!r} is {column.type}, expected {expected_type}"]
    problems = []
    if len(column) != shard.rows:
        problems.append(f"{uri}: {len(column)} rows, the manifest says {shard.rows}")
    rows = column.combine_chunks().flatten().to_numpy().reshape(len(column), manifest.row_tokens)
    if rows.size and (rows.min() < 0 or rows.max() >= manifest.vocab_size):
        problems.append(f"{uri}: token ids span {rows.min()}..{rows.max()}, outside the "
                        f"vocabulary 0..{manifest.vocab_size - 1}")
    documents = int(np.count_nonzero(rows[:, 1:] == manifest.tokenizer.eot_id))
    if documents != shard.documents:
        problems.append(f"{uri}: {documents} documents end here, the manifest says {shard.documents}")
    if shard.tokens != shard.rows * manifest.seq_len:
        problems.append(f"{uri}: the manifest says {shard.tokens} tokens for {shard.rows} rows "
                        f"of seq_len {manifest.seq_len}")
    return problems


def verify_dataset(uri: str, storage: Optional[StorageConfig] = None,
                   manifest: Optional[Manifest] = None, progress: bool = False) -> list[str]:
    """Every problem found in the dataset at `uri` (empty: it is sound). Reads every shard:
    its presence, sha256, column type, row count, token range and document count are checked
    against the manifest (read here unless given), and so is the tokenizer file. Each message
    names the file. With `progress`, the shards read are counted as they go (`raylm.progress`)."""
    if manifest is None:
        try:
            manifest = load_manifest(uri, storage)
        except DatasetError as e:
            return [str(e)]
    problems = []
    try:
        load_dataset_tokenizer(uri, storage, manifest)
    except (DatasetError, ValueError) as e:
        problems.append(str(e))
    shards = [shard for split in manifest.splits.values() for shard in split.shards]
    with Progress(f"verify {uri}", len(shards), "shards", quiet=not progress) as counter:
        for shard in shards:
            problems += _shard_problems(join(uri, shard.file), shard, manifest, storage)
            counter.update()
    check, train = manifest.data_check, manifest.splits.get("train")
    if not problems and check is not None:  # the shards' rows as the manifest says: their targets
        targets = train.rows * manifest.seq_len if train is not None else 0
        if sum(check.unigram) != targets:
            problems.append(f"{join(uri, MANIFEST_FILE)}: data_check.unigram counts {sum(check.unigram)} tokens, the "
                            f"train split's shards hold {targets} targets")
    return problems


def verify_or_raise(uri: str, storage: Optional[StorageConfig], manifest: Manifest) -> None:
    """Raise DatasetError listing every problem `verify_dataset` finds."""
    problems = verify_dataset(uri, storage, manifest)
    if problems:
        raise DatasetError(f"{uri} failed verification ({len(problems)} problems):\n  "
                           + "\n  ".join(problems))


def _record(uri: str, storage: Optional[StorageConfig], manifest: Manifest) -> dict:
    """What a verification vouches for: the manifest, and the size and modification time of each
    file it read (the shards, the tokenizer), from one listing."""
    listed = file_versions(uri, storage)
    names = [shard.file for split in manifest.splits.values() for shard in split.shards] + [manifest.tokenizer.file]
    return {"manifest_sha256": hashlib.sha256(manifest.to_json().encode()).hexdigest(),
            "files": {name: listed.get(name) for name in names}}


def verify_once(uri: str, storage: Optional[StorageConfig], manifest: Manifest) -> bool:
    """`verify_or_raise`, unless a verification of this dataset, unchanged since (the same
    manifest; each file of the size and modification time it had), is recorded beside it
    (VERIFIED_FILE): then nothing is read but a listing. After a verification, the record is
    written when the dataset's location takes it. True when the dataset was read."""
    record = _record(uri, storage, manifest)
    try:
        if json.loads(read_bytes(join(uri, VERIFIED_FILE), storage)) == record:
            return False
    except (StorageNotFoundError, ValueError):  # none yet, or not one of ours: verify
        pass
    verify_or_raise(uri, storage, manifest)
    try:
        write_bytes(join(uri, VERIFIED_FILE), json.dumps(record, indent=1).encode(), storage)
    except StorageError as e:  # a read-only dataset: verified again next time
        print(f"raylm: {uri} is sound, but the verification could not be recorded beside it ({e}): "
              "the next run verifies it again", flush=True)
    return True
