"""What the stability guard costs when nothing goes wrong, and how fast it gets past bad data.

    .venv/bin/python benchmarks/guard_overhead.py [--steps 200] [--rounds 3]

1. Overhead: the nanoGPT Shakespeare config (configs/nanogpt-shakespeare-char-cpu.yaml) trained
   in this process (the loop with plain files, the local loader: no Ray in the timed steps) with
   the guard on and off, alternating, `--rounds` times each; the median step time of each run
   after its first 20 steps. Goal: the guard costs <= 1%.
2. Recovery: the same data with the global batches of 5 consecutive steps replaced by random
   bytes; the wall time from the start of the first poisoned step to the end of the first step
   trained on clean data past the window (skips and rollbacks included).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from _common import load_average, print_table
from raylm.config import load_config
from raylm.data.manifest import MANIFEST_FILE
from raylm.data.prepare import prepare_dataset
from raylm.ray_runtime import start_ray
from raylm.train.local_env import LocalEnv
from raylm.train.loop import train
from raylm.train.metrics import read_jsonl
from tests.support.poison import poisoned_copy

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "nanogpt-shakespeare-char-cpu.yaml"
WARMUP_STEPS = 20
POISON_AT, POISON_STEPS = 120, 5


def config(data: str, steps: int, *extra: str):
    return load_config(CONFIG, [f"data.path={data}", "data.loader=local", f"train.steps={steps}",
                                "train.eval_every=0", "train.tensorboard=false", "checkpoint.every_steps=0",
                                "guard.norms_every=0", *extra])


def median_step(run_dir: str) -> float:
    rows = read_jsonl(f"{run_dir}/metrics.jsonl")
    return statistics.median(r["step_time"] for r in rows[WARMUP_STEPS:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", type=Path, default=REPO.parent / "shared" / "data" / "tinyshakespeare.txt")
    ap.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench-guard")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    data = str(args.workdir / "data" / "shakespeare-byte-64")
    if not (Path(data) / MANIFEST_FILE).exists():
        start_ray()
        prepare_dataset([str(args.input)], data, tokenizer="byte", seq_len=64, val_fraction=0.1)
    print(f"load {load_average()}")

    times: dict[str, list[float]] = {"guard on": [], "guard off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, enabled in (("guard on", "true"), ("guard off", "false")):
                run = f"{tmp}/{name.replace(' ', '-')}-{r}"
                train(config(data, args.steps, f"guard.enabled={enabled}"), LocalEnv(run))
                times[name].append(median_step(run))
                print(f"round {r}: {name} median step {1e3 * times[name][-1]:.2f} ms", flush=True)
        on, off = statistics.median(times["guard on"]), statistics.median(times["guard off"])

        cfg = config(data, POISON_AT + 40)
        batch = cfg.train.global_batch_size
        poisoned = poisoned_copy(data, f"{tmp}/poisoned", cfg.data, batch, range(POISON_AT, POISON_AT + POISON_STEPS))
        run = f"{tmp}/recovery"
        train(config(poisoned, POISON_AT + 40), LocalEnv(run))
        rows = read_jsonl(f"{run}/metrics.jsonl")
        events = read_jsonl(f"{run}/events.jsonl")
        before = max(r["time"] for r in rows if r["step"] == POISON_AT)  # end of the last clean step
        window_end = (POISON_AT + POISON_STEPS) * batch
        past = min(r["time"] for r in rows if r["time"] > before and r["position"] > window_end
                   and r["step"] > POISON_AT)
        kinds = [e["event"] for e in events]
    print_table(["measure", "value"], [
        ["median step, guard off", f"{1e3 * off:.2f} ms"],
        ["median step, guard on", f"{1e3 * on:.2f} ms"],
        ["guard cost per step", f"{100 * (on / off - 1):+.2f}% (goal <= 1%)"],
        ["poisoned window", f"{POISON_STEPS} steps × {batch} sequences at step {POISON_AT}"],
        ["guard actions", ", ".join(f"{k} ×{kinds.count(k)}" for k in dict.fromkeys(kinds)) or "none"],
        ["first poisoned step to clean training past it", f"{past - before:.2f} s"],
    ])
    shutil.rmtree(args.workdir / "runs", ignore_errors=True)


if __name__ == "__main__":
    main()
