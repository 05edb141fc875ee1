"""The step clock: time-based decisions (reports, saves by the minute, preemption polls) taken by
rank 0's clock, the same on every rank, with a collective at ticks about a second apart rather
than at every step."""

from __future__ import annotations

import json
import os
import time

from raylm.parallel.world import World
from raylm.train.clock import StepClock
from raylm.train.hooks import Hook
from raylm.train.loop import train_local
from tests.support.distributed import run_distributed
from tests.train.test_loop import tiny_config

STEPS = 120


def _ticking(step_s: float, tick_s: float, every_s: float) -> tuple[list[int], int]:
    world = World.current()
    clock = StepClock(world, tick_s)
    since = [time.monotonic()]

    def due() -> bool:  # asked on rank 0 only
        if time.monotonic() - since[0] < every_s:
            return False
        since[0] = time.monotonic()
        return True

    clock.add("timer", due)
    fired = []
    for boundary in range(STEPS):
        time.sleep(step_s * (1 + world.rank))  # the other rank is slower: rank 0's clock decides anyway
        if "timer" in clock.tick():
            fired.append(boundary)
    return fired, clock.ticks


def test_ranks_take_the_same_timed_decisions_at_ticks_not_every_step():
    (fired0, ticks0), (fired1, ticks1) = run_distributed(_ticking, 2, 0.005, 0.05, 0.2)
    assert fired0 == fired1 and ticks0 == ticks1  # the same boundaries on both ranks
    assert len(fired0) >= 2  # at least 1.2 s of steps: a timer every 0.2 s fires
    assert ticks0 <= STEPS // 3, ticks0  # ~10 ms a boundary, a tick every ~50 ms: not every boundary
    assert all(b - a >= 3 for a, b in zip(fired0, fired0[1:]))  # 0.2 s apart, not on consecutive ticks


class SlowSteps(Hook):
    def on_step_end(self, run, step, metrics):
        time.sleep(0.07)


def _train(dataset: str, run_dir: str, *extra: str) -> None:
    train_local(tiny_config(dataset, *extra), run_dir, hooks=(SlowSteps(),))


def test_checkpoints_by_the_minute_are_saved_on_every_rank_at_the_same_step(tiny_dataset, tmp_path):
    run = str(tmp_path / "run")
    # 60 steps of at least 70 ms, over 4 s: the ranks agree at ticks about a second apart (the
    # clock's TICK_S), and a save every 0.3 s is due at each, so 3 or more come before the last
    # step's. (At 20 ms a step a fast machine finished in under 3 s, with 2 ticks to save at.)
    run_distributed(_train, 2, tiny_dataset, run, "train.steps=60", "checkpoint.every_steps=0",
                    "checkpoint.every_minutes=0.005", "train.eval_every=0")
    saved = sorted(int(d.split("_")[1]) for d in os.listdir(run) if d.startswith("checkpoint_"))
    assert len(saved) >= 4 and saved[-1] == 60, saved
    times = {}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for row in map(json.loads, f):
            times[row["step"]] = row["time"]
    timed = saved[:-1]
    assert all(times[b] - times[a] >= 0.25 for a, b in zip(timed, timed[1:])), (saved, times)
