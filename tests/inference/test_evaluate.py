"""`raylm eval`: bits-per-byte accounting, the whole split on 1 and 2 Ray workers, resuming from
the parts already written, a damaged newest checkpoint passed over, and a dataset of another
tokenizer refused."""

import json
import math
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from raylm.cli import main
from raylm.data.manifest import load_manifest
from raylm.data.prepare import prepare_dataset
from raylm.inference.evaluate import evaluate
from raylm.data.tokenizer import bits_per_byte, token_byte_lengths
from raylm.inference.load import load_for_inference
from raylm.data.tokenizer import ByteTokenizer, train_bpe
from raylm.train.loop import train_local
from tests.support.checkpoints import run_cli
from tests.support.cli import assert_clean_refusal, run_main
from tests.downstream.test_lm_eval import TASK, write_task
from tests.inference.test_generate import damage_newest
from tests.support.filesystems import tmpfs
from tests.support.fixtures import write_corpus
from tests.train.test_loop import tiny_config

TEXT = "Naïve café, ünïcode: ✓ 🙂 — and plain ASCII.\n"


def test_token_bytes_count_every_utf8_byte_once(tmp_path):
    byte = ByteTokenizer()
    lengths = token_byte_lengths(byte)
    assert lengths[byte.eot_id] == 0 and lengths[:256].tolist() == [1] * 256

    corpus = write_corpus(tmp_path / "text", documents=30)
    bpe = train_bpe([corpus], 300, str(tmp_path / "tok.json"))
    lengths = token_byte_lengths(bpe)
    ids = bpe.encode(TEXT * 3)
    assert len(ids) < len((TEXT * 3).encode())  # merges happened: tokens of several bytes
    # Byte-level tokens that cut a character in two still count exactly the bytes they hold.
    assert sum(lengths[i] for i in ids) == len((TEXT * 3).encode())
    assert lengths[bpe.eot_id] == 0


@pytest.fixture(scope="module")
def trained_run(tiny_dataset, tmp_path_factory) -> str:
    run = str(tmp_path_factory.mktemp("eval") / "run")
    train_local(tiny_config(tiny_dataset, "train.steps=4", "checkpoint.every_steps=2", "train.eval_every=0"), run)
    return run


def _reference(run: str, dataset: str) -> tuple[float, float]:
    """Loss and bits-per-byte of the whole val split, computed plainly in one process."""
    model, tokenizer, _ = load_for_inference(run)
    manifest = load_manifest(dataset)
    rows = np.concatenate([pq.read_table(os.path.join(dataset, s.file)).column("tokens").combine_chunks()
                           .flatten().to_numpy().reshape(-1, manifest.row_tokens)
                           for s in manifest.splits["val"].shards])
    tokens = torch.from_numpy(rows.astype(np.int64))
    with torch.no_grad():
        nats = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    text = tokens[:, 1:].flatten() != tokenizer.eot_id  # byte tokens: one byte each, end-of-text none
    return float(nats.double().mean()), bits_per_byte(float(nats[text].double().sum()), int(text.sum()))


@pytest.mark.slow
def test_whole_split_gives_the_same_result_on_1_and_2_workers_and_resumes(
        ray_session, trained_run, tiny_dataset, tmp_path, capsys):
    one = evaluate(trained_run, tiny_dataset, output=str(tmp_path / "one.json"), workers=1, rows_per_part=16)
    main(["eval", trained_run, "--data", tiny_dataset, "--output", str(tmp_path / "two.json"), "--workers", "2",
          "--rows-per-part", "16"])
    with open(tmp_path / "two.json") as f:
        two = json.load(f)
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{"):]) == two  # the CLI prints the result it wrote
    val = load_manifest(tiny_dataset).splits["val"]
    assert one["parts"] == two["parts"] == sum(math.ceil(s.rows / 16) for s in val.shards) > 2
    assert (one["workers"], two["workers"]) == (1, 2)
    for key in ("tokens", "bytes", "loss", "perplexity", "bits_per_byte"):
        assert one[key] == two[key], key  # not approximately: the same sums in the same order
    assert one["tokens"] == val.tokens and one["bytes"] == val.tokens - val.documents
    loss, bpb = _reference(trained_run, tiny_dataset)
    assert one["loss"] == pytest.approx(loss, rel=1e-5) and one["bits_per_byte"] == pytest.approx(bpb, rel=1e-5)
    assert one["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)

    # An interrupted evaluation: parts on disk are reused, only the missing one is evaluated.
    parts = sorted(os.listdir(tmp_path / "two.parts"))
    assert len(parts) == two["parts"]
    os.remove(tmp_path / "two.parts" / parts[1])
    again = evaluate(trained_run, tiny_dataset, output=str(tmp_path / "two.json"), workers=2, rows_per_part=16)
    assert again["parts_reused"] == two["parts"] - 1 and again["workers"] == 1
    assert {k: again[k] for k in ("loss", "bits_per_byte")} == {k: two[k] for k in ("loss", "bits_per_byte")}


@pytest.mark.slow
def test_a_newest_checkpoint_failing_its_checksum_is_passed_over_named(ray_session, trained_run, tiny_dataset,
                                                                      tmp_path):
    """A file of the newest checkpoint with its size intact but a byte flipped: the run is evaluated
    from the checkpoint before, both named, as generate and export do; the damaged checkpoint
    named directly fails with its checksum error (it used to fail on the workers, run or not)."""
    damaged, newest, shard = damage_newest(trained_run, tmp_path, "content")
    output = str(tmp_path / "r.json")
    outcome = run_main("eval", damaged, "--data", tiny_dataset, "--output", output, "--workers", "1")
    assert outcome.status == 0, outcome.stderr[-3000:]
    assert f"raylm: passing over {newest}: {shard} has sha256" in outcome.stderr
    older = os.path.join(damaged, "checkpoint_00000002")
    assert f"raylm: using checkpoint {older}" in outcome.stderr
    with open(output) as f:
        assert json.load(f)["checkpoint"] == older

    named = run_main("eval", newest, "--data", tiny_dataset, "--output", str(tmp_path / "n.json"), "--workers", "1")
    assert_clean_refusal(named, shard)
    assert named.status == 1
    assert named.stderr.startswith(f"raylm: error: checkpoint {newest} cannot be used: {shard} has sha256")


@pytest.mark.slow
def test_dataset_of_another_tokenizer_is_refused(ray_session, trained_run, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "text", documents=20)
    train_bpe([corpus], 300, str(tmp_path / "tok.json"))
    other = str(tmp_path / "bpe-data")
    prepare_dataset([corpus], other, tokenizer=str(tmp_path / "tok.json"), seq_len=32, val_fraction=0.2)
    # What the prepare said (Ray Data's INFO lines when this test runs first in its process) is not eval's.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", trained_run, "--data", other, "--output", str(tmp_path / "r.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    named, error = err.strip().splitlines()  # the checkpoint it resolved the run to, then the error
    assert named.startswith(f"raylm: using checkpoint {trained_run}/checkpoint_")
    assert error.startswith("raylm: error:") and "tokenizer" in error and "prepare the data with the checkpoint's" in error
    assert not os.path.exists(tmp_path / "r.json")


def test_an_output_it_cannot_write_is_refused_before_any_work(trained_run, tiny_dataset, tmp_path):
    """--output a directory, or under a file: refused naming --output before a part is evaluated,
    leaving no <output>.parts/ behind (it used to fail on writing the result, at the end)."""
    (tmp_path / "a-file").write_text("")
    for output, message in ((tmp_path, f"--output {tmp_path} is a directory"),
                            (tmp_path / "a-file" / "r.json", f"is under {tmp_path / 'a-file'}, which is a file")):
        outcome = run_main("eval", trained_run, "--data", tiny_dataset, "--output", str(output), "--workers", "1")
        assert_clean_refusal(outcome, message)
        assert outcome.status == 2 and "part(s)" not in outcome.stdout
    assert os.listdir(tmp_path) == ["a-file"] and not os.path.exists(f"{tmp_path}.parts")


@pytest.mark.slow
def test_a_full_disk_is_one_error_line_with_no_unhandled_failures_of_the_other_workers_after_it(
        ray_session, trained_run, tiny_dataset, tmp_path):
    """Every part fails to write its sums; the first failure ends the command, and the other
    workers' failures, never read, came after it as Ray's "Unhandled error" tracebacks. As a user
    runs it (a process of its own, which names what it left unread as it ends), on the session's Ray."""
    mounts = tmpfs(tmp_path, "8k")
    disk = next(mounts)
    try:
        done = run_cli("eval", trained_run, "--data", tiny_dataset, "--output", str(disk / "r.json"), "--workers", "2",
                       "--rows-per-part", "16", "--ray-address", ray_session.get_runtime_context().gcs_address)
        assert_clean_refusal(done, "No space left on device")
        assert done.returncode == 2 and not (disk / "r.json").exists()
        assert "Unhandled error" not in done.stderr, done.stderr[-3000:]
    finally:
        next(mounts, None)  # unmount


def test_an_empty_split_is_refused_naming_it_before_any_work(ray_session, trained_run, tmp_path):
    """A dataset prepared with --val-fraction 0 evaluated on its (empty) val split ended in a
    ZeroDivisionError traceback, after Ray had started; `raylm train` refuses the same dataset by name."""
    no_val = str(tmp_path / "no-val")
    prepare_dataset([write_corpus(tmp_path / "text", documents=20)], no_val, seq_len=32, val_fraction=0.0)
    output = tmp_path / "r.json"
    outcome = run_main("eval", trained_run, "--data", no_val, "--output", str(output))
    assert_clean_refusal(outcome, f"{no_val}: its val split is empty (prepared with --val-fraction 0)")
    assert outcome.status == 2 and "give --split train" in outcome.stderr
    assert "part(s)" not in outcome.stdout and not output.exists() and not (tmp_path / "r.parts").exists()


@pytest.mark.timeout(180, method="thread")  # a regression hangs in Ray's wait, where no signal reaches Python
def test_more_workers_than_the_cluster_holds_are_capped_and_none_that_fits_is_refused(
        ray_session, trained_run, tiny_dataset, tmp_path):
    """`--workers 3` on 2 CPUs hung for good after 7 of 8 parts: the actor Ray could never place
    had been handed a part up front. The session's Ray is one node of 4 CPUs: workers of 2 CPUs,
    two at once. A worker no node holds (more CPUs, a GPU) is refused by its flag, before any."""
    output = tmp_path / "r.json"
    outcome = run_main("eval", trained_run, "--data", tiny_dataset, "--output", str(output), "--workers", "3",
                       "--cpus-per-worker", "2", "--rows-per-part", "16")
    assert outcome.status == 0, outcome.stderr[-3000:]
    assert ("raylm eval: --workers 3: this Ray cluster holds 2 worker(s) of --cpus-per-worker 2 at once; "
            "evaluating with 2") in outcome.stdout
    assert json.loads(output.read_text())["workers"] == 2
    for flags, named in ((["--cpus-per-worker", "8"], "--cpus-per-worker 8: no node"),
                         (["--gpus-per-worker", "1"], "--cpus-per-worker 1 --gpus-per-worker 1: no node")):
        for command in (["--data", tiny_dataset], ["--tasks", TASK, "--include-path", write_task(tmp_path / "tasks")]):
            refused = run_main("eval", trained_run, *command, "--output", str(tmp_path / "n.json"), *flags)
            assert_clean_refusal(refused, named)
            assert refused.status == 2 and "the largest node has 4 CPUs" in refused.stderr
