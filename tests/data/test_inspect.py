"""`inspect_dataset`, `verify_dataset` and `load_manifest` on a real prepared dataset, then on
copies of it damaged in the ways storage and people damage files."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

from raylm.data.corpus import builtin_sources, iter_documents
from raylm.data.inspect import inspect_dataset, verify_dataset, verify_or_raise
from raylm.data.manifest import TOKENS_COLUMN, DatasetError, load_manifest, shard_bytes, shard_table
from raylm.data.prepare import prepare_dataset


@pytest.fixture(scope="module")
def dataset(ray_session, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("inspect") / "prepared")
    prepare_dataset([], out, seq_len=64, val_fraction=0.2, max_documents=6, shard_rows=40)
    return out


@pytest.fixture
def damaged(dataset, tmp_path) -> str:
    """A copy of the dataset for one test to break."""
    return str(shutil.copytree(dataset, tmp_path / "copy"))


def test_a_shard_parsed_from_memory_lets_go_of_its_bytes_before_it_returns():
    """A reference to the bytes dropped later, on one of Arrow's pool threads, aborts a process
    that is exiting then: `raylm data verify` printed OK and died with SIGABRT (pq.read_table
    still held them after 4 calls in 10)."""
    rows = np.arange(300 * 17, dtype=np.int32).reshape(300, 17)
    data = shard_bytes(rows)
    references = sys.getrefcount(data)
    for _ in range(200):
        table = shard_table(data, columns=[TOKENS_COLUMN])
        assert sys.getrefcount(data) == references
    assert np.array_equal(table[TOKENS_COLUMN].combine_chunks().flatten().to_numpy().reshape(rows.shape), rows)


def test_inspect_summarises_counts_tokens_and_a_sample(dataset):
    manifest = load_manifest(dataset)
    report = inspect_dataset(dataset)
    train = manifest.splits["train"]
    assert f"train        {train.tokens:,} tokens, {train.rows:,} rows" in report
    assert "byte (byte), vocab 257, end-of-text '<|endoftext|>' = 256" in report
    assert "most frequent tokens" in report
    assert "      32 " in report  # the space, most frequent in Python source
    first_document = next(iter_documents(builtin_sources(1)[0]))
    assert first_document[:40] in report  # the first row, decoded


def test_sound_dataset_verifies(dataset):
    assert verify_dataset(dataset) == []
    verify_or_raise(dataset, None, load_manifest(dataset))


def test_flipped_bytes_are_caught_and_the_shard_named(damaged):
    shard = f"{damaged}/train-00001.parquet"
    with open(shard, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems = verify_dataset(damaged)
    assert len(problems) == 1 and problems[0].startswith(f"{shard}: sha256 ")
    with pytest.raises(DatasetError, match="train-00001.parquet: sha256"):
        verify_or_raise(damaged, None, load_manifest(damaged))


def test_missing_shard_and_changed_tokenizer_are_named(damaged):
    shard = load_manifest(damaged).shard_uri(damaged, "val", 0)
    os.remove(shard)
    with open(f"{damaged}/tokenizer.json", "a") as f:
        f.write(" ")
    problems = verify_dataset(damaged)
    assert f"{shard}: missing" in problems
    assert any(p.startswith(f"{damaged}/tokenizer.json: sha256") for p in problems)


def test_counts_that_disagree_with_the_shard_are_named(damaged):
    path = f"{damaged}/manifest.json"
    manifest = json.load(open(path))
    shard, split = manifest["splits"]["train"]["shards"][0], manifest["splits"]["train"]
    shard["rows"] += 1
    shard["documents"] += 1
    split["rows"] += 1
    split["documents"] += 1
    json.dump(manifest, open(path, "w"))
    uri = f"{damaged}/{shard['file']}"
    problems = verify_dataset(damaged)
    assert f"{uri}: {shard['rows'] - 1} rows, the manifest says {shard['rows']}" in problems
    assert any(p.startswith(f"{uri}: ") and "documents end here" in p for p in problems)
    assert any(p.startswith(f"{uri}: the manifest says") and "tokens for" in p for p in problems)


def test_incomplete_datasets_are_refused(damaged):
    path = f"{damaged}/manifest.json"
    manifest = json.load(open(path))
    del manifest["seq_len"]
    json.dump(manifest, open(path, "w"))
    with pytest.raises(DatasetError, match=f"{path}: missing key 'seq_len'"):
        load_manifest(damaged)
    os.remove(path)
    message = f"{damaged} is not a prepared dataset (no manifest.json; an interrupted prepare?)"
    with pytest.raises(DatasetError) as caught:
        load_manifest(damaged)
    assert str(caught.value) == message
    assert verify_dataset(damaged) == [message]


@pytest.mark.parametrize("name", ["../outside.parquet", "/etc/passwd", "s3://other-bucket/x.parquet",
                                  "a/../../b.parquet", "", "./train.parquet"])
def test_a_manifest_naming_a_file_outside_the_dataset_is_refused(damaged, name):
    path = f"{damaged}/manifest.json"
    manifest = json.loads(open(path).read())
    manifest["splits"]["train"]["shards"][0]["file"] = name
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(DatasetError, match="points outside the dataset"):
        load_manifest(damaged)
    assert any("points outside the dataset" in p for p in verify_dataset(damaged))


def _shard_reads(monkeypatch) -> list[str]:
    """The shards `verify_dataset` reads, as they are read."""
    from raylm.data import inspect

    reads, shard_problems = [], inspect._shard_problems
    monkeypatch.setattr(inspect, "_shard_problems", lambda uri, *a: reads.append(uri) or shard_problems(uri, *a))
    return reads


def test_a_dataset_verified_once_is_not_read_again_until_a_file_changes(damaged, monkeypatch, capsys):
    from raylm.data.inspect import VERIFIED_FILE, verify_once

    manifest, reads = load_manifest(damaged), _shard_reads(monkeypatch)
    shards = [shard.file for split in manifest.splits.values() for shard in split.shards]
    assert verify_once(damaged, None, manifest) and len(reads) == len(shards)  # read, and recorded
    assert os.path.exists(os.path.join(damaged, VERIFIED_FILE))
    reads.clear()
    assert not verify_once(damaged, None, manifest) and reads == []  # unchanged: a listing, nothing read
    # A shard written again (a new modification time) is read again, and its damage found.
    path = os.path.join(damaged, shards[0])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(DatasetError, match=shards[0]):
        verify_once(damaged, None, manifest)


def test_a_dataset_whose_location_takes_no_record_is_verified_each_time(dataset, tmp_path, monkeypatch, capsys):
    import subprocess

    from raylm.data.inspect import verify_once
    from tests.support.filesystems import tmpfs

    mounts = tmpfs(tmp_path, "16m")
    read_only = str(shutil.copytree(dataset, next(mounts) / "prepared"))
    subprocess.run(["mount", "-o", "remount,ro", os.path.dirname(read_only)], check=True)
    manifest, reads = load_manifest(read_only), _shard_reads(monkeypatch)
    try:
        assert verify_once(read_only, None, manifest) and verify_once(read_only, None, manifest)
    finally:
        next(mounts, None)  # unmount
    shards = sum(len(split.shards) for split in manifest.splits.values())
    assert "could not be recorded" in capsys.readouterr().out and len(reads) == 2 * shards
