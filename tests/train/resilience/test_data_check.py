"""The guard's data check: rows that are noise by the dataset's own statistics (recorded by
`raylm prepare`) are left out from step 0, before any model can judge them (a batch of them alone
skipped, beside clean rows masked); clean data skips nothing; a dataset prepared before the
statistics trains with the check off, said once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import string

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raylm.config import GuardConfig
from raylm.data import rowstats
from raylm.data.manifest import MANIFEST_FILE, load_manifest
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from raylm.train.resilience.datacheck import DataCheck, data_limit, masking_steps, row_entropy
from raylm.train.resilience.guard import OFF_DATA
from tests.support.distributed import run_distributed
from tests.support.fixtures import write_corpus
from tests.support.poison import poisoned_copy, poisoned_rows
from tests.train.test_loop import tiny_config

pytestmark = pytest.mark.slow

BATCH = 8  # tiny_config's global batch
QUIET = ("train.eval_every=0", "train.tensorboard=false", "checkpoint.every_steps=0")


def _events(run_dir: str, kind: str) -> list[dict]:
    return [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == kind]


def _train_ranks(dataset: str, run_dir: str, *extra: str) -> None:
    train_local(tiny_config(dataset, *extra), run_dir)


def test_prepare_records_the_row_statistics_and_the_manifest_round_trips_them(tiny_dataset):
    manifest = load_manifest(tiny_dataset)
    check = manifest.data_check
    targets = np.concatenate([_targets(os.path.join(tiny_dataset, s.file)) for s in manifest.splits["train"].shards])
    assert check.unigram == np.bincount(targets.reshape(-1), minlength=manifest.vocab_size).tolist()
    # The medians the histograms give are the train split's own, to the histograms' resolution.
    logp = rowstats.log_probs(np.asarray(check.unigram))
    assert check.cross_entropy.median == pytest.approx(np.median(rowstats.row_cross_entropy(targets, logp)), abs=0.01)
    assert check.entropy.median == pytest.approx(np.median(rowstats.row_entropy(targets)), abs=0.01)
    assert 0 < check.entropy.deviation < 0.5 and 0 < check.cross_entropy.deviation < 0.5
    assert load_manifest(tiny_dataset).to_dict() == json.loads(manifest.to_json())
    assert json.loads(manifest.to_json())["data_check"] == dataclasses.asdict(check)


def test_in_a_dataset_prepared_with_a_poisoned_window_its_rows_and_no_others_are_noise(ray_session, tmp_path):
    """The statistics are the poisoned dataset's own (a tenth of it noise): medians and their
    deviations hardly move, and the check still tells every row of the window from the text."""
    from raylm.data.prepare import prepare_dataset

    corpus = write_corpus(tmp_path / "text")
    size = sum(os.path.getsize(os.path.join(corpus, f)) for f in os.listdir(corpus)) // 9
    rng = random.Random(3)
    while True:  # a window the hash split puts in train
        noise = "".join(rng.choice(string.printable[:95]) for _ in range(size))
        if hashlib.blake2b(noise.encode(), digest_size=8).digest() >= int(0.1 * 2**64).to_bytes(8, "big"):
            break
    with open(os.path.join(corpus, "doc0060a.txt"), "w") as f:
        f.write(noise)
    out = str(tmp_path / "prepared")
    prepare_dataset([corpus], out, tokenizer="byte", seq_len=32, val_fraction=0.1)
    manifest = load_manifest(out)
    targets = np.concatenate([_targets(os.path.join(out, s.file)) for s in manifest.splits["train"].shards])
    limit, _ = data_limit([manifest], [out], GuardConfig().data_deviations)
    check = DataCheck(limit, torch.device("cpu"))
    noise_rows = np.array([float(check.noise_share(torch.from_numpy(row[None]))) for row in targets]) == 1.0
    # The window's rows: row k's targets are the stream's tokens k * 32 + 1 ... (k + 1) * 32.
    stream = np.concatenate([[0], targets.reshape(-1)]).astype(np.uint16).tobytes()
    start = stream.find(np.frombuffer(noise.encode()[:64], dtype=np.uint8).astype(np.uint16).tobytes()) // 2
    first, end = -(-start // 32), (start + size - 1) // 32  # rows wholly inside it
    assert set(range(first, end)) <= set(np.flatnonzero(noise_rows)) <= set(range(first - 1, end + 1))


def test_a_manifest_without_the_statistics_hashes_as_before(tiny_dataset, tmp_path):
    old = _older(tiny_dataset, str(tmp_path / "old"))
    manifest = load_manifest(old)
    assert manifest.data_check is None
    written = open(os.path.join(old, MANIFEST_FILE)).read()
    assert json.loads(manifest.to_json()) == json.loads(written)  # no key added: a resume's data hash holds


def test_the_device_statistics_are_the_prepared_ones():
    rows = np.random.default_rng(0).integers(0, 60, size=(12, 64))
    on_device = row_entropy(torch.from_numpy(rows)).numpy()
    assert on_device == pytest.approx(rowstats.row_entropy(rows), rel=1e-6)


def test_a_poisoned_window_met_at_step_0_is_skipped_from_step_0_and_recorded(tiny_dataset, tmp_path):
    """Random bytes in the first batches of the run: the model knows nothing yet (the canary could
    not tell), the data check skips them all, on both ranks alike, and records them as the guard's
    other skips."""
    data = poisoned_copy(tiny_dataset, str(tmp_path / "poisoned"), tiny_config(tiny_dataset).data, BATCH,
                         range(0, 4))
    run = str(tmp_path / "run")
    run_distributed(_train_ranks, 2, data, run, "train.steps=12", *QUIET)
    skipped = _events(run, "batch_skipped")
    # Each at step 0 (a skipped batch does not advance the step), its samples from the run's position.
    assert [(e["step"], e["samples"]) for e in skipped] == [(0, [0, (k + 1) * BATCH]) for k in range(4)]
    assert {e["reason"] for e in skipped} == {OFF_DATA} and all(e["noise_share"] == 1.0 for e in skipped)
    assert _events(run, "hard_batch") == []
    rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 13))  # the steps go on, on the batches after
    assert rows[-1]["skipped_samples"] == 4 * BATCH and rows[0]["position"] == 5 * BATCH
    reference = str(tmp_path / "reference")  # the same as a run told to skip the window
    run_distributed(_train_ranks, 2, data, reference, "train.steps=12", *QUIET, f"data.skip=[[0, {4 * BATCH}]]")
    losses = lambda run: {r["step"]: r["loss"] for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}  # noqa: E731
    assert losses(run) == pytest.approx(losses(reference), rel=1e-6)


def test_a_window_mixed_with_clean_rows_has_its_noise_rows_masked_and_the_clean_ones_trained(tiny_dataset, tmp_path):
    """Noise rows beside clean ones, as a window read in chunks of shuffled rows comes: a batch half
    noise (rank 0's rows all noise, rank 1's clean) arms the masking from step 0; its noise rows are
    left out of the loss and the clean rows trained on, as a batch of them alone would be; a batch
    an eighth noise inside the masking's span has its one row left out; a batch of noise alone is
    skipped. Every row left out is a recorded skip, and not among the samples the step trained."""
    cfg = tiny_config(tiny_dataset)
    noise = [0, 1, 2, 3, 9, *range(16, 24)]  # step 0: half; step 1: one row; step 2: all
    data = poisoned_rows(tiny_dataset, str(tmp_path / "poisoned"), cfg.data, noise)
    run = str(tmp_path / "run")
    run_distributed(_train_ranks, 2, data, run, "train.steps=4", "train.audit_samples=true", *QUIET)
    span = masking_steps(cfg.data.chunk_rows, BATCH)
    assert [(e["step"], e["until"], e["noise_share"]) for e in _events(run, "noise_masking")] == [
        (0, span, 0.5), (2, 2 + span, 1.0)]
    assert [(e["step"], e["samples"]) for e in _events(run, "rows_masked")] == [(0, [0, 1, 2, 3]), (1, [9])]
    assert [(e["step"], e["samples"]) for e in _events(run, "batch_skipped")] == [(2, [16, 24])]
    rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["samples"] for r in rows[:3]] == [[4, 5, 6, 7], [8, *range(10, 16)], list(range(24, 32))]
    assert rows[-1]["skipped_samples"] == len(noise)
    _first_step_as_its_kept_rows_alone(tiny_dataset, tmp_path, rows[0])


@pytest.mark.parametrize("layout", [("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.loss_parallel=true",
                                     "model.vocab_multiple=64"),
                                    ("parallel.pp=2", "parallel.pp_schedule=gpipe")], ids=["tp2_loss_parallel", "pp2"])
def test_a_masked_step_trains_on_its_kept_rows_in_a_sharded_loss_and_in_pipeline_stages(tiny_dataset, tmp_path, layout):
    data = poisoned_rows(tiny_dataset, str(tmp_path / "poisoned"), tiny_config(tiny_dataset).data, [0, 1, 2, 3])
    run = str(tmp_path / "run")
    run_distributed(_train_ranks, 2, data, run, "train.steps=2", *layout, *QUIET)
    assert [(e["step"], e["samples"]) for e in _events(run, "rows_masked")] == [(0, [0, 1, 2, 3])]
    _first_step_as_its_kept_rows_alone(tiny_dataset, tmp_path, read_jsonl(os.path.join(run, "metrics.jsonl"))[0],
                                       *layout)


def _first_step_as_its_kept_rows_alone(dataset: str, tmp_path, row: dict, *layout: str) -> None:
    """Step 0, its rows at positions 0-3 masked, trained on rows 4-7 as a batch of them alone does:
    the same loss and gradient norm."""
    alone = str(tmp_path / "alone")
    run_distributed(_train_ranks, 2, dataset, alone, "train.steps=2", "train.global_batch_size=4",
                    "train.micro_batch_size=2", "data.skip=[[0, 4]]", *layout, *QUIET)
    first = read_jsonl(os.path.join(alone, "metrics.jsonl"))[0]
    assert (row["loss"], row["grad_norm"]) == pytest.approx((first["loss"], first["grad_norm"]), rel=1e-5)


def test_the_masking_resumes_armed_from_a_checkpoint(tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset)
    data = poisoned_rows(tiny_dataset, str(tmp_path / "poisoned"), cfg.data, [0, 1, 2, 9])
    common = ("train.steps=4", "checkpoint.every_steps=1", "train.eval_every=0", "train.tensorboard=false")
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    train_local(tiny_config(data, *common), straight)
    train_local(tiny_config(data, *common, "train.stop_at_step=1"), stopped)
    train_local(tiny_config(data, *common), stopped)  # resumed at step 1, inside the masking's span
    masked = lambda run: [(e["step"], e["samples"]) for e in _events(run, "rows_masked")]  # noqa: E731
    assert masked(stopped) == masked(straight) == [(0, [0, 1, 2]), (1, [9])]
    losses = lambda run: {r["step"]: r["loss"] for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}  # noqa: E731
    assert losses(stopped) == pytest.approx(losses(straight), rel=1e-6)


def test_clean_data_skips_nothing_and_trains_as_without_the_check(tiny_dataset, tmp_path):
    checked, unchecked = str(tmp_path / "checked"), str(tmp_path / "unchecked")
    train_local(tiny_config(tiny_dataset, "train.steps=40", *QUIET), checked)
    train_local(tiny_config(tiny_dataset, "train.steps=40", *QUIET, "guard.data_deviations=0"), unchecked)
    assert _events(checked, "batch_skipped") == []
    losses = lambda run: [r["loss"] for r in read_jsonl(os.path.join(run, "metrics.jsonl"))]  # noqa: E731
    assert losses(checked) == losses(unchecked)


def test_an_older_dataset_trains_with_the_check_off_said_once(tiny_dataset, tmp_path, capsys):
    old = _older(poisoned_copy(tiny_dataset, str(tmp_path / "poisoned"), tiny_config(tiny_dataset).data, BATCH,
                               range(0, 1)), str(tmp_path / "old"))
    run = str(tmp_path / "run")
    train_local(tiny_config(old, "train.steps=3", *QUIET), run)
    said = [line for line in capsys.readouterr().out.splitlines() if "data check is off" in line]
    assert len(said) == 1 and "prepare it again" in said[0]
    assert _events(run, "batch_skipped") == []


def test_the_check_is_off_for_a_mixture_and_by_choice(tiny_dataset):
    manifest = load_manifest(tiny_dataset)
    limit, why = data_limit([manifest], ["a"], 8.0)
    assert why is None and limit.cross_entropy > manifest.data_check.cross_entropy.median
    assert data_limit([manifest, manifest], ["a", "b"], 8.0)[0] is None
    assert data_limit([manifest], ["a"], 0.0) == (None, None)


def _targets(path: str) -> np.ndarray:
    tokens = pq.read_table(path).column("tokens").combine_chunks()
    return tokens.flatten().to_numpy().reshape(len(tokens), -1)[:, 1:].astype(np.int64)


def _older(dataset: str, out: str) -> str:
    """A copy of `dataset` whose manifest is as prepare wrote it before the statistic."""
    shutil.copytree(dataset, out)
    path = os.path.join(out, MANIFEST_FILE)
    manifest = json.load(open(path))
    del manifest["data_check"]
    with open(path, "w") as f:
        json.dump(manifest, f, indent=2)
    os.remove(os.path.join(out, "verified.json")) if os.path.exists(os.path.join(out, "verified.json")) else None
    return out
