"""`prepare_dataset` on real files with real Ray: exact packed streams, one end-of-text token per
document boundary, both split rules, byte-identical re-runs, and a manifest written last."""

import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylm.cli import main
from raylm.data.corpus import BUILTIN_CORPUS, builtin_sources, iter_documents
from raylm.data.inspect import inspect_dataset
from raylm.data.manifest import DatasetError, Manifest, load_manifest
from raylm.data.manifest import ROW_GROUP_ROWS
from raylm.data.prepare import prepare_dataset
from raylm.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from tests.data.test_tokenizer import llama_like_tokenizer_json, random_texts

SEQ_LEN = 32


# One local Ray for the whole test session (tests/fixtures.py).
pytestmark = pytest.mark.usefixtures("ray_session")


def write_mixed_corpus(root) -> list[str]:
    """A directory of .jsonl, .parquet and .txt files (plus files a walk must skip); returns the
    non-empty documents in corpus order: files by sorted path, then records in file order."""
    docs = [f"doc {i}: " + t for i, t in enumerate(random_texts(60, seed=5))]
    os.makedirs(root / "sub")
    records = [{"text": d} for d in docs[:25]] + [{"text": ""}]
    (root / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    pq.write_table(pa.table({"text": docs[25:59] + [""], "id": list(range(35))}), root / "b.parquet")
    (root / "sub" / "c.txt").write_text(docs[59])
    (root / "_SUCCESS").write_text("")
    (root / ".DS_Store").write_bytes(b"\x00\x01")
    return docs


def read_split(dataset: str, manifest: Manifest, split: str) -> np.ndarray:
    """All rows of a split, checking each shard against its manifest entry."""
    rows = []
    for shard, uri in zip(manifest.splits[split].shards, manifest.shard_uris(dataset, split)):
        parquet = pq.ParquetFile(uri)
        assert parquet.schema_arrow.field("tokens").type == pa.list_(pa.int32(), SEQ_LEN + 1)
        assert max(parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)) <= ROW_GROUP_ROWS
        column = parquet.read()["tokens"].combine_chunks()
        shard_rows = column.flatten().to_numpy().reshape(len(column), SEQ_LEN + 1)
        assert (len(shard_rows), shard.tokens) == (shard.rows, shard.rows * SEQ_LEN)
        assert shard.documents == np.count_nonzero(shard_rows[:, 1:] == manifest.tokenizer.eot_id)
        rows.append(shard_rows)
    return np.concatenate(rows) if rows else np.zeros((0, SEQ_LEN + 1), np.int32)


def unpack(rows: np.ndarray) -> np.ndarray:
    """The token stream the rows were cut from (consecutive rows share one token)."""
    assert all((rows[1:, 0] == rows[:-1, -1]))
    return np.concatenate([rows[0], rows[1:, 1:].reshape(-1)])


def expected_stream(tok: Tokenizer, docs: list[str]) -> list[int]:
    return [t for d in docs for t in tok.encode(d) + [tok.eot_id]]


def is_val(text: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") < fraction * 2**64


def check_split(dataset: str, manifest: Manifest, split: str, stream: list[int]) -> np.ndarray:
    """The split's rows are exactly the Megatron windows of `stream`; returns the packed stream."""
    rows = read_split(dataset, manifest, split)
    info = manifest.splits[split]
    assert info.rows == len(rows) == (len(stream) - 1) // SEQ_LEN
    packed = unpack(rows)
    assert packed.tolist() == stream[:len(packed)]
    assert info.tokens == len(rows) * SEQ_LEN
    return packed


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    docs = write_mixed_corpus(root / "corpus")
    manifest = prepare_dataset([str(root / "corpus")], str(root / "out"), seq_len=SEQ_LEN,
                               val_fraction=0.3, shard_rows=20)
    return root, docs, manifest


def test_packed_streams_are_the_documents_with_one_end_of_text_each(mixed):
    root, docs, manifest = mixed
    tok = ByteTokenizer()
    assert manifest.split_rule == "hash" and manifest.row_tokens == SEQ_LEN + 1
    assert manifest.sources == [str(root / "corpus")]
    val_docs = [d for d in docs if is_val(d, 0.3)]
    assert 5 < len(val_docs) < 35
    for split, split_docs in (("train", [d for d in docs if d not in val_docs]), ("val", val_docs)):
        packed = check_split(str(root / "out"), manifest, split, expected_stream(tok, split_docs))
        assert not np.any((packed[1:] == tok.eot_id) & (packed[:-1] == tok.eot_id))
        pieces = tok.decode(packed.tolist()).split("<|endoftext|>")
        assert pieces[:-1] == split_docs[:len(pieces) - 1]  # decoding gives the documents back
    assert len(manifest.splits["train"].shards) > 1
    assert load_manifest(str(root / "out")).to_dict() == manifest.to_dict()
    assert load_tokenizer(str(root / "out")).sha256 == manifest.tokenizer.sha256


def test_rerun_is_byte_identical_and_overwrite_is_explicit(mixed):
    root, _, manifest = mixed
    again = str(root / "again")
    assert prepare_dataset([str(root / "corpus")], again, seq_len=SEQ_LEN, val_fraction=0.3,
                           shard_rows=20).to_dict() == manifest.to_dict()
    for name in sorted(os.listdir(root / "out")):
        assert (root / "out" / name).read_bytes() == (root / again / name).read_bytes(), name

    with pytest.raises(FileExistsError, match="already holds a prepared dataset"):
        prepare_dataset([str(root / "corpus")], again, seq_len=SEQ_LEN)
    replaced = prepare_dataset([str(root / "corpus")], again, seq_len=SEQ_LEN, val_fraction=0.3,
                               shard_rows=1000, overwrite=True)
    files = [s.file for split in replaced.splits.values() for s in split.shards]
    assert sorted(os.listdir(again)) == sorted(files + ["manifest.json", "tokenizer.json"])


def test_exact_duplicate_documents_are_packed_and_counted_once_as_unique(tmp_path, capsys):
    """Copies of a document (in one file or another, as two packages ship one changelog) land in
    its split and are packed like the rest; the manifest counts them, so that "unique tokens"
    (what a sweep's repetition check divides by) leaves them out."""
    docs = [f"doc {i}: " + t for i, t in enumerate(random_texts(40, seed=7))]
    corpus = tmp_path / "corpus"
    os.makedirs(corpus)
    copies = [docs[3], docs[3], docs[10], docs[3] + " "]  # the last is not a copy: one byte differs
    (corpus / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[:20] + copies[:2]) + "\n")
    (corpus / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[20:] + copies[2:]) + "\n")
    in_order = docs[:20] + copies[:2] + docs[20:] + copies[2:]
    manifest = prepare_dataset([str(corpus)], str(tmp_path / "out"), seq_len=SEQ_LEN, val_fraction=0.3,
                               shard_rows=20)
    tok = ByteTokenizer()
    for split in ("train", "val"):
        split_docs = [d for d in in_order if is_val(d, 0.3) == (split == "val")]
        check_split(str(tmp_path / "out"), manifest, split, expected_stream(tok, split_docs))  # copies packed
        repeats = [d for i, d in enumerate(split_docs) if d in split_docs[:i]]
        info = manifest.splits[split]
        assert info.duplicate_documents == len(repeats)
        assert info.duplicate_tokens == sum(len(tok.encode(d)) + 1 for d in repeats)
        assert info.unique_tokens == info.tokens - info.duplicate_tokens
    assert manifest.splits["train"].duplicate_documents + manifest.splits["val"].duplicate_documents == 3
    assert "repeat an earlier one exactly" in capsys.readouterr().out
    assert load_manifest(str(tmp_path / "out")).to_dict() == manifest.to_dict()
    copied = max(manifest.splits.values(), key=lambda split: split.duplicate_documents)
    assert f"{copied.unique_tokens:,} unique tokens" in inspect_dataset(str(tmp_path / "out"))

    # A manifest written before these counts reads 0 duplicates; a count prepare never writes is refused.
    path = tmp_path / "out" / "manifest.json"
    written = json.loads(path.read_text())
    for split in written["splits"].values():
        del split["duplicate_documents"], split["duplicate_tokens"]
    path.write_text(json.dumps(written))
    old = load_manifest(str(tmp_path / "out")).splits["train"]
    assert (old.duplicate_documents, old.unique_tokens) == (0, old.tokens)
    written["splits"]["train"]["duplicate_tokens"] = -1
    path.write_text(json.dumps(written))
    with pytest.raises(DatasetError, match=r"splits.train.duplicate_tokens is -1, expected a non-negative integer"):
        load_manifest(str(tmp_path / "out"))


def test_single_document_is_split_by_position(tmp_path, capsys):
    text = " ".join(random_texts(40, seed=7))
    (tmp_path / "book.txt").write_text(text)
    out = str(tmp_path / "out")
    # As a user prepares nanoGPT's Shakespeare: one .txt file, one document.
    main(["prepare", "--input", str(tmp_path / "book.txt"), "--output", out, "--seq-len", str(SEQ_LEN)])
    manifest = load_manifest(out)
    assert manifest.split_rule == "position"
    stream = expected_stream(ByteTokenizer(), [text])
    cut = len(stream) - int(len(stream) * 0.1)
    check_split(out, manifest, "train", stream[:cut])
    check_split(out, manifest, "val", stream[cut:])
    # Not "train: 0 documents": documents count end-of-text tokens, and one document has one.
    printed = capsys.readouterr().out
    assert "one document: split by position, the last 10% of its tokens held out" in printed
    assert "documents" not in printed.replace("one document:", "")
    assert f"train: {manifest.splits['train'].tokens:,} tokens" in printed


def test_tokenizer_that_appends_eos_still_gives_one_per_document(tmp_path):
    (tmp_path / "tokenizer.json").write_text(llama_like_tokenizer_json())
    lines = [t.replace("\n", " ").replace("\r", " ") for t in random_texts(40, seed=9)]
    (tmp_path / "lines.txt").write_text("\r\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    manifest = prepare_dataset([str(tmp_path / "lines.txt")], out, tokenizer=str(tmp_path / "tokenizer.json"),
                               seq_len=SEQ_LEN, val_fraction=0.0, lines_as_documents=True,
                               max_documents=20)
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert manifest.tokenizer.kind == "hf" and manifest.tokenizer.eot_id == tok.eot_id
    docs = [line for line in lines if line][:20]
    packed = check_split(out, manifest, "train", expected_stream(tok, docs))
    assert tok.eot_id - 1 not in packed  # the file's <s>
    assert not np.any((packed[1:] == tok.eot_id) & (packed[:-1] == tok.eot_id))
    assert manifest.splits["val"].rows == 0


def test_builtin_corpus_is_the_first_stdlib_files(tmp_path):
    out = str(tmp_path / "out")
    manifest = prepare_dataset([], out, seq_len=SEQ_LEN, val_fraction=0.0, max_documents=3)
    assert manifest.sources == [BUILTIN_CORPUS]
    docs = [d for source in builtin_sources(3) for d in iter_documents(source)]
    assert len(docs) == 3
    check_split(out, manifest, "train", expected_stream(ByteTokenizer(), docs))


def test_failed_prepare_leaves_no_dataset(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in random_texts(200)))
    (corpus / "b.jsonl").write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": broken\n')
    out = str(tmp_path / "out")
    with pytest.raises(Exception, match=r"b.jsonl line 3: not valid JSON"):
        prepare_dataset([str(corpus)], out, seq_len=8, shard_rows=10)
    with pytest.raises(DatasetError, match="not a prepared dataset .no manifest.json; an interrupted prepare"):
        load_manifest(out)


def test_bad_inputs_fail_before_any_work(tmp_path):
    (tmp_path / "notes.md").write_text("# hi")
    with pytest.raises(ValueError, match=r"notes.md: unknown extension '.md'; valid: .txt, .jsonl, .parquet"):
        prepare_dataset([str(tmp_path)], str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="missing.txt does not exist"):
        prepare_dataset([str(tmp_path / "missing.txt")], str(tmp_path / "out"))
    with pytest.raises(ValueError, match="val_fraction must be in"):
        prepare_dataset([str(tmp_path)], str(tmp_path / "out"), val_fraction=1.0)
