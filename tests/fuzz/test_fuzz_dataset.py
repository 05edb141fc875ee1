"""Fuzzed prepared datasets through `raylm data verify` and `raylm data inspect`.

Copies of one real prepared dataset get a mutated manifest.json (a key removed, a value of the
wrong type, another number, a file name outside the dataset, junk in place of the file) or a
mutated file (a Parquet shard or the tokenizer: truncated, bit-flipped, random bytes, a table
of the wrong schema), with the manifest's checksum left stale or forged to match, as someone who
can write to the bucket could. `verify` must refuse each with `raylm: error: ...` and the file
named, exit 1 or 2, except a forged file that still reads as what the manifest describes.
`inspect`, which trusts checksums it does not read, may show such a dataset but never crash.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from raylm.data.manifest import MANIFEST_FILE, TOKENS_COLUMN, shard_table
from raylm.data.tokenizer import TOKENIZER_FILE, tokenizer_from_json
from tests.fuzz.conftest import examples, time_limit
from tests.fuzz.strategies import BYTE_MUTATIONS, byte_mutation
from tests.support.cli import Outcome, assert_clean_refusal, run_main

pytestmark = pytest.mark.timeout(time_limit(180))

FILE_NAMES = (MANIFEST_FILE, TOKENIZER_FILE, ".parquet")  # a refusal names one of these


@pytest.fixture(scope="module")
def original(tiny_dataset) -> dict:
    manifest = json.loads((Path(tiny_dataset) / MANIFEST_FILE).read_text())
    return {"path": Path(tiny_dataset), "manifest": manifest, "leaves": leaves(manifest)}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-dataset")


def fresh_copy(original: dict, scratch: Path) -> Path:
    copy = scratch / "dataset"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(original["path"], copy)
    return copy


def leaves(tree, path: tuple = ()) -> list[tuple]:
    """Every leaf's path in a JSON tree, and the leaf."""
    if isinstance(tree, dict):
        return [leaf for key, value in tree.items() for leaf in leaves(value, (*path, key))]
    if isinstance(tree, list) and tree and path[-1] != "sources":
        return [leaf for i, value in enumerate(tree) for leaf in leaves(value, (*path, i))]
    return [(path, tree)]


def set_at(tree, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def run_both(dataset: Path) -> tuple[Outcome, Outcome]:
    return run_main("data", "verify", str(dataset)), run_main("data", "inspect", str(dataset))


def assert_inspect_clean(outcome: Outcome, names: tuple[str, ...] = FILE_NAMES) -> None:
    if outcome.status != 0:
        assert_clean_refusal(outcome, *names)


# ----------------------------------------------------------------------------- manifest.json

JSON_JUNK = st.recursive(st.none() | st.booleans() | st.integers(-(10 ** 30), 10 ** 30) | st.floats()
                         | st.text(max_size=10), lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
OUTSIDE_NAMES = ["../outside.parquet", "/etc/passwd", "s3://another-bucket/train-00000.parquet", "", ".",
                 "./train-00000.parquet", "a//b.parquet", "shards\\train.parquet", "train-00000.parquet\0x",
                 "file:///etc/passwd", "../dataset/train-00000.parquet"]


def wrong_type(value) -> st.SearchStrategy:
    """JSON values of another type than `value`'s (an integral float is not an int)."""
    if isinstance(value, bool) or value is None:
        return JSON_JUNK.filter(lambda v: type(v) is not type(value))
    if isinstance(value, int):
        return JSON_JUNK.filter(lambda v: type(v) is not int) | st.floats().filter(lambda v: v != value)
    if isinstance(value, float):
        return JSON_JUNK.filter(lambda v: isinstance(v, (bool, str, list, dict)) or v is None)
    return JSON_JUNK.filter(lambda v: not isinstance(v, type(value)))


@st.composite
def manifest_mutations(draw, original: dict) -> tuple[str, object, str]:
    """(description, new manifest.json bytes or None for removed, the file name it now lists or "")."""
    manifest = json.loads(json.dumps(original["manifest"]))
    path, value = draw(st.sampled_from(original["leaves"]))
    how = draw(st.sampled_from(["delete", "retype", "renumber", "rename", "whole file"]))
    if how == "delete":
        cut = path[:draw(st.integers(1, len(path)))]
        parent = manifest
        for key in cut[:-1]:
            parent = parent[key]
        del parent[cut[-1]]
        path = cut
    elif how == "retype":
        set_at(manifest, path, draw(wrong_type(value)))
    elif how == "renumber" and type(value) is int:
        set_at(manifest, path, draw(st.one_of(st.integers(-(10 ** 30), 10 ** 30), st.sampled_from(
            [-1, 0, 2 ** 31, 2 ** 63, 10 ** 100])).filter(lambda v: v != value)))
    elif how == "rename" or (how == "renumber" and isinstance(value, str)):
        other = [p for p, v in original["leaves"] if p[-1] in ("file", "sha256", "format", "token_dtype",
                                                                  "split_rule", "kind")]
        path = draw(st.sampled_from(other))
        choices = OUTSIDE_NAMES if path[-1] == "file" else ["", "x", "0" * 64, "raylm.prepared/2", "int64"]
        set_at(manifest, path, new_name := draw(st.sampled_from(choices) | st.text(max_size=12)))
        if path[-1] == "file":
            return f"rename {'.'.join(map(str, path))}", json.dumps(manifest).encode(), new_name
    else:
        whole = draw(st.sampled_from(["junk json", "truncated", "not utf-8", "deep", "removed"]))
        text = json.dumps(original["manifest"]).encode()
        return whole, {"junk json": lambda: json.dumps(draw(JSON_JUNK)).encode(),
                       "truncated": lambda: text[:draw(st.integers(0, len(text) - 1))],
                       "not utf-8": lambda: b"\xff\xfe" + text,
                       "deep": lambda: b"[" * 100_000 + b"]" * 100_000,
                       "removed": lambda: None}[whole](), ""
    return f"{how} {'.'.join(map(str, path))}", json.dumps(manifest).encode(), ""


@given(data=st.data())
@examples(150)
def test_fuzzed_manifest_is_refused_naming_the_file(data, original, scratch):
    what, content, listed = data.draw(manifest_mutations(original), label="mutation")
    dataset = fresh_copy(original, scratch)
    if content is None:
        (dataset / MANIFEST_FILE).unlink()
    else:
        (dataset / MANIFEST_FILE).write_bytes(content)
    verify, inspect = run_both(dataset)
    event(f"verify exit {verify.status}, inspect exit {inspect.status}")
    # A file the manifest now lists is named by the path it has there.
    names = (*FILE_NAMES, f"{dataset}/{listed}") if listed else FILE_NAMES
    assert_inspect_clean(inspect, names)
    try:
        if json.loads(content) == original["manifest"]:
            return  # a value replaced by the same one: nothing to refuse
    except (TypeError, ValueError, RecursionError):
        pass
    if what.startswith("delete") and what.endswith((".duplicate_documents", ".duplicate_tokens")) or \
            what == "delete data_check":
        assert verify.status == 0, verify  # a manifest written before these counts or statistics: still a dataset
        return
    assert_clean_refusal(verify, *names)


# ----------------------------------------------------------------------------- shards and tokenizer

def wrong_schema_table(draw, rows: int, row_tokens: int) -> pa.Table:
    ids = np.arange(rows * row_tokens) % 200
    kind = draw(st.sampled_from(["renamed", "int64", "list size", "variable list", "extra column", "strings",
                                 "no rows"]))
    if kind == "renamed":
        return pa.table({"ids": pa.FixedSizeListArray.from_arrays(pa.array(ids, pa.int32()), row_tokens)})
    if kind == "int64":
        return pa.table({TOKENS_COLUMN: pa.FixedSizeListArray.from_arrays(pa.array(ids, pa.int64()), row_tokens)})
    if kind == "list size":
        size = draw(st.sampled_from([1, row_tokens - 1, row_tokens + 1]))
        values = pa.array(np.arange(rows * size) % 200, pa.int32())
        return pa.table({TOKENS_COLUMN: pa.FixedSizeListArray.from_arrays(values, size)})
    if kind == "variable list":
        return pa.table({TOKENS_COLUMN: pa.array([list(range(row_tokens))] * rows, pa.list_(pa.int32()))})
    if kind == "extra column":
        return pa.table({TOKENS_COLUMN: pa.FixedSizeListArray.from_arrays(pa.array(ids, pa.int32()), row_tokens),
                         "x": pa.array(range(rows))})
    if kind == "strings":
        return pa.table({TOKENS_COLUMN: pa.array(["a"] * rows)})
    return pa.table({TOKENS_COLUMN: pa.FixedSizeListArray.from_arrays(pa.array([], pa.int32()), row_tokens)})


@st.composite
def file_mutations(draw, original: dict) -> tuple[str, str, bytes, bool]:
    """(file name, description, new bytes, whether the manifest's sha256 is forged to match)."""
    manifest = original["manifest"]
    shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    name = draw(st.sampled_from([s["file"] for s in shards] + [TOKENIZER_FILE]))
    data = (original["path"] / name).read_bytes()
    how = draw(st.sampled_from([*BYTE_MUTATIONS, "wrong schema"]))
    if how in BYTE_MUTATIONS:
        new = byte_mutation(draw, data, how, max_random=2000)
    else:
        shard = next((s for s in shards if s["file"] == name), shards[0])
        name = shard["file"]
        sink = pa.BufferOutputStream()
        pq.write_table(wrong_schema_table(draw, shard["rows"], manifest["row_tokens"]), sink)
        new = sink.getvalue().to_pybytes()
    return name, how, new, draw(st.booleans())


def still_sound(name: str, content: bytes, manifest: dict) -> bool:
    """Whether forged bytes still hold what the manifest says of the file: a tokenizer of the
    same vocabulary and end-of-text id, or a shard of the right type, rows, ids and documents."""
    try:
        if name == TOKENIZER_FILE:
            tokenizer = tokenizer_from_json(content.decode("utf-8"))
            return (tokenizer.vocab_size, tokenizer.eot_id) == (manifest["vocab_size"], manifest["tokenizer"]["eot_id"])
        column = shard_table(content)[TOKENS_COLUMN]
    except Exception:  # noqa: BLE001 - anything unreadable is unsound
        return False
    shard = next(s for split in manifest["splits"].values() for s in split["shards"] if s["file"] == name)
    if column.type != pa.list_(pa.int32(), manifest["row_tokens"]) or len(column) != shard["rows"]:
        return False
    rows = column.combine_chunks().flatten().to_numpy().reshape(len(column), manifest["row_tokens"])
    return (rows.size == 0 or 0 <= rows.min() and rows.max() < manifest["vocab_size"]) and int(
        np.count_nonzero(rows[:, 1:] == manifest["tokenizer"]["eot_id"])) == shard["documents"]


@given(data=st.data())
@examples(120)
def test_fuzzed_shard_or_tokenizer_is_refused_naming_the_file(data, original, scratch):
    name, how, content, forged = data.draw(file_mutations(original), label="mutation")
    dataset = fresh_copy(original, scratch)
    (dataset / name).write_bytes(content)
    if forged:
        manifest = json.loads(json.dumps(original["manifest"]))
        entries = [manifest["tokenizer"]] + [s for split in manifest["splits"].values() for s in split["shards"]]
        next(e for e in entries if e["file"] == name)["sha256"] = hashlib.sha256(content).hexdigest()
        (dataset / MANIFEST_FILE).write_text(json.dumps(manifest))
    verify, inspect = run_both(dataset)
    event(f"{'forged' if forged else 'stale checksum'}: verify exit {verify.status}, inspect exit {inspect.status}")
    assert_inspect_clean(inspect)
    if content == (original["path"] / name).read_bytes() or forged and still_sound(name, content, original["manifest"]):
        # Unchanged (bit flips that cancel out), or forged into what the manifest describes.
        assert verify.status == 0, verify.stdout + verify.stderr
        return
    assert_clean_refusal(verify, name)


def test_a_truncated_shard_with_a_forged_checksum_is_refused_in_a_real_process(original, scratch):
    dataset = fresh_copy(original, scratch)
    manifest = json.loads(json.dumps(original["manifest"]))
    shard = manifest["splits"]["train"]["shards"][0]
    content = (dataset / shard["file"]).read_bytes()[:-100]
    (dataset / shard["file"]).write_bytes(content)
    shard["sha256"] = hashlib.sha256(content).hexdigest()
    (dataset / MANIFEST_FILE).write_text(json.dumps(manifest))
    done = subprocess.run([sys.executable, "-m", "raylm.cli", "data", "verify", str(dataset)],
                          capture_output=True, text=True, timeout=120)
    assert_clean_refusal(done, shard["file"])
