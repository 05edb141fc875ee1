"""Overwrites that cannot lose data: a prepared dataset is replaced only once the new one is whole
(local disk and S3), and a failed overwrite, wherever it fails, leaves the old one as it was."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from raylm.data import storage
from raylm.data.corpus import InputError
from raylm.data.inspect import verify_dataset
from raylm.data.manifest import load_manifest
from raylm.data.prepare import prepare_dataset
from tests.support.cli import assert_clean_refusal, run_main
from tests.support.fixtures import write_corpus
from tests.support.processes import signal_when

pytestmark = pytest.mark.usefixtures("ray_session")


def dataset_files(uri: str, storage_cfg=None) -> dict[str, int]:
    return {name: storage.file_size(storage.join(uri, name), storage_cfg) for name in storage.list_files(uri, storage_cfg)}


def deep_bad_utf8(path) -> str:
    """A text file whose first 64 KiB are clean (the early check passes) and whose end is not UTF-8."""
    path.write_bytes(b"A clean line of text.\n" * 4000 + b"then caf\xe9\n")
    return str(path)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_failed_overwrite_leaves_the_old_dataset_and_a_whole_one_replaces_it(tmp_path, request, where):
    storage_cfg = None
    output = str(tmp_path / "data")
    if where == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        storage_cfg, output = server.storage, f"{bucket}/data"
    first = write_corpus(tmp_path / "first", documents=40, seed=1)
    prepare_dataset([first], output, seq_len=32, storage=storage_cfg)
    before = dataset_files(output, storage_cfg)

    # A typo in the input: refused before anything is touched.
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_dataset([str(tmp_path / "frist")], output, seq_len=32, storage=storage_cfg, overwrite=True)
    # A bad byte deep in an input: found while the new dataset is being written.
    with pytest.raises(InputError, match=r"bad\.txt: not UTF-8 text"):
        prepare_dataset([first, deep_bad_utf8(tmp_path / "bad.txt")], output, seq_len=32, storage=storage_cfg,
                        overwrite=True)
    assert dataset_files(output, storage_cfg) == before
    assert verify_dataset(output, storage_cfg) == []
    parent = output.rsplit("/", 1)[0]
    assert [n for n in storage.list_dir(parent, storage_cfg) if ".staging-" in n] == []  # nothing left beside

    # The same bad byte in a fresh prepare: nothing is left where it was to be written.
    fresh = f"{parent}/fresh"
    with pytest.raises(InputError, match=r"bad\.txt: not UTF-8 text"):
        prepare_dataset([first, str(tmp_path / "bad.txt")], fresh, seq_len=32, storage=storage_cfg)
    assert storage.list_files(fresh, storage_cfg) == [] and not storage.exists(fresh, storage_cfg)

    second = write_corpus(tmp_path / "second", documents=80, seed=2)
    prepare_dataset([second], output, seq_len=32, storage=storage_cfg, overwrite=True)
    manifest = load_manifest(output, storage_cfg)
    assert manifest.sources == [second] and verify_dataset(output, storage_cfg) == []
    # Exactly the new dataset: no shard of the old one is left beside it.
    listed = {s.file for split in manifest.splits.values() for s in split.shards}
    assert set(storage.list_files(output, storage_cfg)) == listed | {"manifest.json", "tokenizer.json"}
    assert [n for n in storage.list_dir(parent, storage_cfg) if ".staging-" in n] == []


def test_the_cli_refuses_an_overwrite_with_a_missing_input_and_keeps_the_dataset(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", documents=30)
    output = str(tmp_path / "data")
    assert run_main("prepare", "--input", corpus, "--output", output, "--seq-len", "32").status == 0
    before = dataset_files(output)
    outcome = run_main("prepare", "--input", str(tmp_path / "corpsu"), "--output", output, "--overwrite")
    assert_clean_refusal(outcome, "corpsu")
    assert dataset_files(output) == before
    assert [n for n in os.listdir(tmp_path) if ".staging-" in n] == []


def test_a_directory_holding_other_files_is_never_written_over_and_an_interrupted_prepare_is_replaced(tmp_path):
    """A dataset and a Hugging Face model both hold a tokenizer.json: `prepare --output` on an
    export's directory once replaced its tokenizer (exit 0). Another tool's output, or a dataset
    beside files of the user's, is refused with or without --overwrite, naming a file, and left
    as it was; the shards an interrupted prepare left (no manifest) are replaced with --overwrite."""
    corpus = write_corpus(tmp_path / "corpus", documents=30)
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text('{"from": "raylm export"}')
    for extra in ([], ["--overwrite"]):
        outcome = run_main("prepare", "--input", corpus, "--output", str(model), "--seq-len", "32", *extra)
        assert_clean_refusal(outcome, "config.json")
        assert "Ray instance" not in outcome.stdout + outcome.stderr
    assert sorted(os.listdir(model)) == ["config.json", "tokenizer.json"]
    assert (model / "tokenizer.json").read_text() == '{"from": "raylm export"}'

    output = str(tmp_path / "data")
    assert run_main("prepare", "--input", corpus, "--output", output, "--seq-len", "32").status == 0
    (tmp_path / "data" / "NOTES.md").write_text("mine\n")
    before = dataset_files(output)
    assert_clean_refusal(run_main("prepare", "--input", corpus, "--output", output, "--overwrite"), "NOTES.md")
    assert dataset_files(output) == before

    # What a prepare killed mid-write leaves: shards, no manifest.
    left = tmp_path / "left"
    left.mkdir()
    (left / "train-00000.parquet").write_bytes(b"cut short")
    (left / "train-00001.parquet").write_bytes(b"cut short")
    outcome = run_main("prepare", "--input", corpus, "--output", str(left), "--seq-len", "32")
    assert_clean_refusal(outcome, "--overwrite")
    assert run_main("prepare", "--input", corpus, "--output", str(left), "--seq-len", "32", "--overwrite").status == 0
    manifest = load_manifest(str(left))
    listed = {s.file for split in manifest.splits.values() for s in split.shards}
    assert set(os.listdir(left)) == listed | {"manifest.json", "tokenizer.json"}
    assert verify_dataset(str(left)) == []


@pytest.mark.slow
def test_a_sigterm_to_an_overwriting_prepare_leaves_the_old_dataset_whole(tmp_path):
    """`timeout`, Slurm or Kubernetes end a prepare with SIGTERM to its process group: it stops as
    for Ctrl-C, exit 143 with one line, the dataset it was replacing byte for byte as it was, its
    staging directory gone and no Ray process left. It exited 15 (Ray's handler) or -15 without a
    word, after a stack dump of Ray's."""
    output = str(tmp_path / "data")
    assert run_main("prepare", "--input", write_corpus(tmp_path / "small", documents=30), "--output", output,
                    "--seq-len", "32").status == 0
    before = {name: (tmp_path / "data" / name).read_bytes() for name in os.listdir(output)}
    big = tmp_path / "big.txt"
    words = ("the king", "a castle", "of the realm", "and then", "in the night")
    big.write_text("\n".join(" ".join(words[(i * j) % 5] for j in range(12)) for i in range(400_000)))
    command = [sys.executable, "-m", "raylm.cli", "prepare", "--input", str(big), "--output", output,
               "--seq-len", "32", "--overwrite"]
    status, out, err, left = signal_when(
        command, lambda pid: any(".staging-" in name for name in os.listdir(tmp_path)), signal.SIGTERM)
    assert status == 143 and err.splitlines()[-1] == "raylm: stopped by SIGTERM", out[-2000:] + err[-2000:]
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-3000:]
    assert {name: (tmp_path / "data" / name).read_bytes() for name in os.listdir(output)} == before
    assert [n for n in os.listdir(tmp_path) if ".staging-" in n] == []
    assert not left, left
