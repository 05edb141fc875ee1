"""raylm against nanoGPT on nanoGPT's own CPU run: character-level Shakespeare, as a user runs both.

    .venv/bin/python benchmarks/nanogpt_shakespeare.py [--iters 2000] [--rounds 2]

O: nanoGPT itself (`--nanogpt DIR`, a clone of github.com/karpathy/nanoGPT outside this repository):
   its README's CPU command, `python train.py config/train_shakespeare_char.py --device=cpu
   --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4
   --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`, on the data its
   data/shakespeare_char/prepare.py writes from the same text, with torch's default threads.
A: the reference, benchmarks/_nanogpt_reference.py: nanoGPT's model.py and train.py rewritten
   independently (LayerNorm, learned positions, GELU MLP, SDPA causal attention, tied embeddings,
   AdamW, clipping, nanoGPT's evaluation and checkpoints), on nanoGPT's character-level data, in
   its own process with 2 threads (OMP_NUM_THREADS=2; nanoGPT takes torch's default, the cores).
B: `raylm train configs/nanogpt-shakespeare-char-cpu.yaml` in its own process, starting its own
   Ray, on the same text prepared with `raylm prepare --tokenizer byte --seq-len 64`; the shipped
   config runs one worker with cpus_per_worker auto: 2 threads on this machine's 2 cores.

Runs alternate (O) A B (O) A B (`--rounds`), so that a change in the shared VM's load lands on both sides.
Each run is timed from the command's start to its exit. Reported: the median steady step (after
the first 10% of steps) and its ratio, the whole-run wall time and its ratio, each side's time
from the command to its first step done and from its last step to exit, the final val loss of
each (its own evaluation, and the whole val split scored from its final weights), and the load.
Then the demo (configs/demo-cpu.yaml) on 1 and on 2 workers (`--demo-steps`, 0 skips it): what
data parallelism costs on this CPU. `--iters 300 --rounds 1 --demo-steps 0` tries a round in
a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from _common import load_average, print_table
import _nanogpt_reference as reference
from raylm.config import load_config
from raylm.model.transformer import Transformer
from raylm.train.checkpoint import format as checkpoint
from raylm.train.observe.records import read_jsonl
from raylm.train.spec import resolve_run, run_uri

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "nanogpt-shakespeare-char-cpu.yaml"
DEMO_CONFIG = REPO / "configs" / "demo-cpu.yaml"
RAYLM = str(REPO / ".venv" / "bin" / "raylm")
THREADS = 2
SEQ_LEN = 64
NANOGPT_README_VAL_LOSS = 1.88
GOALS = {"step": 0.95, "wall": 1.2, "val_loss": 1.90, "first_step_s": 10.0, "exit_s": 5.0}
# Lines of raylm's console whose first appearance marks a start-up phase.
PHASES = {"config resolved": "raylm: parallel.cpus_per_worker", "model built (worker)": "[raylm.parallel] layout",
          "training starts": " parameters, "}


@dataclass
class Run:
    who: str  # "nanoGPT", "reference" or "raylm"
    wall_s: float  # command start to exit
    step_times: list[float]
    first_step_s: float  # command start to the end of the first step
    exit_s: float  # end of the last step to exit
    val_loss: float  # the run's own last evaluation
    whole_val_loss: float
    load: str  # at the end of the run
    phases: dict[str, float] = field(default_factory=dict)  # raylm: seconds from the command

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_times[len(self.step_times) // 10:])


class TimedProcess:
    """A command whose output lines are kept with their times (seconds since its start)."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str], cwd: Path = REPO):
        self.lines: list[tuple[float, str]] = []
        self.start_wall = time.time()
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.log = log

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.start, line.rstrip("\n")))

    def wait(self) -> tuple[float, float]:
        """(wall seconds, wall-clock time at exit); raises if the command failed."""
        rc = self.proc.wait()
        end, end_wall = time.perf_counter(), time.time()
        self.reader.join()
        self.log.write_text("".join(f"{t:8.2f} {line}\n" for t, line in self.lines))
        if rc != 0:
            tail = "\n".join(line for _, line in self.lines[-30:])
            raise RuntimeError(f"{self.proc.args[:3]} exited with {rc}; log {self.log}:\n{tail}")
        return end - self.start, end_wall

    def first(self, marker: str) -> Optional[float]:
        return next((t for t, line in self.lines if marker in line), None)


def child_env(threads: Optional[int]) -> dict[str, str]:
    """This environment, with OMP_NUM_THREADS set to `threads`, or unset (a user's shell)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def prepare_char_data(text_path: Path, out: Path) -> None:
    """nanoGPT's data/shakespeare_char/prepare.py: characters as ids, first 90% train."""
    if (out / "meta.json").exists():
        return
    text = text_path.read_text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(len(ids) * 0.9)
    out.mkdir(parents=True, exist_ok=True)
    ids[:n].tofile(out / "train.bin")
    ids[n:].tofile(out / "val.bin")
    (out / "meta.json").write_text(json.dumps({"vocab_size": len(chars), "itos": chars}))


def prepare_raylm_data(out: Path, *inputs: str, seq_len: int) -> None:
    if (out / "manifest.json").exists():
        return
    subprocess.run([RAYLM, "prepare", *(["--input", *inputs] if inputs else []), "--output", str(out),
                    "--tokenizer", "byte", "--seq-len", str(seq_len)], cwd=REPO, check=True,
                   env=child_env(None))


@torch.no_grad()
def reference_whole_val(data: Path, weights: Path) -> float:
    """Mean loss per target over the val split in windows of 64 inputs, as raylm's rows."""
    meta = json.loads((data / "meta.json").read_text())
    model = reference.GPT(meta["vocab_size"])
    model.load_state_dict(torch.load(weights))
    model.eval()
    val = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64))
    rows = val[:len(val) // (SEQ_LEN + 1) * (SEQ_LEN + 1)].view(-1, SEQ_LEN + 1)
    total = sum(float(model(r[:, :-1].contiguous(), r[:, 1:].contiguous())[1]) * r[:, 1:].numel()
                for r in rows.split(64))
    return total / rows[:, 1:].numel()


@torch.no_grad()
def raylm_whole_val(cfg) -> float:
    """Mean loss per target over every row of the val split, from the run's last checkpoint."""
    spec = resolve_run(cfg)
    model = Transformer(spec.config.model)
    checkpoint.load_model_weights(checkpoint.latest_complete(run_uri(cfg), cfg.storage), model)
    model.eval()
    source = spec.datasets.open_split("val", cfg.data, cfg.storage, shuffle=False)
    n = source.order.datasets[0].num_samples
    total, count = 0.0, 0
    for start in range(0, n, 64):
        rows = torch.from_numpy(source.rows(list(range(start, min(n, start + 64)))).astype(np.int64))
        total += float(F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten(), reduction="sum"))
        count += rows[:, 1:].numel()
    return total / count


NANOGPT_CPU_FLAGS = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
                     "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0"]
NANOGPT_ITER = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms")
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def prepare_original_data(nanogpt: Path, text: Path) -> None:
    """nanoGPT's own prepare.py, given the text it would download."""
    data = nanogpt / "data" / "shakespeare_char"
    if (data / "meta.pkl").exists():
        return
    (data / "input.txt").write_bytes(text.read_bytes())
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, env=child_env(None))


def run_original(args: argparse.Namespace, k: int) -> Run:
    """nanoGPT's train.py as its README runs it on a CPU; times from its own per-iteration lines."""
    out = args.workdir / f"nanogpt-original-{args.stamp}-{k}"
    out.mkdir(parents=True)
    print(f"== round {k + 1}: nanoGPT train.py, {args.iters} iterations (load {load_average()})", flush=True)
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", *NANOGPT_CPU_FLAGS,
           f"--max_iters={args.iters}", f"--lr_decay_iters={args.iters}", f"--out_dir={out}"]
    proc = TimedProcess(cmd, out / "console.log", child_env(None), cwd=args.nanogpt)
    wall, end_wall = proc.wait()
    iters = [(t, m) for t, line in proc.lines if (m := NANOGPT_ITER.match(line))]
    evals = [float(m.group(3)) for _, line in proc.lines if (m := NANOGPT_EVAL.match(line))]
    # Its iteration 0's time spans the first evaluation; later evaluations land in their iteration too.
    steps = [float(m.group(3)) / 1000 for _, m in iters[1:]]
    first, last = iters[0][0], iters[-1][0]
    return Run("nanoGPT", wall, steps, first, wall - last, evals[-1], float("nan"), load_average())


def run_reference(args: argparse.Namespace, k: int) -> Run:
    out = args.workdir / f"reference-{args.stamp}-{k}" / "result.json"
    out.parent.mkdir(parents=True)
    print(f"== round {k + 1}: reference, {args.iters} iterations (load {load_average()})", flush=True)
    proc = TimedProcess([sys.executable, str(REPO / "benchmarks" / "_nanogpt_reference.py"), "--data",
                         str(args.char_data), "--out", str(out), "--iters", str(args.iters)],
                        out.parent / "console.log", child_env(THREADS))
    wall, end_wall = proc.wait()
    r = json.loads(out.read_text())
    assert r["threads"] == THREADS, r["threads"]
    return Run("reference", wall, r["step_times"], r["first_step_end"] - proc.start_wall, end_wall - r["last_step_end"],
               r["evals"][-1]["val"], reference_whole_val(args.char_data, out.parent / "final.pt"), load_average())


def run_raylm(args: argparse.Namespace, k: int) -> Run:
    name = f"nanogpt-{args.stamp}-{k}"
    overrides = [f"data.path={args.byte_data}", f"run.storage_path={args.workdir}", f"run.name={name}",
                 *([f"train.steps={args.iters}"] if args.iters != 2000 else [])]
    print(f"== round {k + 1}: raylm train, {args.iters} steps (load {load_average()})", flush=True)
    run_dir = args.workdir / name
    run_dir.mkdir(parents=True)
    proc = TimedProcess([RAYLM, "train", str(CONFIG), *overrides], run_dir / "console.log", child_env(None))
    wall, end_wall = proc.wait()
    rows = read_jsonl(str(run_dir / "metrics.jsonl"))
    phases = {name: t for name, marker in PHASES.items() if (t := proc.first(marker)) is not None}
    phases["first step done"] = rows[0]["time"] - proc.start_wall
    return Run("raylm", wall, [r["step_time"] for r in rows], rows[0]["time"] - proc.start_wall,
               end_wall - rows[-1]["time"], [r["val_loss"] for r in rows if "val_loss" in r][-1],
               raylm_whole_val(load_config(CONFIG, overrides)), load_average(), phases)


def run_demo(args: argparse.Namespace, workers: int, k: int) -> tuple[float, str]:
    """Median steady tokens/s of the demo on `workers` workers (cpus_per_worker auto)."""
    name = f"demo-{args.stamp}-{workers}w-{k}"
    print(f"== demo: {workers} worker(s), {args.demo_steps} steps (load {load_average()})", flush=True)
    (args.workdir / name).mkdir(parents=True)
    proc = TimedProcess([RAYLM, "train", str(DEMO_CONFIG), f"data.path={args.demo_data}",
                         f"run.storage_path={args.workdir}", f"run.name={name}", f"parallel.num_workers={workers}",
                         f"train.stop_at_step={args.demo_steps}", "train.eval_every=0", "checkpoint.every_steps=0"],
                        args.workdir / name / "console.log", child_env(None))
    proc.wait()
    rows = read_jsonl(str(args.workdir / name / "metrics.jsonl"))
    return statistics.median(r["tokens_per_s"] for r in rows[len(rows) // 10:]), load_average()


def summarize(args: argparse.Namespace, runs: list[Run], demo: dict[int, list[tuple[float, str]]]) -> None:
    ref = [r for r in runs if r.who == "reference"]
    ours = [r for r in runs if r.who == "raylm"]
    med = lambda rs, key: statistics.median(getattr(r, key) for r in rs)  # noqa: E731
    rows: list[list[object]] = []
    for r in runs:
        phases = ", ".join(f"{p} {t:.1f} s" for p, t in r.phases.items())
        rows.append([f"{r.who} run", f"step {1000 * r.median_step:.1f} ms, wall {r.wall_s:.1f} s, first step "
                     f"{r.first_step_s:.1f} s, exit {r.exit_s:.1f} s, val {r.val_loss:.4f} (whole split "
                     f"{r.whole_val_loss:.4f}), load {r.load}" + (f"; {phases}" if phases else "")])
    step_ratio = med(ref, "median_step") / med(ours, "median_step")
    wall_ratio = med(ours, "wall_s") / med(ref, "wall_s")
    pairs = [f"{a.median_step / b.median_step:.3f}" for a, b in zip(ref, ours)]
    walls = [f"{b.wall_s / a.wall_s:.2f}" for a, b in zip(ref, ours)]
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    rows += [
        ["median steady step, reference / raylm", f"{1000 * med(ref, 'median_step'):.1f} / "
         f"{1000 * med(ours, 'median_step'):.1f} ms"],
        ["steady tokens/s raylm ÷ reference", f"{step_ratio:.3f} (rounds {', '.join(pairs)}); goal >= "
         f"{GOALS['step']}: {met(step_ratio >= GOALS['step'])}"],
        ["whole run, reference / raylm", f"{med(ref, 'wall_s'):.1f} / {med(ours, 'wall_s'):.1f} s"],
        ["whole run raylm ÷ reference", f"{wall_ratio:.2f} (rounds {', '.join(walls)}); goal <= {GOALS['wall']}: "
         f"{met(wall_ratio <= GOALS['wall'])}"],
        ["command → first step done, reference / raylm", f"{med(ref, 'first_step_s'):.1f} / "
         f"{med(ours, 'first_step_s'):.1f} s; goal <= {GOALS['first_step_s']:g} s: "
         f"{met(med(ours, 'first_step_s') <= GOALS['first_step_s'])}"],
        ["last step → exit, reference / raylm", f"{med(ref, 'exit_s'):.1f} / {med(ours, 'exit_s'):.1f} s; goal "
         f"<= {GOALS['exit_s']:g} s: {met(med(ours, 'exit_s') <= GOALS['exit_s'])}"],
        ["final val loss (own eval), reference / raylm", f"{med(ref, 'val_loss'):.4f} / {med(ours, 'val_loss'):.4f}"
         + (f"; goal <= {GOALS['val_loss']}: {met(med(ours, 'val_loss') <= GOALS['val_loss'])} (nanoGPT's "
            f"README {NANOGPT_README_VAL_LOSS})" if args.iters == 2000 else "")],
        ["val loss, whole val split, reference / raylm", f"{med(ref, 'whole_val_loss'):.4f} / "
         f"{med(ours, 'whole_val_loss'):.4f}"],
    ]
    if original := [r for r in runs if r.who == "nanoGPT"]:
        rows += [
            ["median steady step, nanoGPT train.py / raylm", f"{1000 * med(original, 'median_step'):.1f} / "
             f"{1000 * med(ours, 'median_step'):.1f} ms"],
            ["steady tokens/s raylm ÷ nanoGPT train.py", f"{med(original, 'median_step') / med(ours, 'median_step'):.3f} "
             f"(rounds {', '.join(f'{a.median_step / b.median_step:.3f}' for a, b in zip(original, ours))})"],
            ["whole run raylm ÷ nanoGPT train.py", f"{med(ours, 'wall_s') / med(original, 'wall_s'):.2f} "
             f"(rounds {', '.join(f'{b.wall_s / a.wall_s:.2f}' for a, b in zip(original, ours))})"],
            ["final val loss, nanoGPT train.py (its own eval)", f"{med(original, 'val_loss'):.4f}"],
        ]
    for workers, results in demo.items():
        rows.append([f"demo, {workers} worker(s), tokens/s", ", ".join(f"{t:,.0f} (load {load})" for t, load in results)])
    if len(demo) == 2:
        one, two = (statistics.median(t for t, _ in demo[w]) for w in (1, 2))
        rows.append(["demo tokens/s, 2 workers ÷ 1 worker", f"{two / one:.2f}"])
    print("\n== summary")
    print_table(["figure", "value"], rows)
    print(f"\ncommand: {' '.join([sys.executable, *sys.argv])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, default=Path("../shared/data/tinyshakespeare.txt"),
                        help="tinyshakespeare text (relative paths: from the repo root)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench"),
                        help="prepared data and run directories (relative paths: from the repo root)")
    parser.add_argument("--iters", type=int, default=2000, help="training steps of each run (nanoGPT's max_iters)")
    parser.add_argument("--rounds", type=int, default=2, help="reference and raylm runs, alternating")
    parser.add_argument("--demo-steps", type=int, default=100, help="steps of each demo run; 0: no demo")
    parser.add_argument("--nanogpt", type=Path, help="a clone of karpathy/nanoGPT (outside this repository): "
                        "also run its own train.py each round")
    parser.add_argument("--demo-rounds", type=int, default=1, help="demo runs per worker count, alternating")
    args = parser.parse_args()
    args.input, args.workdir = (p if p.is_absolute() else REPO / p for p in (args.input, args.workdir))
    args.nanogpt = args.nanogpt.resolve() if args.nanogpt else None
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    args.char_data = args.workdir / "data" / "shakespeare_char"
    args.byte_data = args.workdir / "data" / f"shakespeare-byte-{SEQ_LEN}"
    args.demo_data = REPO / "runs" / "data" / "stdlib-byte-256"  # the README's demo dataset
    prepare_char_data(args.input, args.char_data)
    prepare_raylm_data(args.byte_data, str(args.input), seq_len=SEQ_LEN)
    print(f"start: load {load_average()}", flush=True)
    runs: list[Run] = []
    if args.nanogpt:
        prepare_original_data(args.nanogpt, args.input)
    for k in range(args.rounds):
        runs += [*([run_original(args, k)] if args.nanogpt else []), run_reference(args, k), run_raylm(args, k)]
    demo: dict[int, list[tuple[float, str]]] = {}
    if args.demo_steps:
        prepare_raylm_data(args.demo_data, seq_len=256)
        for k in range(args.demo_rounds):
            for workers in (1, 2):
                demo.setdefault(workers, []).append(run_demo(args, workers, k))
    summarize(args, runs, demo)


if __name__ == "__main__":
    main()
