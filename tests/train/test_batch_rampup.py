"""Batch-size ramp-up (PaLM, Megatron's --rampup-batch-size): the sizes follow the samples
consumed, the run trains on the same samples in the same order, and resumes and resizes
mid-ramp continue exactly where the schedule stands."""

from __future__ import annotations

import os

import pytest

from raylm.config import ConfigError
from raylm.data.stream import BatchSchedule
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from raylm.train.spec import resolve_layouts, resolve_run
from tests.support.distributed import run_distributed
from tests.train.test_loop import tiny_config

RAMP = ("train.global_batch_size=16", "train.micro_batch_size=2", "train.batch_rampup={start: 8, increment: 4, samples: 48}",
        "train.audit_samples=true", "train.eval_every=0", "train.tensorboard=false", "checkpoint.every_steps=2",
        "schedule.warmup_steps=0")
SIZES = [8, 8, 8, 12, 12, 16, 16, 16, 16, 16]  # consumed 0, 8, 16 | 24, 36 | 48, ...


def test_the_schedule_grows_in_equal_shares_of_the_ramp_samples():
    ramp = BatchSchedule(32, start=8, increment=8, ramp_samples=96)
    assert [ramp.size(c) for c in (0, 31, 32, 63, 64, 95, 96, 10**9)] == [8, 8, 16, 16, 24, 24, 32, 32]
    assert ramp.sizes() == [8, 16, 24, 32] and BatchSchedule(32).sizes() == [32]


def test_a_ramp_that_does_not_reach_the_batch_in_whole_increments_is_refused(tiny_dataset):
    with pytest.raises(ConfigError, match=r"train.batch_rampup: start 8 .* increments of 5"):
        resolve_run(tiny_config(tiny_dataset, "train.global_batch_size=16", "train.batch_rampup={start: 8, increment: 5, samples: 48}"))
    with pytest.raises(ConfigError, match=r"global batch 12 cannot be split over 2 workers .* a multiple of 8$"):
        resolve_run(tiny_config(tiny_dataset, *RAMP[:3], "train.micro_batch_size=4", "parallel.num_workers=2"))


def test_a_global_batch_that_does_not_split_names_the_multiple_that_does():
    """One world size reads as one, an elastic range as a range, and both name the multiple that
    splits (it read "every size in [2, 2] divides", though what must divide the batch is the
    data-parallel ranks times the micro-batch, not the world size)."""
    def refusal(*extra: str) -> str:
        with pytest.raises(ConfigError) as raised:
            resolve_layouts(tiny_config("unread", "model.vocab_size=256", *RAMP[:3], *extra), 32)
        return str(raised.value)

    keys = "(parallel.tp=1, parallel.pp=1, train.micro_batch_size={}) into whole micro-batches"
    assert refusal("train.micro_batch_size=4", "parallel.num_workers=2") == (
        f"global batch 12 cannot be split over 2 workers {keys.format(4)}: choose a global batch (and "
        "batch_rampup sizes) that is a multiple of 8")
    assert refusal("parallel.num_workers=5", "parallel.min_workers=2") == (
        f"global batch 8 cannot be split over 3 or 5 workers {keys.format(2)}: choose a global batch (and "
        "batch_rampup sizes) that is a multiple of 120, which splits over every size from 2 to 5 workers "
        "(parallel.min_workers to parallel.num_workers), or narrow that range")


def _rows(run_dir: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}


def test_same_samples_in_order_and_an_exact_resume_mid_ramp(tiny_dataset, tmp_path):
    straight = str(tmp_path / "straight")
    train_local(tiny_config(tiny_dataset, "train.steps=10", *RAMP), straight)
    rows = _rows(straight)
    assert [rows[s]["global_batch"] for s in range(1, 11)] == SIZES
    samples = [i for s in range(1, 11) for i in rows[s]["samples"]]
    assert samples == list(range(sum(SIZES)))  # every sample once, in the order of a constant batch
    stopped = str(tmp_path / "stopped")
    train_local(tiny_config(tiny_dataset, "train.steps=10", "train.stop_at_step=4", *RAMP), stopped)
    train_local(tiny_config(tiny_dataset, "train.steps=10", *RAMP), stopped)  # resumes at step 4, mid-ramp
    again = _rows(stopped)
    for step in range(1, 11):
        assert again[step]["samples"] == rows[step]["samples"], step
        assert again[step]["loss"] == pytest.approx(rows[step]["loss"], rel=1e-6), step


def _train_ranks(dataset: str, run_dir: str, *extra: str) -> None:
    train_local(tiny_config(dataset, *extra), run_dir)


@pytest.mark.slow
def test_a_resize_mid_ramp_keeps_the_schedule_and_the_samples(tiny_dataset, tmp_path):
    straight = str(tmp_path / "straight")
    run_distributed(_train_ranks, 2, tiny_dataset, straight, "train.steps=10", *RAMP)
    resized = str(tmp_path / "resized")
    run_distributed(_train_ranks, 2, tiny_dataset, resized, "train.steps=10", "train.stop_at_step=4", *RAMP)
    train_local(tiny_config(tiny_dataset, "train.steps=10", *RAMP), resized)  # 1 rank from step 4
    want, got = _rows(straight), _rows(resized)
    assert [got[s]["global_batch"] for s in range(1, 11)] == SIZES
    for step in range(1, 11):
        assert got[step]["samples"] == want[step]["samples"], step
        # another world size reduces in another order: close, not bitwise
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-6 if step <= 4 else 5e-3), step
