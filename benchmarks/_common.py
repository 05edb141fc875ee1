"""Helpers shared by the benchmark scripts: machine load, throughput statistics, a table."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

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
