"""Helpers shared by the benchmark scripts: machine load, throughput statistics, a table, the
per-mode step benchmarks' model and rounds."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    import torch

    from raylm.config import Config

# The development tooling (cluster/: local Ray cluster, S3 server) is imported from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_average() -> str:
    """The 1/5/15-minute load averages: other engineers' jobs share this machine's cores, so
    every figure is only comparable next to the load it was measured under."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


@dataclass
class Throughput:
    steps: int  # steps in the steady window
    median_tokens_per_s: float  # median of per-step rates: robust to the odd stalled step
    mean_tokens_per_s: float  # window tokens / window time: every stall counts
    seconds: float  # time the window's steps took
    # At the 10th-percentile step time. A shared VM can switch between a fast and a slow state
    # within one run (41 ms and 57 ms steps seen here on 2026-11-23): each side's fast steps
    # compare like with like where its median depends on how long it spent in which state.
    fast_tokens_per_s: float


def steady_throughput(step_times: Sequence[float], tokens_per_step: int,
                      warmup_fraction: float = 0.1) -> Throughput:
    """Throughput over the steps after the first `warmup_fraction` (allocator and thread-pool
    warm-up, first data reads)."""
    window = list(step_times)[int(len(step_times) * warmup_fraction):]
    if not window:
        raise ValueError(f"no steps left after skipping the first {warmup_fraction:.0%} of {len(step_times)}")
    seconds = sum(window)
    return Throughput(len(window), tokens_per_step / statistics.median(window),
                      tokens_per_step * len(window) / seconds, seconds,
                      tokens_per_step / statistics.quantiles(window, n=10)[0] if len(window) > 1 else
                      tokens_per_step / window[0])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain-text table with left-aligned columns (also valid Markdown)."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print(line(row))


def python_sources(out: Path, documents: Optional[int] = None) -> Path:
    """The first `documents` files of the built-in corpus (the standard library's), copied as
    .txt files: an input to prepare beside others."""
    from raylm.data.corpus import builtin_sources

    out.mkdir(parents=True, exist_ok=True)
    for i, source in enumerate(builtin_sources(documents)):
        shutil.copy(source.uri, out / f"py-{i:05d}.txt")
    return out


def shakespeare_bytes(text: Path, workdir: Path) -> str:
    """The Shakespeare corpus prepared with byte tokens and seq_len 64 under `workdir` (kept
    between runs, shared by the benchmarks that train on it); returns its path."""
    from raylm.data.manifest import MANIFEST_FILE
    from raylm.data.prepare import prepare_dataset
    from raylm.ray_runtime import start_ray

    data = str(workdir / "data" / "shakespeare-byte-64")
    if not (Path(data) / MANIFEST_FILE).exists():
        start_ray()
        prepare_dataset([str(text)], data, tokenizer="byte", seq_len=64, val_fraction=0.1)
    return data


# ----------------------------------------------------------------------------- one process per mode

# The model of the per-mode step benchmarks (activation checkpointing, document attention): its
# activations dominate its memory (d_model 256, 6 layers, 4 heads, SwiGLU, RoPE, vocabulary 256,
# fp32; sequence 256, micro-batch 8: 2048 tokens per optimizer step, one micro-batch).
SEQ_LEN, MICRO_BATCH, VOCAB = 256, 8, 256
WARMUP_STEPS = 2


def mode_parser(doc: str, modes: Sequence[str]) -> argparse.ArgumentParser:
    """The arguments every per-mode benchmark takes; `--one MODE` runs one mode in a child process."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    parser.add_argument("--one", choices=modes, help=argparse.SUPPRESS)
    return parser


def mode_step(modes_cfg: "Config", eot_id: Optional[int] = None) -> Callable[["torch.Tensor"], None]:
    """One optimizer step of the benchmark model (`modes_cfg` sets what the modes differ in),
    built as a run builds it (`build_model`), in this process."""
    import torch

    from raylm.model.transformer import Transformer
    from raylm.parallel.layout import resolve_layout
    from raylm.parallel.world import World
    from raylm.train.optim import build_optimizer
    from raylm.train.step import build_model

    world = World.current()
    model = build_model(lambda: Transformer(modes_cfg.model), modes_cfg, world,
                        resolve_layout(modes_cfg.parallel, modes_cfg.model, world.world_size, modes_cfg.train.seq_len),
                        eot_id=eot_id)
    optimizer = build_optimizer(model.parts, modes_cfg.optim)

    def step(tokens: torch.Tensor) -> None:
        model.forward_backward(tokens, MICRO_BATCH)
        model.clip_grad_norm(modes_cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def mode_config(**model: object) -> "Config":
    """The benchmark model's config, with `model` fields on top."""
    from raylm.config import Config, ModelConfig, TrainConfig

    return Config(model=ModelConfig(d_model=256, n_layers=6, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ_LEN,
                                    **model),
                  train=TrainConfig(micro_batch_size=MICRO_BATCH, seq_len=SEQ_LEN))


def timed_steps(step: Callable[[], None], steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `step`."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def mode_rounds(script: str, modes: Sequence[str], args: argparse.Namespace, extra: Sequence[str] = (),
                env: Optional[dict] = None) -> dict[str, list[dict]]:
    """Each mode in a process of its own (`script --one MODE`, printing its result as JSON), for
    `args.rounds` rounds whose order alternates (ABC, CBA, ...) so that a drift of the machine's
    load spreads over every mode: mode -> its results, one a round."""
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": str(args.threads)}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for i in range(args.rounds):
        for mode in (modes if i % 2 == 0 else list(reversed(modes))):
            out = subprocess.run([sys.executable, script, "--one", mode, "--steps", str(args.steps),
                                  "--threads", str(args.threads), *extra],
                                 env=env, capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs
