"""The stability guard's panel: clean runs it must leave alone, and troubled ones it must save.

    .venv/bin/python benchmarks/guard_panel.py [--cases all] [--json-out PATH]
    .venv/bin/python benchmarks/guard_panel.py --quick        # the slow test suite's reduced panel

Each case trains in a process of its own (`train_local`, one worker; `--jobs N`: N at a time), with
the shipped guard defaults and with the guard off, and is judged by the run's own final validation
loss:

- clean, shuffled: `make demo`'s config on the built-in corpus; the nanoGPT config on Shakespeare.
  Goal: no sample skipped, no stop, val loss no worse (within noise) than with the guard off.
- clean, contiguous: Shakespeare followed by Python sources (the standard library's), read in
  chunks of 4096 rows, so the run crosses domain boundaries. Goal as above.
- poisoned window: ~300 KB of random printable bytes in the middle of Shakespeare, read in the
  default chunks of 64 rows (whole batches of noise). Goal: the guard acts, and the val loss is
  within 3% of the same run on the clean text.
- too-high LR: the nanoGPT config at an LR at which it diverges without the guard. Goal: the guard
  rolls back and cuts the LR, and the run ends within 5% of the val loss of the config's own LR.
- NaN: a non-finite loss injected once. Goal: the run finishes, nothing skipped, no restart.
- cost: the mean step time of the clean nanoGPT run (the guard's checks land in the steps that take
  them), guard on against off, in alternating rounds (goal ≤ 2% more).

`--quick` runs every case on fewer steps (300; the demo 100) and a fifth of the poison: the same
code path, in minutes (tests/test_guard_panel.py runs it on a text every Python carries).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import statistics
import string
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from _common import load_average, print_table, python_sources, shakespeare_bytes

from raylm.config import Config, load_config
from raylm.data.prepare import prepare_dataset
from raylm.ray_runtime import start_ray
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from raylm.train.resilience.guard import STALLED

REPO = Path(__file__).resolve().parents[1]
NANOGPT = REPO / "configs" / "nanogpt-shakespeare-char-cpu.yaml"
DEMO = REPO / "configs" / "demo-cpu.yaml"
ACTIONS = ("hard_batch", "lr_cut", "batch_skipped", "rerun", "rollback", "guard_stopped")


@dataclass
class Outcome:
    case: str
    guard: bool
    val_loss: Optional[float]
    steps: int
    skipped_samples: int
    actions: dict[str, int]
    stopped: Optional[str]
    mean_step_s: float  # after the first 10% of steps; every step counts, the guard's checks included
    guard_share: float  # of all the steps' time, the guard's own work (metrics' guard_s)
    wall_s: float
    lr_cap: Optional[float] = None
    lr_scale: float = 1.0
    extra: dict = field(default_factory=dict)


def run_case(name: str, cfg: Config, run_dir: Path, guard: bool) -> Outcome:
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg.guard.enabled = guard
    started, stopped = time.monotonic(), None
    try:
        train_local(cfg, str(run_dir))
    except Exception as e:  # noqa: BLE001 - a stop or a divergence is the outcome being measured
        stopped = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    rows = read_jsonl(str(run_dir / "metrics.jsonl"))
    events = read_jsonl(str(run_dir / "events.jsonl"))
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    steady = [r["step_time"] for r in rows[len(rows) // 10:]] or [0.0]
    stalls = [e for e in events if e["event"] == "rollback" and e.get("reason") == STALLED]
    return Outcome(name, guard, val[-1] if val and rows[-1]["step"] == cfg.train.steps else None,
                   rows[-1]["step"] if rows else 0, rows[-1].get("skipped_samples", 0) if rows else 0,
                   {k: sum(e["event"] == k for e in events) for k in ACTIONS}, stopped, statistics.fmean(steady),
                   sum(r.get("guard_s", 0.0) for r in rows) / max(sum(r["step_time"] for r in rows), 1e-9),
                   time.monotonic() - started, rows[-1].get("lr_cap") if rows else None,
                   rows[-1].get("lr_scale", 1.0) if rows else 1.0,
                   {"stalls": len(stalls), "skipped_by_stalls": sum(len(e["skipped"]) for e in stalls)})


# ----------------------------------------------------------------------------- data

def write_shakespeare_documents(text: str, out: Path, poison_bytes: int = 0, seed: int = 0) -> Path:
    """The text as documents of ~50 lines each (so a hash split spreads them over train and val),
    with `poison_bytes` of random printable characters as one document in the middle."""
    out.mkdir(parents=True, exist_ok=True)
    lines = text.splitlines(keepends=True)
    chunks = ["".join(lines[i:i + 50]) for i in range(0, len(lines), 50)]
    if poison_bytes:
        rng = random.Random(seed)
        noise = "".join(rng.choice(string.printable[:95]) for _ in range(poison_bytes))
        chunks.insert(len(chunks) // 2, noise)
    for i, chunk in enumerate(chunks):
        (out / f"part-{i:05d}.txt").write_text(chunk)
    return out


def prepared(inputs: list[str], out: Path, seq_len: int) -> str:
    if not (out / "manifest.json").exists():
        prepare_dataset(inputs, str(out), tokenizer="byte", seq_len=seq_len, val_fraction=0.1)
    return str(out)


# ----------------------------------------------------------------------------- the panel

def nanogpt(data: str, *extra: str) -> Config:
    return load_config(NANOGPT, [f"data.path={data}", "checkpoint.every_steps=0", "train.tensorboard=false",
                                 "train.log_every=500", *extra])


def cases(args: argparse.Namespace) -> dict[str, tuple[Callable[[], Config], bool]]:
    """name -> (its config, the data prepared when called; whether to run it with the guard off as well)."""
    work, quick = args.workdir, args.quick
    # Reduced: 300 steps, checks every 25 (as the 2000-step runs' default every 100 are, near enough,
    # against their length: a stall at the unigram level lasts a fraction of either run).
    steps = ["train.steps=300", "schedule.warmup_steps=30", "train.eval_every=100",
             "guard.snapshot_every=25"] if quick else []
    text = args.input.read_text()
    docs = lambda: write_shakespeare_documents(text, work / "text" / "shakespeare")  # noqa: E731

    def shakespeare(*extra: str) -> Config:
        return nanogpt(shakespeare_bytes(args.input, work), *steps, *extra)

    def contiguous() -> Config:
        py = python_sources(work / "text" / "python", 150 if quick else 600)
        return nanogpt(prepared([str(docs()), str(py)], work / "data" / "contiguous-64", 64), "data.chunk_rows=4096",
                       *steps)

    def poisoned() -> Config:
        poison = write_shakespeare_documents(text, work / "text" / "poisoned",
                                             poison_bytes=60_000 if quick else 300_000)
        return nanogpt(prepared([str(poison)], work / "data" / "poisoned-64", 64), "data.chunk_rows=64", *steps)

    def demo() -> Config:
        data = prepared([], work / "data" / "stdlib-byte-256", 256)
        return load_config(DEMO, [f"data.path={data}", "checkpoint.every_steps=0", "train.tensorboard=false",
                                  "parallel.num_workers=1", *(["train.steps=100"] if quick else [])])

    return {
        "clean, shuffled: demo": (demo, True),
        "clean, shuffled: nanoGPT": (shakespeare, True),
        "clean, contiguous": (contiguous, True),
        "poisoned window": (poisoned, True),
        "clean text, chunks of 64 (poison's reference)":
            (lambda: nanogpt(prepared([str(docs())], work / "data" / "shakespeare-docs-64", 64), "data.chunk_rows=64",
                             *steps), False),
        # Guard off, a too-high LR is the divergence the case is about: the full panel measures it
        # (RESULTS.md), the reduced one only what the guard did.
        "too-high LR": (lambda: shakespeare(f"optim.lr={args.high_lr}", f"schedule.min_lr={args.high_lr / 10}"),
                        not quick),
        "NaN once": (lambda: shakespeare(f"train.inject_nonfinite=[{150 if quick else 1000}]"), False),
    }


def judge(results: dict[str, dict[bool, Outcome]]) -> list[list[object]]:
    rows = []
    own = results["clean, shuffled: nanoGPT"][True].val_loss
    for name, by_guard in results.items():
        on, off = by_guard[True], by_guard.get(False)
        goal, met = "", None
        if name.startswith("clean") and off is None:
            goal = "the reference"
        elif name.startswith("clean"):
            goal = "0 skipped, no stop, val ≤ guard off (+1%)"
            met = on.skipped_samples == 0 and not on.stopped and off is not None and off.val_loss is not None \
                and on.val_loss is not None and on.val_loss <= off.val_loss * 1.01
        elif name == "poisoned window":
            ref = results["clean text, chunks of 64 (poison's reference)"][True].val_loss
            goal = f"guard acts, val within 3% of clean ({ref:.4f})"
            acted = any(on.actions[k] for k in ("batch_skipped", "lr_cut", "rollback"))
            met = acted and on.val_loss is not None and on.val_loss <= ref * 1.03
        elif name == "too-high LR":
            goal = f"rollback + LR cut, val within 5% of own LR ({own:.4f})"
            met = bool(on.actions["rollback"] or on.actions["lr_cut"]) and on.val_loss is not None \
                and on.val_loss <= own * 1.05
        elif name == "NaN once":
            goal = "finishes, nothing skipped"
            met = on.stopped is None and on.skipped_samples == 0
        rows.append([name, _show(on), _show(off) if off else "", goal, "met" if met else "NOT met" if met is False
                     else ""])
    return rows


def measure_cost(args: argparse.Namespace, rounds: int, steps: int) -> list[object]:
    """The guard's cost on the clean nanoGPT run: runs of `steps` steps with the guard on and off
    in alternating order (on-off, off-on, ...), so that a drift of the machine's speed cancels;
    each run's mean step time after its first 10% (the guard's checks land in the steps that take
    them); the median over rounds of on ÷ off. That ratio carries the machine's drift between two
    runs (on this 2-core machine, rounds have scattered by ±20%); the verdict is the guard's own
    work timed inside each guarded run (metrics' guard_s: its canary losses and snapshots) as a
    share of the run's step time, which a drift moves in both alike."""
    data = shakespeare_bytes(args.input, args.workdir)
    ratios, shares, times = [], [], {True: [], False: []}
    for i in range(rounds):
        for guard in (True, False) if i % 2 == 0 else (False, True):
            cfg = nanogpt(data, f"train.steps={steps}", "train.eval_every=0")
            outcome = run_case("cost", cfg, args.workdir / "runs" / f"cost-{'guard' if guard else 'off'}", guard)
            times[guard].append(outcome.mean_step_s)
            if guard:
                shares.append(outcome.guard_share)
        ratios.append(times[True][-1] / times[False][-1])
    cost, share = statistics.median(ratios) - 1, statistics.median(shares)
    print(f"cost rounds: on/off {[round(r, 4) for r in ratios]}, the guard's share of step time "
          f"{[round(s, 4) for s in shares]} (load {load_average()})", flush=True)
    return [f"cost: clean nanoGPT, the guard's own work in its step time ({rounds} rounds of {steps} steps; "
            "mean step times, alternating)",
            f"{100 * share:.2f}% ({1000 * statistics.median(times[True]):.1f} ms)",
            f"{1000 * statistics.median(times[False]):.1f} ms ({100 * cost:+.1f}%)",
            "≤ +2%", "met" if share <= 0.02 else "NOT met"]


def _show(o: Outcome) -> str:
    acted = ", ".join(f"{k} {v}" for k, v in o.actions.items() if v)
    val = f"{o.val_loss:.4f}" if o.val_loss is not None else "none"
    stop = f"; STOPPED {o.stopped}" if o.stopped else ""
    cap = f"; LR cap {o.lr_cap:.3g}" if o.lr_cap else ""
    scale = f"; LR scale {o.lr_scale:.3g}" if o.lr_scale != 1.0 else ""
    return f"val {val}; skipped {o.skipped_samples}; {acted or 'no action'}{cap}{scale}{stop}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, default=REPO.parent / "shared" / "data" / "tinyshakespeare.txt")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "guard-panel")
    parser.add_argument("--high-lr", type=float, default=0.1, help="an LR at which the nanoGPT config diverges")
    parser.add_argument("--quick", action="store_true", help="every case, on less data and fewer steps")
    parser.add_argument("--cases", default="all",
                        help="';'-separated case names (prefixes), all, or none (the cost alone)")
    parser.add_argument("--cost-rounds", type=int, default=3, help="rounds of the cost measurement (0: none)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="cases trained at a time, each in its own process (the cost rounds: one at a time)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    start_ray()
    print(f"start: load {load_average()}", flush=True)
    runs = []  # every case's data is prepared here first, on this process's Ray
    for name, (config, both) in cases(args).items():
        if args.cases != "all" and not any(name.startswith(c.strip()) for c in args.cases.split(";")):
            continue
        cfg = config()
        for guard in (True, False) if both else (True,):
            slug = "".join(ch if ch.isalnum() else "-" for ch in name).strip("-") + ("-guard" if guard else "-off")
            runs.append((name, cfg, args.workdir / "runs" / slug, guard))
    results: dict[str, dict[bool, Outcome]] = {}
    # Each run is one process's work on one core (OMP_NUM_THREADS=1 in the slow suite): --jobs 2
    # halves the wall time there, at the price of the cases' own step times.
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for outcome in pool.map(run_case, *zip(*runs)):
            results.setdefault(outcome.case, {})[outcome.guard] = outcome
            print(f"{outcome.case} (guard {'on' if outcome.guard else 'off'}): {_show(outcome)} in "
                  f"{outcome.wall_s:.0f} s (load {load_average()})", flush=True)
    rows = judge(results) if args.cases == "all" else []
    if args.cost_rounds:
        rows.append(measure_cost(args, args.cost_rounds, 100 if args.quick else 500))
    if rows:
        print_table(["case", "guard on", "guard off", "goal", "verdict"], rows)
    if args.json_out:
        args.json_out.write_text(json.dumps({n: {str(g): vars(o) for g, o in r.items()} for n, r in results.items()},
                                            indent=1))
    print(f"\ncommand: {' '.join([sys.executable, *sys.argv])}")


if __name__ == "__main__":
    main()
