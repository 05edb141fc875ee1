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

import json
import re
import statistics

from _common import (MICRO_BATCH, SEQ_LEN, VOCAB, WARMUP_STEPS, load_average, mode_config, mode_parser, mode_rounds,
                     mode_step, print_table, timed_steps)

MODES = ("none", "selective", "every_k", "full")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) / 1024


def measure(mode: str, steps: int, threads: int) -> dict:
    """In this process: build the model under `mode`, warm up, then time `steps` optimizer steps."""
    import torch

    torch.set_num_threads(threads)
    cfg = mode_config()
    cfg.parallel.activation_checkpointing = mode
    step = mode_step(cfg)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(WARMUP_STEPS):  # AdamW's state exists from here on
        step(tokens)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident memory
    before = _status_mib("VmRSS")
    times = timed_steps(lambda: step(tokens), steps)
    return {"mode": mode, "peak_mib": _status_mib("VmHWM") - before, "step_s": times}


def main() -> None:
    args = mode_parser(__doc__, MODES).parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.threads)))
        return
    print(f"load average before: {load_average()}")
    runs = mode_rounds(__file__, MODES, args, env={"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    print(f"load average after: {load_average()}")
    peak = {mode: statistics.median(r["peak_mib"] for r in rs) for mode, rs in runs.items()}
    step = {mode: statistics.median(t for r in rs for t in r["step_s"]) for mode, rs in runs.items()}
    print_table(["mode", "peak growth MiB", "peak / none", "median step s", "step / none"],
                [[mode, f"{peak[mode]:.0f}", f"{peak[mode] / peak['none']:.2f}", f"{step[mode]:.3f}",
                  f"{step[mode] / step['none']:.2f}"] for mode in MODES])


if __name__ == "__main__":
    main()
