"""The loop's reads of the device (train.read_every): a steady step queues its work and makes no
host sync; a read is one; and reading a window of steps at once decides everything as reading each
step does: the same losses, the same guard actions, with a suspect step's later batches queued
again behind it."""

from __future__ import annotations

import os

import pytest

from raylm.data.stream import Datasets
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from raylm.train.observe.syncs import StepCosts
from tests.support.order import epoch_samples
from tests.train.resilience.test_guard import BATCH, CONSTANT_LR, GUARD, GradientFault, Nudge, _poisoned
from tests.train.test_loop import tiny_config

pytestmark = pytest.mark.slow

QUIET = ("train.eval_every=0", "checkpoint.every_steps=0", "train.tensorboard=false", "guard.snapshot_every=100")


def _costs(dataset: str, run_dir: str, *extra: str) -> StepCosts:
    costs = StepCosts()
    train_local(tiny_config(dataset, "train.steps=24", *QUIET, *extra), run_dir, hooks=(costs,))
    return costs


def test_a_steady_step_makes_no_host_sync_and_a_read_one(tiny_dataset, tmp_path):
    # Reads after steps 8 and 16 (as metrics.jsonl counts; 7 and 15 as hooks do): one host sync
    # each, every row of its window from it; the steps between queue without one (the last step's
    # count holds the final checkpoint's).
    costs = _costs(tiny_dataset, str(tmp_path / "a"), "train.read_every=8", "train.log_every=8")
    assert {s: n for s, n in costs.syncs.items() if 2 <= s < 23} == {s: int(s in (7, 15)) for s in range(2, 23)}
    # On a CPU the default reads every step: it runs each operation as it is queued anyway.
    every = _costs(tiny_dataset, str(tmp_path / "b")).syncs
    assert {every[s] for s in range(2, 23)} == {1}
    rows = read_jsonl(os.path.join(tmp_path / "a", "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 25))  # a row for every step, written at the reads
    assert all(r["step_time"] > 0 for r in rows)


def _run(dataset: str, run_dir: str, read_every: int, *extra: str, hooks=()) -> tuple[dict, list]:
    train_local(tiny_config(dataset, f"train.read_every={read_every}", *extra), run_dir, hooks=hooks)
    losses = {r["step"]: r["loss"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    drop = ("time", "canary_before", "canary_after", "canary_at_lr_cut", "canary", "reference")
    events = [{k: v for k, v in e.items() if k not in drop} for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))
              if e["event"] not in ("run_started", "checkpoint_saved", "checkpoint_published")]
    return losses, events


SCENARIOS = {
    # A batch of noise that hurts the model: skipped, the batches behind it one step behind their labels.
    "skipped": (lambda data, tmp: _poisoned(data, tmp, range(30, 31)), (*CONSTANT_LR,), ()),
    # A poisoned window: skipped batch after batch, read one by one after the first.
    "poisoned window": (lambda data, tmp: _poisoned(data, tmp, range(28, 33)), (*CONSTANT_LR,), ()),
    # A strange batch that leaves the model sound: trained on after the canary's probe.
    "hard batch": (lambda data, tmp: _poisoned(data, tmp, range(30, 31)), (), ()),
    # A transient non-finite gradient: computed again, then trained on.
    "rerun": (lambda data, tmp: data, (), (lambda: GradientFault(float("nan"), 21),)),
    # Damaged weights: the first step on them is suspect, and the model rolls back with the LR cut.
    "rollback": (lambda data, tmp: data, ("guard.window=10", "schedule.name=constant", "schedule.warmup_steps=0"),
                 (lambda: Nudge(23, 0.2),)),
}


@pytest.mark.parametrize("case", list(SCENARIOS))
def test_reading_a_window_at_once_decides_as_reading_each_step(tiny_dataset, tmp_path, case):
    data_of, extra, hooks = SCENARIOS[case]
    data = data_of(tiny_dataset, tmp_path)
    common = ("train.steps=40", *GUARD, *extra)
    each = _run(data, str(tmp_path / "each"), 1, *common, hooks=tuple(h() for h in hooks))
    window = _run(data, str(tmp_path / "window"), 7, *common, hooks=tuple(h() for h in hooks))
    actions = [e["event"] for e in each[1]]
    assert any(a in actions for a in ("batch_skipped", "hard_batch", "rerun", "rollback")), actions
    assert window[1] == each[1]
    assert window[0] == each[0]  # exactly: the same updates in the same order
    assert sorted(window[0]) == list(range(1, 41))


def test_a_stream_the_quarantine_made_stale_starts_again_after_the_steps_in_flight(tiny_dataset, tmp_path):
    """Two epochs with a window of noise: skipped in the first, its rows quarantined, the stream
    that went on past the skips is stale where they come round again, and starts again from the
    run's state: only once the steps queued from it are read (a new stream started under them
    trained the same steps twice). The same samples, losses and events as a run read step by step."""
    data = _poisoned(tiny_dataset, tmp_path, range(30, 34))
    cfg = tiny_config(data)
    order = Datasets.load(cfg.data, None).open_split("train", cfg.data, None).order
    common = (f"train.steps={2 * epoch_samples(order) // BATCH}", *GUARD, *CONSTANT_LR, "train.audit_samples=true")
    each = _run(data, str(tmp_path / "each"), 1, *common)
    window = _run(data, str(tmp_path / "window"), 7, *common)
    assert any(e["event"] == "samples_quarantined" for e in each[1])
    assert window == each
    rows = lambda run: [r["samples"] for r in read_jsonl(os.path.join(tmp_path, run, "metrics.jsonl"))]  # noqa: E731
    assert rows("window") == rows("each")


def _steady_costs(dataset: str, run_dir: str) -> StepCosts:
    import torch.distributed as dist

    from raylm.train import clock, loop
    from raylm.train.resilience.health import LocalTimeProbe, StragglerMonitor

    # The clock's tick (its collective, about a second apart) at the first boundary alone.
    loop.StepClock = lambda world: clock.StepClock(world, tick_s=3600.0)
    costs = StepCosts()
    hooks = (LocalTimeProbe(), StragglerMonitor(f"node-{dist.get_rank()}", k=3.0), costs)  # as raylm's workers
    train_local(tiny_config(dataset, "train.steps=24", "train.read_every=8", "train.log_every=8",
                            "parallel.sharding=full", "checkpoint.every_steps=8", "checkpoint.async_save=true",
                            *QUIET[:1], *QUIET[2:]), run_dir, hooks=hooks)
    return costs


def test_a_steady_step_on_two_ranks_makes_no_collective_and_no_host_sync_beside_its_own(tiny_dataset, tmp_path):
    """FSDP2 on two gloo ranks, the straggler monitor on, an async save in flight: between reads a
    step makes no host sync and no collective but its forward and backward's; the straggler times
    are gathered every 5 steps in one collective, the save polled at the clock's ticks."""
    from tests.support.distributed import run_distributed

    for costs in run_distributed(_steady_costs, 2, tiny_dataset, str(tmp_path / "run")):
        reads = {s for s in costs.syncs if (s + 1) % 8 == 0}
        steady = [s for s in costs.syncs if s >= 2 and s not in reads]  # past the first boundary's tick
        assert len(steady) == 19 and len(reads) == 3
        assert {s: costs.syncs[s] for s in steady} == dict.fromkeys(steady, 0)
        assert {s: costs.loop[s] for s in steady} == dict.fromkeys(steady, [])
        assert all(costs.model[s] for s in steady)  # FSDP2's gathers and reductions, the loss's mean
        assert all(costs.syncs[s] >= 1 for s in reads)  # the read itself, then its commits' (straggler gathers, saves)
        # The straggler monitor's times of 5 steps in one gather, not one a step.
        assert sum(names.count("all_gather") for names in costs.loop.values()) == 24 // 5
