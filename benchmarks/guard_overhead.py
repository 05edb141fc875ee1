"""What the stability guard costs when nothing goes wrong, and how fast it gets past bad data.

    .venv/bin/python benchmarks/guard_overhead.py [--steps 200] [--rounds 5]

On the nanoGPT Shakespeare config (configs/nanogpt-shakespeare-char-cpu.yaml), trained in this
process (the loop on plain files with the local loader: no Ray in the timed steps):

1. Overhead, end to end: runs with the guard off, the guard on, and the guard on with its
   activation/parameter norms (`guard.norms_every`, the default 100), in interleaved rounds
   whose order alternates (ABC, CBA, ...) so that a drift of the machine's load cancels. Each
   run's cost is its mean step time after the first 20 steps (the snapshot every
   `guard.snapshot_every` steps is a cost of its own step: a median would hide it), also its
   median and 10th-percentile ("fast") step; a round's ratio is its guarded run against its
   unguarded run. Goal: the guard costs <= 1%.
2. Overhead, direct: the guard's own work per step timed alone on the same model and
   optimizer: judging a step against a full rolling window, and a snapshot amortised over
   `guard.snapshot_every` steps, each the best of many timings. A figure the machine's load
   barely moves, set against the fastest unguarded run's fast step (where its share is largest).
3. Recovery: the same data with the global batches of 5 consecutive steps replaced by random
   bytes; the wall time from the start of the first poisoned step to the end of the first step
   trained on clean data past the window (skips and rollbacks included), and the progress lost.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import load_average, print_table, shakespeare_bytes
from raylm.config import Config, load_config
from raylm.model.transformer import Transformer
from raylm.parallel.world import World
from raylm.train.resilience.guard import Guard, Snapshot
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from raylm.train.optim import build_optimizer
from raylm.train.spec import resolve_run
from raylm.train.state import TrainState
from raylm.parallel.layout import resolve_layout
from raylm.train.step import build_model
from tests.support.poison import poisoned_copy

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "nanogpt-shakespeare-char-cpu.yaml"
WARMUP_STEPS = 20
POISON_AT, POISON_STEPS = 120, 5
ARMS = {"guard off": ("guard.enabled=false", "guard.norms_every=0"),
        "guard on": ("guard.enabled=true", "guard.norms_every=0"),
        "guard on + norms/100": ("guard.enabled=true", "guard.norms_every=100")}


def config(data: str, steps: int, *extra: str) -> Config:
    return load_config(CONFIG, [f"data.path={data}", "data.loader=local", f"train.steps={steps}",
                                "train.eval_every=0", "train.tensorboard=false", "checkpoint.every_steps=0",
                                *extra])


def step_times(run_dir: str) -> list[float]:
    return [r["step_time"] for r in read_jsonl(f"{run_dir}/metrics.jsonl")[WARMUP_STEPS:]]


def overhead_rounds(data: str, steps: int, rounds: int, tmp: str) -> dict[str, list[list[float]]]:
    """Each arm's step times (after warm-up), per round."""
    times: dict[str, list[list[float]]] = {name: [] for name in ARMS}
    for r in range(rounds):
        order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
        for name in order:
            run = f"{tmp}/{name.replace(' ', '-').replace('/', '')}-{r}"
            train_local(config(data, steps, *ARMS[name]), run)
            times[name].append(step_times(run))
            print(f"round {r}: {name:<20} mean step {1e3 * statistics.fmean(times[name][-1]):.2f} ms, "
                  f"median {1e3 * statistics.median(times[name][-1]):.2f} ms (load {load_average()})", flush=True)
    return times


def direct_cost(data: str, tmp: str) -> dict[str, float]:
    """Seconds per call of the guard's per-step work, on the benchmark's own model and optimizer."""
    cfg = resolve_run(config(data, 200)).config
    world = World.current()
    model = build_model(lambda: Transformer(cfg.model), cfg, world,
                        resolve_layout(cfg.parallel, cfg.model, world.world_size, cfg.train.seq_len))
    optimizer = build_optimizer(model.parts, cfg.optim)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, 65))
    model.forward_backward(tokens, cfg.train.micro_batch_size)
    optimizer.step()  # the optimizer's state exists, as it does in a snapshot mid-run
    guard = Guard(cfg, model, optimizer, World.current(), f"{tmp}/events.jsonl", tmp)
    guard.start(TrainState())
    for i in range(cfg.guard.window):  # a full rolling window, as from step 128 on
        guard.judge(i, 2.0 + 0.01 * (i % 7), 0.5 + 0.01 * (i % 5))
    # The best of many batches (as timeit advises): what the work costs when it has a core,
    # rather than how long other jobs on a shared machine held it off one.
    batches, calls = 20, 250
    judge = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for i in range(calls):
            assert guard.judge(i, 2.0 + 0.01 * (i % 7), 0.5 + 0.01 * (i % 5)) == "ok"
        judge = min(judge, (time.perf_counter() - start) / calls)
    snapshot = float("inf")
    for _ in range(50):
        start = time.perf_counter()
        Snapshot.take(TrainState(step=25), guard.params, optimizer)
        snapshot = min(snapshot, time.perf_counter() - start)
    return {"judge": judge, "snapshot": snapshot, "per_step": judge + snapshot / cfg.guard.snapshot_every,
            "params": sum(p.numel() for p in guard.params)}


def recovery(data: str, tmp: str) -> dict:
    """Train through a poisoned window; when the guard got past it, and how."""
    steps = POISON_AT + 40
    cfg = config(data, steps)
    batch = cfg.train.global_batch_size
    poisoned = poisoned_copy(data, f"{tmp}/poisoned", cfg.data, batch, range(POISON_AT, POISON_AT + POISON_STEPS))
    run = f"{tmp}/recovery"
    train_local(config(poisoned, steps), run)
    rows = read_jsonl(f"{run}/metrics.jsonl")  # in the order written: a rollback repeats step numbers
    events = read_jsonl(f"{run}/events.jsonl")
    first = next(i for i, r in enumerate(rows) if r["step"] == POISON_AT)  # the last clean step before
    window_end = (POISON_AT + POISON_STEPS) * batch
    # The first step after it that trained (was not skipped) on samples past the window.
    past = next(r for prev, r in zip(rows[first:], rows[first + 1:])
                if r["position"] > window_end and r["skipped_steps"] == prev["skipped_steps"])
    rollbacks = [e for e in events if e["event"] == "rollback"]
    kinds = [e["event"] for e in events]
    return {"batch": batch, "seconds": past["time"] - rows[first]["time"],
            "actions": ", ".join(f"{k} ×{kinds.count(k)}" for k in dict.fromkeys(kinds)) or "none",
            "progress_lost": sum(e["step"] - e["to_step"] for e in rollbacks),
            # A union: the skipped steps before a rollback lie in its window, and a skipped step
            # right after one reports a range that starts at the window.
            "samples_left_out": len(set().union(*(range(*e["samples"]) for e in events
                                                  if e["event"] in ("rollback", "spike_skipped")))),
            "step_time": statistics.median(r["step_time"] for r in rows[WARMUP_STEPS:first])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", type=Path, default=REPO.parent / "shared" / "data" / "tinyshakespeare.txt")
    ap.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench-guard")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    data = shakespeare_bytes(args.input, args.workdir)
    print(f"load {load_average()}, torch threads {torch.get_num_threads()}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        times = overhead_rounds(data, args.steps, args.rounds, tmp)
        direct = direct_cost(data, tmp)
        rec = recovery(data, tmp)
    print(f"load {load_average()}", flush=True)

    off = times["guard off"]
    ratio = lambda name, stat: statistics.median(  # noqa: E731 - the median over rounds of on/off
        stat(on) / stat(base) for on, base in zip(times[name], off))
    # The 10th-percentile step: a shared VM switches between a fast and a slow state within a
    # run, and the fast steps of two runs compare alike.
    fast = lambda run: statistics.quantiles(run, n=10)[0]  # noqa: E731
    rows = [["mean step, guard off (median of rounds)", f"{1e3 * statistics.median(map(statistics.fmean, off)):.2f} ms"]]
    for name in ("guard on", "guard on + norms/100"):
        rounds = ", ".join(f"{100 * (statistics.fmean(a) / statistics.fmean(b) - 1):+.1f}"
                           for a, b in zip(times[name], off))
        rows += [[f"{name}: cost per step, mean step (median of rounds)",
                  f"{100 * (ratio(name, statistics.fmean) - 1):+.2f}% (rounds {rounds}%)"],
                 [f"{name}: cost per step, median step (median of rounds)",
                  f"{100 * (ratio(name, statistics.median) - 1):+.2f}%"],
                 [f"{name}: cost per step, fast step (median of rounds)", f"{100 * (ratio(name, fast) - 1):+.2f}%"]]
    fastest = min(map(fast, off))  # the guard's share is largest on the fastest step
    rows += [
        ["direct: judge a step (window 128)", f"{1e6 * direct['judge']:.1f} µs"],
        ["direct: snapshot (weights + AdamW state to host)",
         f"{1e3 * direct['snapshot']:.2f} ms for {direct['params'] / 1e6:.2f}M parameters"],
        ["direct: per step (judge + snapshot / 25)",
         f"{1e6 * direct['per_step']:.1f} µs = {100 * direct['per_step'] / fastest:.2f}% of the fastest run's "
         f"fast step, {1e3 * fastest:.1f} ms (goal <= 1%)"],
        ["poisoned window", f"{POISON_STEPS} steps × {rec['batch']} sequences at step {POISON_AT}"],
        ["guard actions", rec["actions"]],
        ["steps of progress rolled back", str(rec["progress_lost"])],
        ["samples left out (rolled-back windows and skipped steps)",
         f"{rec['samples_left_out']} ({POISON_STEPS * rec['batch']} poisoned)"],
        ["first poisoned step to clean training past it",
         f"{rec['seconds']:.2f} s ({rec['seconds'] / rec['step_time']:.1f} median steps)"],
    ]
    print_table(["measure", "value"], rows)


if __name__ == "__main__":
    main()
