"""Step time and memory of each parallel layout for a small model on CPU (gloo); informational.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/parallel_layouts.py [--steps 8] [--d-model 128]
        [--layouts ddp,zero3,...] [--max-ranks 4]

Every layout trains the same model on the same global batch; each rank is one process with one
thread, so with more ranks than cores the figures measure oversubscription as much as the
layout. Per layout: the median step time after the first two steps, tokens/s, the model-state
bytes one rank holds after a step (its local shards of parameters, gradients and AdamW state:
what the sharding stages divide) and a rank's peak resident memory (ru_maxrss: the torch
runtime's ~0.3 GiB, and activations; each rank builds only its shards, on the meta device first).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

import torch

from _common import load_average, print_table

from raylm.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig  # noqa: E402
from raylm.model.transformer import Transformer  # noqa: E402
from raylm.parallel.world import World
from raylm.parallel.layout import resolve_layout
from raylm.train.step import build_model  # noqa: E402
from raylm.train.optim import build_optimizer  # noqa: E402
from tests.support.distributed import run_distributed  # noqa: E402

# name -> (ranks, ParallelConfig fields)
LAYOUTS: dict[str, tuple[int, dict]] = {
    "single": (1, {}),
    "ddp": (2, dict(sharding="none")),
    "zero1": (2, dict(sharding="optimizer")),
    "zero2": (2, dict(sharding="gradients")),
    "zero3": (2, dict(sharding="full")),
    "zero3_ac_full": (2, dict(sharding="full", activation_checkpointing="full")),
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True, loss_parallel=True)),
    "pp2_1f1b": (2, dict(pp=2, pp_schedule="1f1b")),
    "pp2_interleaved_1f1b": (2, dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)),
    "pp2_zbv_zero_bubble": (2, dict(pp=2, pp_schedule="zbv_zero_bubble", pp_virtual_stages=2)),
    "hsdp_2x2": (4, dict(sharding="full", dp_replicate=2)),
    "tp2_fsdp2": (4, dict(sharding="full", tp=2, sequence_parallel=True)),
    "pp2_fsdp2": (4, dict(sharding="full", pp=2)),
    "3d_pp2_fsdp2_tp2": (8, dict(sharding="full", pp=2, tp=2, sequence_parallel=True)),
}


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measure(args: argparse.Namespace, parallel: dict) -> dict:
    """Runs on every rank: train args.steps steps, time them, count this rank's state bytes."""
    model_cfg = ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                            vocab_size=args.vocab, max_seq_len=args.seq_len)
    cfg = Config(model=model_cfg, optim=OptimConfig(), train=TrainConfig(micro_batch_size=args.micro_batch),
                 parallel=dataclasses.replace(ParallelConfig(), **parallel))
    world = World.current()
    model = build_model(lambda: Transformer(model_cfg), cfg, world,
                        resolve_layout(cfg.parallel, model_cfg, world.world_size, cfg.train.seq_len))
    optimizer = build_optimizer(model.parts, cfg.optim)
    share = args.global_batch // model.dp_size
    times, state = [], 0
    for step in range(args.steps):
        batch = torch.randint(0, args.vocab, (args.global_batch, args.seq_len + 1),
                              generator=torch.Generator().manual_seed(step))
        start = time.perf_counter()
        model.forward_backward(batch[model.dp_rank * share:(model.dp_rank + 1) * share], args.micro_batch)
        model.clip_grad_norm(1.0)
        if step == args.steps - 1:  # gradients are freed by zero_grad: count them now
            params = {id(p): p for part in model.parts for p in part.parameters()}.values()
            state = sum(_local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0) for p in params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    state += sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"step_s": statistics.median(times[2:]), "state": state, "peak_rss": peak,
            "bubble": model.layout.get("pp_bubble")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names")
    ap.add_argument("--max-ranks", type=int, default=8)
    args = ap.parse_args()
    print(f"model d={args.d_model} layers={args.n_layers} vocab={args.vocab}, seq {args.seq_len}, "
          f"global batch {args.global_batch}, micro-batch {args.micro_batch}; load {load_average()}")
    rows = []
    for name in args.layouts.split(","):
        ranks, parallel = LAYOUTS[name]
        if ranks > args.max_ranks:
            continue
        per_rank = run_distributed(measure, ranks, args, parallel)  # "single" too: same process setup
        step = max(r["step_s"] for r in per_rank)
        bubble = per_rank[0]["bubble"]
        rows.append([name, ranks, f"{step * 1e3:.0f}", f"{args.global_batch * args.seq_len / step:.0f}",
                     f"{max(r['state'] for r in per_rank) / 2**20:.2f}",
                     f"{max(r['peak_rss'] for r in per_rank) / 2**20:.0f}",
                     f"{bubble:.0%}" if bubble is not None else "-"])
    print_table(["layout", "ranks", "step ms", "tokens/s", "state MiB/rank", "peak RSS MiB/rank", "pp bubble"], rows)


if __name__ == "__main__":
    main()
