"""Peak memory and step time of each activation checkpointing mode on CPU, as ratios against none.

    .venv/bin/python benchmarks/activation_checkpointing.py [--steps 6] [--rounds 2] [--threads 1]

A model whose activations dominate its memory (d_model 256, 6 layers, 4 heads, SwiGLU, RoPE,
vocabulary 256, fp32; sequence 256, micro-batch 8: 2048 tokens per optimizer step, one
micro-batch) trains in one process per mode and round, built as a run builds it
(`build_model`); every_k checkpoints every other block (`parallel.ac_every` 2). Rounds alternate
the order of the modes (ABCD, DCBA, ...) so a drift of the machine's load spreads over all of them.

Peak memory is the growth of the process's peak resident memory (Linux VmHWM, reset just before
the timed steps) over its resident memory between steps: gradients (freed at every step),
activations and transients. torch keeps no allocator statistics for CPU tensors, so the process's
own pages are the measure; glibc is told to hand every block above 128 KiB straight back to the
system (MALLOC_MMAP_THRESHOLD_), so the resident memory follows what is alive. Step time is the
median over the timed steps of all rounds, after two warm-up steps per process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from _common import load_average, print_table

MODES = ("none", "selective", "every_k", "full")
WARMUP_STEPS = 2
SEQ_LEN, MICRO_BATCH, VOCAB = 256, 8, 256


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) / 1024


def measure(mode: str, steps: int, threads: int) -> dict:
    """In this process: build the model under `mode`, warm up, then time `steps` optimizer steps."""
    import torch

    from raylm.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from raylm.model.transformer import Transformer
    from raylm.parallel.layout import resolve_layout
    from raylm.parallel.world import World
    from raylm.train.optim import build_optimizer
    from raylm.train.step import build_model

    torch.set_num_threads(threads)
    cfg = Config(model=ModelConfig(d_model=256, n_layers=6, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ_LEN),
                 train=TrainConfig(micro_batch_size=MICRO_BATCH, seq_len=SEQ_LEN),
                 parallel=ParallelConfig(activation_checkpointing=mode))
    world = World.current()
    model = build_model(lambda: Transformer(cfg.model), cfg, world,
                        resolve_layout(cfg.parallel, cfg.model, world.world_size, cfg.train.seq_len))
    optimizer = build_optimizer(model.parts, cfg.optim)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model.forward_backward(tokens, MICRO_BATCH)
        model.clip_grad_norm(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP_STEPS):  # AdamW's state exists from here on
        step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident memory
    before = _status_mib("VmRSS")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"mode": mode, "peak_mib": _status_mib("VmHWM") - before, "step_s": times}


def run_round(modes: list[str], args: argparse.Namespace) -> list[dict]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "OMP_NUM_THREADS": str(args.threads)}
    results = []
    for mode in modes:
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--steps", str(args.steps),
                              "--threads", str(args.threads)], env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child process: one mode
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.threads)))
        return
    print(f"load average before: {load_average()}")
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i in range(args.rounds):
        for result in run_round(list(MODES if i % 2 == 0 else reversed(MODES)), args):
            runs[result["mode"]].append(result)
    print(f"load average after: {load_average()}")
    peak = {mode: statistics.median(r["peak_mib"] for r in rs) for mode, rs in runs.items()}
    step = {mode: statistics.median(t for r in rs for t in r["step_s"]) for mode, rs in runs.items()}
    print_table(["mode", "peak growth MiB", "peak / none", "median step s", "step / none"],
                [[mode, f"{peak[mode]:.0f}", f"{peak[mode] / peak['none']:.2f}", f"{step[mode]:.3f}",
                  f"{step[mode] / step['none']:.2f}"] for mode in MODES])


if __name__ == "__main__":
    main()
