"""One prepared check of raylm on one GPU: step MFU, the whole loop (its host syncs) and its resume,
memory against the planner, fp16 loss scaling, nanoGPT's own train.py as the baseline, and float8,
in one table, within a time budget. On the GPU machine (one H100 or H200; no Ray, no boto3, no
network needed; torchao's wheel for section 6), from the repo root:

    python3 benchmarks/gpu_check.py --json-out $OUT/gpu_check.json [--budget-s 480] [--nanogpt DIR]
    .venv/bin/python benchmarks/gpu_check.py --cpu-tiny --json-out /tmp/gpu_check.json   # same path, CPU, tiny

Two layouts, both with SDPA attention. The FSDP2 layout, sections 1-3's: FSDP2 on a one-rank
process group (`parallel.sharding=full`, asked for on one rank with `parallel.one_rank_fsdp=true`),
bf16 parameters, fp32 reductions (`parallel.param_dtype=bf16`, `reduce_dtype=fp32`), the layout of a
multi-GPU run. The one-GPU layout: no FSDP2, fp32 parameters and bf16 autocast, what raylm builds on
one GPU by default and what nanoGPT does; sections 1, 3, 5 and 6 measure it.

1. mfu: raylm's training step alone (`raylm.train.step.build_model`, `forward_backward`, clipping,
   AdamW) on the llama-1b shape (`model.size=llama-1b`, Llama 3's vocabulary of 128256, sequence
   2048, micro-batch 4) on random tokens, eager and with `train.compile=true` (per block in the
   FSDP2 layout, the whole model in the one-GPU layout). MFU = FLOPs per token x tokens/s / peak,
   FLOPs per token = 6N + 12·L·d·T (`raylm.model.sizes.flops_per_token`; N = the blocks' weight
   matrices and the head's d·vocab), peak = `raylm.train.observe.metrics.peak_flops`
   (`raylm.hardware.GPU_MODELS`: 989 TFLOP/s dense bf16 for an H100 SXM or an H200).
2. loop: `raylm.train.loop.train_local` (resolve, preflight and train in this process, no Ray) on
   the same shape and batch, eager, reading a prepared Parquet dataset this script writes (random
   byte tokens, `model.vocab_size=128256`), guard on, metrics and TensorBoard,
   `checkpoint.async_save`, the device read every READ_EVERY steps: its tokens/s against section
   1's eager step (goal: at most 3% slower), and the host syncs of each step (CUDA's sync debug
   mode; on a CPU, the calls that would sync): on the steps the loop does not read after, 0.
   resume: the same loop settings on the gpt2 shape: a run stopped by `train.stop_at_step` and
   resumed by the same command without it, against an uninterrupted run, metrics.jsonl row by row.
   Exact on CPU; on CUDA within 1e-5 relative (the JSON also gives the two fresh runs' own
   difference before the stop: the floor set by non-deterministic kernels). The gpt2 shape
   keeps its three checkpoints at 1.5 GB: llama-1b's are 15 GB each (fp32 weights and Adam).
3. memory: `torch.cuda.max_memory_allocated` of the step on the llama-1b shape against
   `raylm.parallel.planner.memory.estimate_memory` (what `raylm plan` prints), in the FSDP2 layout
   (precision "mixed") and in the layout a one-GPU run gets from a multi-GPU config (sharding=full,
   param_dtype=bf16, no one_rank_fsdp: no wrapper, bf16 autocast over fp32 weights), no activation
   checkpointing (goal: within 10%).
4. fp16: the loop on the gpt2 shape with `parallel.param_dtype=fp16`: dynamic loss scaling, the
   scale growing every 2 clean steps (`train.loss_scale_growth_interval=2`) and halving on an
   overflow; metrics.jsonl's `loss_scale` must move and every loss stay finite.
5. reference: the baseline in its own process, against raylm's loop (compiled, guard on) on the
   same shape (`model.size=gpt2`, vocabulary 50304, sequence 1024) and batch 12, in the one-GPU
   layout (goal: raylm at least as fast) and in the FSDP2 layout (FSDP2's per-unit hooks on a
   one-rank group: the price of the multi-GPU layout on a model this small). The baseline is
   nanoGPT's own train.py where `--nanogpt` gives a checkout of it (its per-iteration times, as it
   prints them), else benchmarks/_gpt2_reference.py (nanoGPT's loop rewritten: the CPU test's).
6. float8: `train.precision=float8` (torchao's float8 linears in the blocks) against bf16 on the
   llama-1b shape in the one-GPU layout, compiled, each 200 steps on the same text (the standard
   library's bytes) from the same seed: tokens/s (goal: 1.25x) and the loss at the end (within 1%).
   Refused on a CPU and before SM 8.9: the refusal is then the section's result.

Each section records its own failure and the next one runs. `--budget-s` cuts step counts in
proportion when the nominal costs no longer fit; compilation and checkpoint writes cannot shrink.
`--cpu-tiny` runs every section on CPU with tiny shapes and no compilation, for plumbing only.
`--sections` runs some of them (section 2's overhead needs section 1's eager step).
The exit status is 1 when a section failed. The JSON carries `host_syncs_per_step` (section 2's)
at its top level.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import itertools
import json
import math
import os
import platform
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from _common import print_table
from raylm.config import Config, ConfigError, load_config
from raylm.data.manifest import Manifest, ShardInfo, SplitInfo, TokenizerInfo, shard_bytes
from raylm.data.tokenizer import TOKENIZER_FILE, ByteTokenizer
from raylm.model.sizes import count_params, flops_per_token
from raylm.model.transformer import Transformer
from raylm.parallel.float8 import after_optimizer_step
from raylm.parallel.layout import resolve_layout
from raylm.parallel.planner.memory import estimate_memory
from raylm.parallel.world import World
from raylm.train.hooks import Hook
from raylm.train.loop import train_local
from raylm.train.observe.metrics import peak_flops
from raylm.train.observe.records import EVENTS_FILE, METRICS_FILE, read_jsonl
from raylm.train.observe.syncs import StepCosts
from raylm.train.optim import apply_lr, build_optimizer, lr_at
from raylm.train.step import build_model

HERE = Path(__file__).resolve().parent
GIB = 2 ** 30
FLOPS_FORMULA = "6N + 12*L*d*T per token (raylm.model.sizes.flops_per_token; N: blocks' matrices + head d*vocab)"
LAYOUT = ("parallel.num_workers=1", "parallel.sharding=full", "parallel.param_dtype=bf16", "parallel.reduce_dtype=fp32",
          "parallel.one_rank_fsdp=true")
ONE_GPU = ("parallel.sharding=none", "parallel.param_dtype=fp32", "train.precision=bf16", "parallel.one_rank_fsdp=false")
RESUME_RTOL_CUDA = 1e-5
READ_EVERY = 10  # train.read_every of the loop sections: log_every, the GPU default
# Section 3's layouts: the FSDP2 layout, and a multi-GPU config (sharding=full, param_dtype=bf16) on one GPU.
MEMORY_LAYOUTS = {"FSDP2": (), "one-GPU": ("parallel.one_rank_fsdp=false",)}
FLOAT8_SPEEDUP_GOAL = 1.25
FLOAT8_LOSS_GOAL = 0.01
LOSS_WINDOW = 10  # section 6's loss at the end: the mean of this many last steps
LOOP_OVERHEAD_GOAL = 0.03
MEMORY_GOAL = 0.10
START_SHARE = 0.5  # a section starts only with this share of its nominal cost left in the budget


@dataclass(frozen=True)
class Shape:
    """A model and its batch: `model.*` overrides, the vocabulary, sequence and micro-batch (one
    micro-batch per step)."""

    name: str
    model: tuple[str, ...]
    vocab: int
    seq_len: int
    micro_batch: int

    def overrides(self) -> list[str]:
        return [*self.model, f"model.vocab_size={self.vocab}", f"train.seq_len={self.seq_len}",
                f"train.micro_batch_size={self.micro_batch}", f"train.global_batch_size={self.micro_batch}"]


@dataclass(frozen=True)
class Profile:
    llama: Shape  # sections 1, 2 (loop) and 3
    gpt2: Shape  # sections 2 (resume), 4 and 5
    compile: bool  # torch.compile where a section asks for it
    warmup: int  # untimed steps of the bare step: compilation, allocator growth
    skip: int  # first steps of a loop run left out of its steady window (compilation, first reads)
    steps: dict[str, int]  # nominal steps per section, cut to fit the budget
    costs: dict[str, float]  # nominal seconds per section: how the budget is shared


_TINY_MODEL = ("model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64")
PROFILES = {
    "gpu": Profile(
        llama=Shape("llama-1b", ("model.size=llama-1b",), 128256, 2048, 4),
        gpt2=Shape("gpt2", ("model.size=gpt2",), 50304, 1024, 12),
        compile=True, warmup=3, skip=3,
        # loop: 30 steps, so that the steady window holds the guard's snapshot after step 25.
        steps={"mfu_eager": 20, "mfu_compiled": 20, "loop": 30, "resume": 12, "fp16": 12, "reference": 30,
               "float8": 200},
        costs={"mfu_eager": 20, "mfu_compiled": 70, "loop": 45, "resume": 30, "memory": 20, "fp16": 20,
               "reference": 100, "float8": 140}),
    "cpu-tiny": Profile(
        llama=Shape("llama-1b tiny", ("model.size=llama-1b", *_TINY_MODEL, "model.n_kv_heads=2",
                                      "model.ffn_hidden=128"), 512, 64, 2),
        gpt2=Shape("gpt2 tiny", ("model.size=gpt2", *_TINY_MODEL), 512, 64, 2),
        compile=False, warmup=1, skip=2,
        steps={"mfu_eager": 4, "mfu_compiled": 4, "loop": 12, "resume": 6, "fp16": 6, "reference": 8, "float8": 12},
        costs={"mfu_eager": 3, "mfu_compiled": 1, "loop": 6, "resume": 10, "memory": 1, "fp16": 4, "reference": 10,
               "float8": 4}),
}
SECTIONS = (("mfu_eager", "1 step, eager"), ("mfu_compiled", "1 step, compiled"), ("loop", "2 whole loop"),
            ("resume", "2 resume"), ("memory", "3 memory"), ("fp16", "4 fp16 loss scale"),
            ("reference", "5 GPT-2 reference"), ("float8", "6 float8"))


class Budget:
    """The run's time limit, shared by nominal cost: while what is left covers every remaining
    section's nominal cost, sections run their nominal steps; after, their steps shrink in proportion."""

    def __init__(self, seconds: float, costs: dict[str, float]):
        self.deadline = time.monotonic() + seconds
        self.costs = dict(costs)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def steps(self, nominal: int, least: int) -> int:
        scale = min(1.0, max(0.0, self.left() / max(sum(self.costs.values()), 1e-9)))
        return max(min(least, nominal), round(nominal * scale))

    def done(self, section: str) -> None:
        self.costs.pop(section, None)


def init_process_group(cuda: bool) -> torch.device:
    """A one-rank process group: FSDP2 (parallel.sharding=full) needs one even on one device."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", 0) if cuda else torch.device("cpu")


def write_dataset(directory: str, seq_len: int, train_rows: int, seed: int = 0) -> str:
    """A prepared dataset in raylm's format (raylm/data/manifest.py), written without Ray: random
    byte-tokenizer ids, each split one shard, tokenizer.json, manifest.json last; beside them the
    train stream as nanoGPT's train.bin (uint16) for the reference."""
    tok, rng = ByteTokenizer(), np.random.default_rng(seed)
    os.makedirs(directory)
    splits = {}
    for split, rows in (("train", train_rows), ("val", 2)):
        stream = rng.integers(0, tok.vocab_size, rows * seq_len + 1, dtype=np.int32)
        # Row k is stream[k*seq_len : k*seq_len + seq_len + 1]: consecutive rows share a token.
        windows = np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len])
        name, data = f"{split}-00000.parquet", shard_bytes(windows)
        Path(directory, name).write_bytes(data)
        documents = int(np.count_nonzero(windows[:, 1:] == tok.eot_id))
        splits[split] = SplitInfo.of_shards([ShardInfo(name, rows, rows * seq_len, documents,
                                                       hashlib.sha256(data).hexdigest())])
        if split == "train":
            stream.astype(np.uint16).tofile(os.path.join(directory, "train.bin"))
    tok.save(os.path.join(directory, TOKENIZER_FILE))
    Manifest(TokenizerInfo.of(tok), seq_len, splits, sources=["random tokens (benchmarks/gpu_check.py)"],
             split_rule="position", val_fraction=2 / (train_rows + 2)).save(directory)
    return directory


def text_batches(shape: Shape, steps: int, device: torch.device) -> list[torch.Tensor]:
    """`steps` batches of real text for `shape`: the top-level modules of Python's standard library
    (the built-in corpus), concatenated in name order, as byte tokens (read here, not through
    raylm.data's storage layer, which imports boto3)."""
    need = steps * shape.micro_batch * (shape.seq_len + 1)
    text = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_bytes()
        if len(text) >= need:
            break
    if len(text) < need:
        raise RuntimeError(f"the standard library's top-level modules hold {len(text):,} bytes; {need:,} needed")
    tokens = torch.frombuffer(text[:need], dtype=torch.uint8).long()
    return list(tokens.view(steps, shape.micro_batch, shape.seq_len + 1).to(device))


def loop_overrides(data: str, steps: int) -> list[str]:
    """The loop as section 2 runs it: guard and metrics at their defaults, one async checkpoint
    (at the end), no evaluation, an LR warmup that fits the short run, eager (section 1's eager
    step is its measure; sections that compile say so), and the loop's reads of the device every
    READ_EVERY steps (the GPU's default, log_every; given, so that --cpu-tiny takes that path too)."""
    return [f"data.path={data}", f"train.steps={steps}", f"schedule.warmup_steps={steps // 4}", "train.eval_every=0",
            "checkpoint.every_steps=0", "checkpoint.async_save=true", "train.compile=false",
            f"train.log_every={READ_EVERY}", f"train.read_every={READ_EVERY}"]


def attempt(fn: Callable[[], dict]) -> dict:
    """`fn`'s result, or its failure as one: one section's CUDA error must not lose the others'."""
    try:
        return fn()
    except Exception as e:  # recorded; the next section runs
        return {"error": f"{type(e).__name__}: {e}".strip(), "traceback": traceback.format_exc(limit=-8)}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def steady(times: list[float], tokens: int, skip: int) -> dict:
    """Tokens/s over the steps after the first `skip`: at the median step (robust to the odd
    stall) and over the window (every stall counts)."""
    window = times[skip:] if len(times) > skip else times
    return {"tokens_per_s": tokens / statistics.median(window), "tokens_per_s_mean": tokens * len(window) / sum(window),
            "steady_steps": len(window)}


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def fmt(x: float) -> str:
    return f"{x:,.0f}"


class Check:
    """The sections, in order, on one device, sharing a budget and a scratch directory."""

    def __init__(self, profile: Profile, device: torch.device, budget: Budget, workdir: str,
                 nanogpt: Optional[str] = None):
        self.profile, self.device, self.budget, self.workdir = profile, device, budget, workdir
        self.nanogpt = nanogpt  # a checkout of nanoGPT: its train.py is section 5's baseline
        self.cuda = device.type == "cuda"
        self.results: dict[str, dict] = {}
        self.datasets: dict[int, str] = {}

    def run(self, sections: list[str], after_each: Callable[[dict[str, dict]], None]) -> dict[str, dict]:
        """The named sections in order; `after_each` sees the results so far (a run killed at its
        limit still leaves the finished sections' figures)."""
        for key, title in SECTIONS:
            if key not in sections:
                continue
            left, cost = self.budget.left(), self.budget.costs[key]
            if left < START_SHARE * cost:
                self.results[key] = {"error": f"skipped: {max(left, 0):.0f} s of the budget (--budget-s) left, "
                                              f"the section needs about {cost:.0f} s"}
            else:
                start = time.monotonic()
                self.results[key] = attempt(getattr(self, key))
                self.results[key]["seconds"] = time.monotonic() - start
                if self.profile.compile:  # compiled graphs of this section's model: not needed again
                    torch.compiler.reset()
            self.budget.done(key)
            error = self.results[key].get("error")
            print(f"gpu_check: {title}: " + (f"FAILED: {error.splitlines()[0]}" if error else
                                             f"done in {self.results[key]['seconds']:.0f} s"), flush=True)
            after_each(self.results)
        return self.results

    def config(self, shape: Shape, *extra: str) -> Config:
        return load_config(None, [*LAYOUT, f"parallel.use_gpu={str(self.cuda).lower()}", *shape.overrides(), *extra])

    def steps(self, key: str, least: int) -> int:
        return self.budget.steps(self.profile.steps[key], least)

    def dataset(self, shape: Shape) -> str:
        """The prepared dataset of this sequence length (written once): rows for 64 steps."""
        if shape.seq_len not in self.datasets:
            self.datasets[shape.seq_len] = write_dataset(os.path.join(self.workdir, f"data-{shape.seq_len}"),
                                                         shape.seq_len, 64 * shape.micro_batch)
        return self.datasets[shape.seq_len]

    def scratch(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def train(self, cfg: Config, run_dir: str, hooks: tuple[Hook, ...] = ()) -> list[dict]:
        """raylm's loop in this process (`train_local`, no Ray); metrics.jsonl's rows in step order
        (a step's later row is the one that counts)."""
        train_local(cfg, run_dir, hooks=hooks, use_gpu=self.cuda)
        rows = {row["step"]: row for row in read_jsonl(os.path.join(run_dir, METRICS_FILE))}
        return [rows[step] for step in sorted(rows)]

    def bare_step(self, cfg: Config, warmup: int, steps: int, batches: Optional[list[torch.Tensor]] = None) -> dict:
        """raylm's step alone: `forward_backward`, clipping, AdamW, timed after `warmup` steps; its
        peak allocated memory on CUDA. On random tokens at a constant LR, or on `batches` (one a
        step, warmup included) at the schedule's LR, each step's loss then recorded."""
        device, world = self.device, World.current(self.device)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        model = build_model(lambda: Transformer(cfg.model), cfg, world,
                            resolve_layout(cfg.parallel, cfg.model, world.world_size, cfg.train.seq_len))
        optimizer = build_optimizer(model.parts, cfg.optim)
        micro, seq = cfg.train.micro_batch_size, cfg.train.seq_len
        tokens = torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), device=device)
        times, losses = [], []
        for step in range(warmup + steps):
            if batches is not None:
                tokens = batches[step]
                apply_lr(optimizer, lr_at(step, cfg.schedule, cfg.optim.lr, warmup + steps))
            self.sync()
            start = time.perf_counter()
            loss = model.forward_backward(tokens, micro)
            model.clip_grad_norm(cfg.optim.grad_clip)
            optimizer.step()
            after_optimizer_step(model.parts)
            optimizer.zero_grad(set_to_none=True)
            self.sync()
            losses.append(loss.detach())
            if step >= warmup:
                times.append(time.perf_counter() - start)
        result = {"step_s": statistics.median(times), **steady(times, micro * seq, 0), "final_loss": float(loss)}
        if batches is not None:
            result["losses"] = torch.stack(losses).tolist()
        if self.cuda:
            result["peak_allocated_gib"] = (torch.cuda.max_memory_allocated(device) - base) / GIB
        return result

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mfu(self, compiled: bool) -> dict:
        """The bare step's MFU in the FSDP2 layout (the result's own keys) and in the one-GPU layout
        (its `one_gpu` key)."""
        shape = self.profile.llama
        steps = self.steps("mfu_compiled" if compiled else "mfu_eager", 5)
        model = self.config(shape).model
        flops, peak = flops_per_token(model, shape.seq_len), peak_flops(self.device)

        def measure(*layout: str) -> dict:
            cfg = self.config(shape, f"train.compile={str(compiled).lower()}", *layout)
            result = self.bare_step(cfg, self.profile.warmup, steps)
            if compiled:
                torch.compiler.reset()
            return {**result, "tflops": flops * result["tokens_per_s"] / 1e12,
                    "mfu": flops * result["tokens_per_s"] / peak}

        result = measure()
        result.update(shape=shape.name, params=count_params(model), seq_len=shape.seq_len,
                      micro_batch=shape.micro_batch, compile=compiled, flops_per_token=flops, peak_tflops=peak / 1e12)
        result["one_gpu"] = attempt(functools.partial(measure, *ONE_GPU))
        result["table"] = [["tokens/s", fmt(result["tokens_per_s"]), "", ""], mfu_line("MFU", result, peak),
                           mfu_line("MFU, one-GPU layout", result["one_gpu"], peak)]
        return result

    def mfu_eager(self) -> dict:
        return self.mfu(compiled=False)

    def mfu_compiled(self) -> dict:
        if not self.profile.compile:
            return {"skipped": "compilation off with --cpu-tiny (20-25 s on a cold cache here, for no CPU speedup)",
                    "table": [["skipped", "no compilation on CPU", "", ""]]}
        return self.mfu(compiled=True)

    def loop(self) -> dict:
        """The whole loop on section 1's shape and batch, against section 1's eager step."""
        shape, skip = self.profile.llama, self.profile.skip
        steps = self.steps("loop", skip + 5)
        run_dir = self.scratch("loop")
        start = time.monotonic()
        costs = StepCosts()
        rows = self.train(self.config(shape, *loop_overrides(self.dataset(shape), steps)), run_dir, hooks=(costs,))
        wall = time.monotonic() - start
        shutil.rmtree(run_dir)  # llama-1b's checkpoint: 15 GB
        slowest = max(rows[skip:], key=lambda row: row["step_time"])
        result = {"shape": shape.name, "steps": steps, "wall_s": wall, "step_s_sum": sum(r["step_time"] for r in rows),
                  "slowest_step": {key: slowest[key] for key in ("step", "step_time", "data_wait", "checkpoint_s")},
                  **steady([r["step_time"] for r in rows], shape.micro_batch * shape.seq_len, skip),
                  "syncs": costs.summary(range(skip, steps - 1), {s for s in range(steps) if (s + 1) % READ_EVERY == 0})}
        per_step, per_read = result["syncs"]["host_syncs_per_step"], result["syncs"]["host_syncs_per_read"]
        bare = self.results.get("mfu_eager", {}).get("tokens_per_s")
        table = [["tokens/s (median; window mean)",
                  f"{fmt(result['tokens_per_s'])}; {fmt(result['tokens_per_s_mean'])}", "", ""],
                 [f"slowest steady step ({slowest['step']}) vs median", (f"{slowest['step_time']:.3f} s vs "
                  f"{shape.micro_batch * shape.seq_len / result['tokens_per_s']:.3f} s"), "", ""],
                 [f"host syncs per steady step (no read); per read (every {READ_EVERY})", f"{per_step}; {per_read}",
                  "0", "met" if per_step == 0 else "NOT met"]]
        if bare:
            result.update(bare_tokens_per_s=bare, overhead=1 - result["tokens_per_s"] / bare,
                          overhead_mean=1 - result["tokens_per_s_mean"] / bare)
            result["goal_met"] = result["overhead_mean"] <= LOOP_OVERHEAD_GOAL
            table.append(["overhead vs bare step (median; mean)",
                          f"{result['overhead']:+.1%}; {result['overhead_mean']:+.1%}",
                          f"<= {LOOP_OVERHEAD_GOAL:.0%}", "met" if result["goal_met"] else "NOT met"])
        else:
            table.append(["overhead vs bare step", "n/a: section 1 (eager) has no figure", "", ""])
        result["table"] = table
        return result

    def resume(self) -> dict:
        """A run stopped at half its steps and resumed, against an uninterrupted one."""
        shape = self.profile.gpt2
        steps = self.steps("resume", 4)
        stop = steps // 2
        base = loop_overrides(self.dataset(shape), steps)
        whole = self.train(self.config(shape, *base), self.scratch("resume-whole"))
        split_dir = self.scratch("resume-split")
        self.train(self.config(shape, *base, f"train.stop_at_step={stop}"), split_dir)
        split = self.train(self.config(shape, *base), split_dir)
        resumed = [e for e in read_jsonl(os.path.join(split_dir, EVENTS_FILE)) if e.get("event") == "resumed"]
        for run_dir in ("resume-whole", "resume-split"):
            shutil.rmtree(self.scratch(run_dir))
        if [r["step"] for r in split] != [r["step"] for r in whole]:
            raise RuntimeError(f"resumed run has steps {[r['step'] for r in split]}, the uninterrupted one "
                               f"{[r['step'] for r in whole]}")
        diffs = [relative(a["loss"], b["loss"]) for a, b in zip(split, whole, strict=True)]
        rtol = RESUME_RTOL_CUDA if self.cuda else 0.0
        resumed_from = resumed[-1]["from_step"] if resumed else None
        equal = resumed_from == stop and max(diffs[stop:]) <= rtol
        return {"shape": shape.name, "steps": steps, "stop_at_step": stop, "resumed_from_step": resumed_from,
                "rtol": rtol, "max_rel_diff_before_stop": max(diffs[:stop]),
                "max_rel_diff_after_resume": max(diffs[stop:]), "equal": equal,
                "losses_resumed": [r["loss"] for r in split], "losses_uninterrupted": [r["loss"] for r in whole],
                "table": [[f"losses {stop + 1}..{steps} after resume at {resumed_from}",
                           f"max rel diff {max(diffs[stop:]):.1e} (fresh runs before: {max(diffs[:stop]):.1e})",
                           f"rel <= {rtol:g}" if rtol else "exact", "equal" if equal else "NOT equal"]]}

    def memory(self) -> dict:
        """The step's peak allocated memory against the planner's estimate, in the FSDP2 layout and in
        the one a multi-GPU config gets on one GPU (no wrapper: the planner counts it as `amp`)."""
        shape, rows = self.profile.llama, []
        for layout, extra in MEMORY_LAYOUTS.items():
            cfg = self.config(shape, *extra)
            estimate = estimate_memory(cfg.model, cfg.parallel, "mixed", shape.seq_len, shape.micro_batch)
            parts = ("params", "grads", "optimizer", "master", "activations", "buffers")
            row = {"layout": layout, "activation_checkpointing": cfg.parallel.activation_checkpointing,
                   "estimate_gib": estimate.total / GIB,
                   "estimate_parts_gib": {part: getattr(estimate, part) / GIB for part in parts}}
            row.update(attempt(functools.partial(self.peak_memory, cfg, row["estimate_gib"])))
            rows.append(row)
        return {"shape": shape.name, "precision": "mixed", "rows": rows, "table": [memory_line(row) for row in rows]}

    def peak_memory(self, cfg: Config, estimate_gib: float) -> dict:
        """The step's peak allocated memory on CUDA, against `estimate_gib`; skipped on CPU."""
        if not self.cuda:
            return {"skipped": "no allocator peak on CPU", "max_rss_gib": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}  # the whole process's, torch included
        peak = self.bare_step(cfg, warmup=1, steps=2)["peak_allocated_gib"]  # AdamW's state exists from step 1 on
        return {"peak_allocated_gib": peak, "goal_met": relative(peak, estimate_gib) <= MEMORY_GOAL}

    def fp16(self) -> dict:
        """The loop with fp16 parameters: the loss scale must move and every loss stay finite."""
        shape = self.profile.gpt2
        steps = self.steps("fp16", 6)
        cfg = self.config(shape, *loop_overrides(self.dataset(shape), steps), "parallel.param_dtype=fp16",
                          "train.loss_scale_growth_interval=2")
        run_dir = self.scratch("fp16")
        rows = self.train(cfg, run_dir)
        shutil.rmtree(run_dir)
        scales = [cfg.train.loss_scale_initial, *(row["loss_scale"] for row in rows)]
        losses = [row["loss"] for row in rows]
        grew = sum(b > a for a, b in itertools.pairwise(scales))
        halved = sum(b < a for a, b in itertools.pairwise(scales))
        finite = all(math.isfinite(loss) for loss in losses)
        return {"shape": shape.name, "steps": steps, "loss_scales": scales, "losses": losses, "growths": grew,
                "overflows": halved, "losses_finite": finite, "goal_met": finite and grew + halved > 0,
                "table": [["loss scale", f"{scales[0]:g} -> {scales[-1]:g}: {grew} growths, {halved} overflows",
                           "moves", "met" if grew + halved else "NOT met"],
                          ["losses", f"{len(losses)} steps, last {losses[-1]:.4f}", "finite",
                           "met" if finite else "NOT met"]]}

    def reference(self) -> dict:
        """The nanoGPT-style GPT-2 in its own process, then raylm's loop on the same shape and batch."""
        shape = self.profile.gpt2
        skip = self.profile.skip + (2 if self.profile.compile else 0)  # compilation and its recompiles
        steps = self.steps("reference", skip + 5)
        data = self.dataset(shape)
        base = (*loop_overrides(data, steps), f"train.compile={str(self.profile.compile).lower()}")
        cfg = self.config(shape, *base, *ONE_GPU)
        tokens = shape.micro_batch * shape.seq_len
        ref = self.run_reference(cfg, data, steps)
        theirs = steady(ref["step_times"], tokens, skip)

        def ours(config: Config, name: str) -> dict:
            run_dir = self.scratch(name)
            rows = self.train(config, run_dir)
            shutil.rmtree(run_dir)
            if self.profile.compile:
                torch.compiler.reset()
            return steady([row["step_time"] for row in rows], tokens, skip)

        one_gpu = ours(cfg, "reference-raylm")
        fsdp = ours(self.config(shape, *base), "reference-raylm-fsdp2")
        ratio = one_gpu["tokens_per_s"] / theirs["tokens_per_s"]
        fsdp_ratio = fsdp["tokens_per_s"] / theirs["tokens_per_s"]
        if abs(ref["params"] - count_params(cfg.model)) > ref.get("params_rounding", 0):
            raise RuntimeError(f"the baseline's model has {ref['params']:,} parameters, raylm's "
                               f"{count_params(cfg.model):,}: not the same shape")
        return {"shape": shape.name, "steps": steps, "compile": self.profile.compile, "baseline": ref["baseline"],
                "params_raylm": count_params(cfg.model), "params_reference": ref["params"],
                "reference": {**theirs, "autocast": ref["autocast"]}, "raylm": one_gpu, "ratio": ratio,
                "raylm_fsdp2": fsdp, "ratio_fsdp2": fsdp_ratio, "goal_met": ratio >= 1.0,
                "table": [["tokens/s raylm loop (one-GPU layout) vs reference (median)",
                           f"{fmt(one_gpu['tokens_per_s'])} vs {fmt(theirs['tokens_per_s'])} ({ratio:.2f}x)",
                           ">= 1.00x", "met" if ratio >= 1.0 else "NOT met"],
                          ["tokens/s raylm (one-GPU) vs reference (window mean)",
                           f"{fmt(one_gpu['tokens_per_s_mean'])} vs {fmt(theirs['tokens_per_s_mean'])}", "", ""],
                          ["tokens/s raylm loop (FSDP2 layout) vs reference (median)",
                           f"{fmt(fsdp['tokens_per_s'])} vs {fmt(theirs['tokens_per_s'])} ({fsdp_ratio:.2f}x)", "",
                           ""]]}

    def float8(self) -> dict:
        """bf16 and float8 (`train.precision=float8`: torchao's float8 linears in the blocks, the head
        in bf16) on the llama-1b shape in the one-GPU layout, compiled, each `steps` steps from the
        same seed on the same text (Python's standard library as bytes), at the schedule's LR:
        tokens/s of the step, and the loss at the end as the mean of the last LOSS_WINDOW steps (one
        step's loss moves by more than the goal). Where float8 is refused (a CPU, a GPU before SM
        8.9), the refusal is the result."""
        shape = self.profile.llama
        skip = self.profile.warmup + (2 if self.profile.compile else 0)  # compilation and its recompiles
        steps = self.steps("float8", skip + LOSS_WINDOW)
        batches = text_batches(shape, steps, self.device)
        runs: dict[str, dict] = {}
        for precision in ("bf16", "float8"):
            try:
                cfg = self.config(shape, *ONE_GPU, f"train.precision={precision}", f"train.steps={steps}",
                                  f"schedule.warmup_steps={steps // 10}", f"train.compile={str(self.profile.compile).lower()}")
                run = self.bare_step(cfg, skip, steps - skip, batches)
            except ConfigError as refused:
                runs[precision] = {"refused": str(refused)}
                continue
            finally:
                if self.profile.compile:
                    torch.compiler.reset()
            losses = run.pop("losses")
            runs[precision] = {**run, "loss_end": statistics.mean(losses[-LOSS_WINDOW:]), "losses": losses}
        bf16, fp8 = runs["bf16"], runs["float8"]
        result = {"shape": shape.name, "steps": steps, "compile": self.profile.compile, "layout": "one-GPU",
                  "recipe": self.config(shape).train.float8_recipe, **runs}
        if "refused" in fp8:
            result["table"] = [["float8", f"refused: {fp8['refused'][:110]}", "", ""]]
            return result
        speedup, loss_diff = fp8["tokens_per_s"] / bf16["tokens_per_s"], relative(fp8["loss_end"], bf16["loss_end"])
        result.update(speedup=speedup, loss_rel_diff=loss_diff,
                      goal_met=speedup >= FLOAT8_SPEEDUP_GOAL and loss_diff <= FLOAT8_LOSS_GOAL)
        result["table"] = [
            ["tokens/s float8 vs bf16, compiled (median)",
             f"{fmt(fp8['tokens_per_s'])} vs {fmt(bf16['tokens_per_s'])} ({speedup:.2f}x)",
             f">= {FLOAT8_SPEEDUP_GOAL:.2f}x", "met" if speedup >= FLOAT8_SPEEDUP_GOAL else "NOT met"],
            [f"loss after {steps} steps (mean of last {LOSS_WINDOW}) float8 vs bf16",
             f"{fp8['loss_end']:.4f} vs {bf16['loss_end']:.4f} ({loss_diff:.2%})", f"within {FLOAT8_LOSS_GOAL:.0%}",
             "met" if loss_diff <= FLOAT8_LOSS_GOAL else "NOT met"]]
        return result

    def run_reference(self, cfg: Config, data: str, iters: int) -> dict:
        """The baseline in its own process (its TF32 and compile settings stay there): nanoGPT's
        own train.py where --nanogpt gives its checkout, else benchmarks/_gpt2_reference.py."""
        if self.nanogpt:
            return self.run_nanogpt(cfg, data, iters)
        m, script = cfg.model, HERE / "_gpt2_reference.py"
        out, log = self.scratch("reference.json"), self.scratch("reference.log")
        command = [sys.executable, str(script), "--data", data, "--out", out, "--iters", str(iters),
                   "--batch-size", str(cfg.train.micro_batch_size), "--block-size", str(cfg.train.seq_len),
                   "--n-layer", str(m.n_layers), "--n-head", str(m.n_heads), "--n-embd", str(m.d_model),
                   "--vocab-size", str(m.vocab_size), "--device", self.device.type,
                   "--compile" if self.profile.compile else "--no-compile"]
        with open(log, "w") as f:
            done = subprocess.run(command, check=False, stdout=f, stderr=subprocess.STDOUT, env=baseline_env(),
                                  timeout=max(30.0, self.budget.left()))
        if done.returncode:
            raise RuntimeError(f"{script} exited with status {done.returncode}:\n{Path(log).read_text()[-2000:]}")
        return {**json.loads(Path(out).read_text()), "baseline": "benchmarks/_gpt2_reference.py"}

    def run_nanogpt(self, cfg: Config, data: str, iters: int) -> dict:
        """nanoGPT's train.py as its README runs it on one GPU, on section 5's shape, batch and
        tokens (train.bin; val.bin the same, for its evaluation at iteration 0, of one batch): no
        gradient accumulation, a log line and `loss.item()` every iteration, no checkpoint. Its own
        per-iteration times ("iter N: loss L, time T ms") are the figures."""
        m, work = cfg.model, self.scratch("nanogpt")
        os.makedirs(os.path.join(work, "data", "gpucheck"))
        for name in ("train.py", "model.py", "configurator.py"):
            shutil.copy(os.path.join(self.nanogpt, name), work)
        for split in ("train", "val"):
            shutil.copy(os.path.join(data, "train.bin"), os.path.join(work, "data", "gpucheck", f"{split}.bin"))
        command = [sys.executable, "train.py", "--dataset=gpucheck", f"--batch_size={cfg.train.micro_batch_size}",
                   f"--block_size={cfg.train.seq_len}", "--gradient_accumulation_steps=1", f"--max_iters={iters - 1}",
                   f"--eval_interval={10 * iters}", "--eval_iters=1", "--log_interval=1",
                   "--always_save_checkpoint=False", f"--n_layer={m.n_layers}", f"--n_head={m.n_heads}",
                   f"--n_embd={m.d_model}", "--dropout=0.0", f"--bias={m.bias}", f"--compile={self.profile.compile}",
                   f"--device={self.device.type}", f"--out_dir={os.path.join(work, 'out')}"]
        done = subprocess.run(command, check=False, cwd=work, capture_output=True, text=True, env=baseline_env(),
                              timeout=max(30.0, self.budget.left()))
        output = done.stdout + done.stderr
        if done.returncode:
            raise RuntimeError(f"nanoGPT's train.py exited with status {done.returncode}:\n{output[-2000:]}")
        iterations = re.findall(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms", output, re.MULTILINE)
        non_embedding = float(re.search(r"number of parameters: ([\d.]+)M", output).group(1)) * 1e6
        commit = Path(self.nanogpt, "COMMIT")
        return {"step_times": [float(t) / 1000 for _, _, t in iterations], "losses": [float(x) for _, x, _ in iterations],
                # nanoGPT counts its parameters without the position embedding, to two decimals of a million
                "params": round(non_embedding + cfg.train.seq_len * m.d_model), "params_rounding": 5e3,
                "autocast": "bf16", "baseline": "nanoGPT train.py" + (f" @ {commit.read_text().strip()[:7]}"
                                                                     if commit.exists() else "")}


def baseline_env() -> dict[str, str]:
    """This process's environment without the one-rank process group's rendezvous: nanoGPT's
    train.py reads RANK as "launched by torchrun" and would start DDP on our MASTER_PORT."""
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def mfu_line(title: str, result: dict, peak: float) -> list[str]:
    if "error" in result:
        return [title, f"ERROR {result['error'][:100]}", "", "failed"]
    return [title, f"{result['mfu']:.1%} ({result['tflops']:.3g} of {peak / 1e12:.3g} TFLOP/s; "
            f"{fmt(result['tokens_per_s'])} tokens/s)", "", ""]


def memory_line(row: dict) -> list[str]:
    """A table line of section 3: one checkpointing mode."""
    what = f"{row['layout']} layout, AC {row['activation_checkpointing']}"
    if "error" in row:
        return [what, f"ERROR {row['error'][:100]}", "", "failed"]
    if "peak_allocated_gib" not in row:
        return [f"{what}: plan", f"{row['estimate_gib'] * 1024:.2f} MiB (peak: {row['skipped']})", "", ""]
    peak, estimate = row["peak_allocated_gib"], row["estimate_gib"]
    return [f"{what}: peak vs plan", f"{peak:.2f} vs {estimate:.2f} GiB ({peak / estimate:.2f}x)",
            f"within {MEMORY_GOAL:.0%}", "met" if row["goal_met"] else "NOT met"]


def print_report(report: dict) -> None:
    print(f"\ngpu_check on {report['device']} (torch {report['torch']}, cuda {report['cuda']}): "
          f"{report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget"
          f"{'; CPU, tiny shapes: plumbing only' if report['cpu_tiny'] else ''}")
    print(f"FLOPs: {report['flops_formula']}; peak {report['peak_tflops']:.3g} TFLOP/s "
          "(raylm.train.observe.metrics.peak_flops)\n")
    rows = []
    for key, title in SECTIONS:
        if key not in report["sections"]:
            continue
        result = report["sections"][key]
        if "error" in result:
            rows.append([title, "ERROR", result["error"].splitlines()[0][:120], "", "failed"])
        else:
            rows += [[title, *line] for line in result["table"]]
    print_table(("section", "measure", "value", "goal", "verdict"), rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json-out", help="write the whole result here")
    ap.add_argument("--budget-s", type=float, default=330.0, help="time for all sections (default 330)")
    ap.add_argument("--cpu-tiny", action="store_true", help="CPU, tiny shapes, no compilation: the code path only")
    ap.add_argument("--nanogpt", help="a checkout of karpathy/nanoGPT (train.py, model.py, configurator.py): "
                                      "section 5's baseline is then its own train.py")
    ap.add_argument("--sections", default=",".join(key for key, _ in SECTIONS),
                    help=f"comma-separated, of: {', '.join(key for key, _ in SECTIONS)} (default: all)")
    args = ap.parse_args()
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - {key for key, _ in SECTIONS})
    if unknown:
        ap.error(f"--sections: unknown section(s) {', '.join(unknown)}; "
                 f"known: {', '.join(key for key, _ in SECTIONS)}")
    cuda = not args.cpu_tiny
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; run it on the GPU machine, or pass --cpu-tiny for the CPU path")
    profile = PROFILES["gpu" if cuda else "cpu-tiny"]
    start = time.monotonic()
    budget = Budget(args.budget_s, {key: cost for key, cost in profile.costs.items() if key in sections})
    device = init_process_group(cuda)
    report = {"device": torch.cuda.get_device_name(device) if cuda else f"cpu ({os.cpu_count()} cores)",
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
              "cpu_tiny": args.cpu_tiny, "budget_s": args.budget_s, "load_average": os.getloadavg(),
              "flops_formula": FLOPS_FORMULA, "peak_tflops": peak_flops(device) / 1e12, "sections": {}}

    def save(results: dict[str, dict]) -> None:
        report.update(elapsed_s=time.monotonic() - start, sections=results,
                      host_syncs_per_step=results.get("loop", {}).get("syncs", {}).get("host_syncs_per_step"))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")

    workdir = tempfile.mkdtemp(prefix="raylm-gpu-check-")
    try:
        results = Check(profile, device, budget, workdir, args.nanogpt).run(sections, after_each=save)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_report(report)
    dist.destroy_process_group()  # after the report: a broken CUDA context may hang it
    sys.exit(1 if any("error" in result or "error" in result.get("one_gpu", {}) for result in results.values()) else 0)


if __name__ == "__main__":
    main()
