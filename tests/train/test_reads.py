"""The loop's reads of the device (train.read_every): a steady step queues its work and makes no
host sync; a read is one; and reading a window of steps at once decides everything as reading each
step does: the same losses, the same guard actions, with a suspect step's later batches queued
again behind it."""

from __future__ import annotations

import os
import threading

import pytest

from raylm.data.stream import Datasets
from raylm.train.hooks import Hook
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from raylm.train.observe.syncs import HostSyncCounter
from tests.support.order import epoch_samples
from tests.train.resilience.test_guard import BATCH, CONSTANT_LR, GUARD, GradientFault, Nudge, _poisoned
from tests.train.test_loop import tiny_config

pytestmark = pytest.mark.slow

QUIET = ("train.eval_every=0", "checkpoint.every_steps=0", "train.tensorboard=false", "guard.snapshot_every=100")


class SyncsBetween(Hook):
    """Host syncs from the queueing of step `first` to that of step `last` (0-based, as hooks count)."""

    def __init__(self, first: int, last: int):
        self.first, self.last, self.count = first, last, None

    def on_train_start(self, run):
        self.counter = HostSyncCounter(run.world.device)

    def on_step_begin(self, run, step):
        if step == self.first:
            self.counter.start()
        elif step == self.last and self.count is None:
            self.counter.stop()
            self.count = self.counter.count


def _syncs(dataset: str, run_dir: str, first: int, last: int, *extra: str) -> int:
    hook = SyncsBetween(first, last)
    train_local(tiny_config(dataset, "train.steps=24", *QUIET, *extra), run_dir, hooks=(hook,))
    return hook.count


def test_a_steady_step_makes_no_host_sync_and_a_read_one(tiny_dataset, tmp_path):
    # Reads after steps 8, 16, 24 (as metrics.jsonl counts): steps 10..15 queue without one.
    assert _syncs(tiny_dataset, str(tmp_path / "a"), 9, 15, "train.read_every=8", "train.log_every=8") == 0
    # Step 16's read, the one sync of its window: every row of the window comes from it.
    assert _syncs(tiny_dataset, str(tmp_path / "b"), 15, 17, "train.read_every=8", "train.log_every=8") == 1
    # On a CPU the default reads every step: it runs each operation as it is queued anyway.
    assert _syncs(tiny_dataset, str(tmp_path / "c"), 9, 15) == 6
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


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce_scatter_tensor", "barrier", "gather", "scatter")


class CostsPerStep(Hook):
    """Per step (from its queueing to the next one's): host syncs, and the collectives the loop
    makes beside the step's own (the model's gradient reductions and loss mean in forward and
    backward, whose count is the layout's)."""

    def __init__(self, calls: list):
        self.calls, self.syncs, self.collectives, self.step = calls, {}, {}, None

    def on_train_start(self, run):
        self.counter = HostSyncCounter(run.world.device)
        self.counter.start()

    def on_step_begin(self, run, step):
        self._close()
        self.counter.count, self.step = 0, step

    def _close(self):
        if self.step is not None:
            self.syncs[self.step], self.collectives[self.step] = self.counter.count, list(self.calls)
        self.calls.clear()

    def on_train_end(self, run, metrics):
        self._close()
        self.counter.stop()


def _steady_costs(dataset: str, run_dir: str) -> tuple[dict, dict]:
    import torch.distributed as dist

    from raylm.train import clock, loop
    from raylm.train.resilience.health import LocalTimeProbe, StragglerMonitor

    # The clock's tick (its collective, about a second apart) at the first boundary alone.
    loop.StepClock = lambda world: clock.StepClock(world, tick_s=3600.0)
    calls, counting, loop_thread = [], [True], threading.get_ident()
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            # The loop's own; an async save's writer runs collectives of its own group in the background.
            if counting[0] and threading.get_ident() == loop_thread:
                calls.append(_name)
            return _original(*args, **kwargs)
        setattr(dist, name, counted)
    forward_backward = loop.Trainer.forward_backward

    def own_collectives_uncounted(self, batch):
        counting[0] = False
        try:
            return forward_backward(self, batch)
        finally:
            counting[0] = True
    loop.Trainer.forward_backward = own_collectives_uncounted
    costs = CostsPerStep(calls)
    hooks = (LocalTimeProbe(), StragglerMonitor(f"node-{dist.get_rank()}", k=3.0), costs)  # as raylm's workers
    train_local(tiny_config(dataset, "train.steps=24", "train.read_every=8", "train.log_every=8",
                            "parallel.sharding=full", "checkpoint.every_steps=8", "checkpoint.async_save=true",
                            *QUIET[:1], *QUIET[2:]), run_dir, hooks=hooks)
    return costs.syncs, costs.collectives


def test_a_steady_step_on_two_ranks_makes_no_collective_and_no_host_sync_beside_its_own(tiny_dataset, tmp_path):
    """FSDP2 on two gloo ranks, the straggler monitor on, an async save in flight: between reads a
    step makes no host sync and no collective but its forward and backward's; the straggler times
    are gathered every 5 steps in one collective, the save polled at the clock's ticks."""
    from tests.support.distributed import run_distributed

    for syncs, collectives in run_distributed(_steady_costs, 2, tiny_dataset, str(tmp_path / "run")):
        reads = {s for s in syncs if (s + 1) % 8 == 0}
        steady = [s for s in syncs if s >= 2 and s not in reads]  # past the first boundary's tick
        assert len(steady) == 19 and len(reads) == 3
        assert {s: syncs[s] for s in steady} == dict.fromkeys(steady, 0)
        assert {s: collectives[s] for s in steady} == dict.fromkeys(steady, [])
        assert all(syncs[s] >= 1 for s in reads)  # the read itself, then its commits' (straggler gathers, saves)
        # The straggler monitor's times of 5 steps in one gather, not one a step.
        assert sum(names.count("all_gather") for names in collectives.values()) == 24 // 5
