"""Model FLOPs utilisation of a ~1B model on GPU: FSDP2 with bf16 parameters, fp32 reductions,
optionally torch.compile per block, through raylm's own `build_model`.

    .venv/bin/python benchmarks/gpu_mfu.py [--size llama-1b] [--seq-len 2048] [--micro-batch 4]
        [--steps 20] [--warmup 5] [--compile] [--ac none|full|every_k] [--json-out PATH]
    torchrun --nproc-per-node 8 benchmarks/gpu_mfu.py ...     # FSDP2 over 8 GPUs
    .venv/bin/python benchmarks/gpu_mfu.py --cpu-tiny [--compile]   # the same path on CPU, tiny model

MFU = flops_per_token(model, seq_len) x tokens/s per device / the device's dense bf16 peak
(`raylm.train.observe.metrics.peak_flops`: a table for known GPUs, a measured matmul rate on CPU).
FLOPs are 6N + 12·L·d·T per token (`raylm.model.sizes.flops_per_token`). Each step is one
micro-batch of random tokens per rank, forward + backward + clip + AdamW; the first --warmup
steps (compilation, allocator growth) are not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from raylm.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from raylm.config.presets import preset
from raylm.model.sizes import count_params, flops_per_token
from raylm.model.transformer import Transformer
from raylm.parallel.world import World
from raylm.parallel.layout import resolve_layout
from raylm.train.step import build_model
from raylm.train.observe.metrics import peak_flops
from raylm.train.optim import build_optimizer

LLAMA3_VOCAB = 128256
TINY = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256, tie_embeddings=True)


def init_distributed(cuda: bool) -> torch.device:
    """Join torchrun's group, or make a one-rank group (FSDP2 needs one even on a single GPU)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def run(args: argparse.Namespace) -> dict:
    cuda = not args.cpu_tiny
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --cpu-tiny to test the code path on CPU")
    device = init_distributed(cuda)
    world = World.current(device)
    shape = TINY if args.cpu_tiny else preset(args.size)
    model_cfg = ModelConfig(**{**shape, "vocab_size": args.vocab or (256 if args.cpu_tiny else LLAMA3_VOCAB),
                               "max_seq_len": max(shape["max_seq_len"], args.seq_len)})
    cfg = Config(model=model_cfg, optim=OptimConfig(),
                 train=TrainConfig(micro_batch_size=args.micro_batch, compile=args.compile),
                 parallel=dataclasses.replace(ParallelConfig(), num_workers=world.world_size, use_gpu=cuda,
                                              sharding="full", param_dtype=args.param_dtype, reduce_dtype="fp32",
                                              activation_checkpointing=args.ac))
    model = build_model(lambda: Transformer(model_cfg), cfg, world,
                        resolve_layout(cfg.parallel, model_cfg, world.world_size, cfg.train.seq_len))
    optimizer = build_optimizer(model.parts, cfg.optim)
    tokens = torch.randint(0, model_cfg.vocab_size, (args.micro_batch, args.seq_len + 1), device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    times = []
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        loss = model.forward_backward(tokens, args.micro_batch)
        model.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = args.micro_batch * args.seq_len / step_s  # per device
    flops = flops_per_token(model_cfg, args.seq_len)
    peak = peak_flops(device)
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "world_size": world.world_size,
        "params": count_params(model_cfg), "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "param_dtype": args.param_dtype, "compile": args.compile, "activation_checkpointing": args.ac,
        "step_s": step_s, "tokens_per_s_per_device": tokens_per_s, "tflops_per_device": flops * tokens_per_s / 1e12,
        "mfu": flops * tokens_per_s / peak, "peak_tflops": peak / 1e12, "final_loss": float(loss),
    }
    if cuda:
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    dist.destroy_process_group()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="llama-1b", help="a named size of raylm.model.sizes")
    ap.add_argument("--vocab", type=int, default=None, help=f"vocabulary (default {LLAMA3_VOCAB}, Llama 3's)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    ap.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--ac", choices=("none", "full", "every_k"), default="none", help="activation checkpointing")
    ap.add_argument("--cpu-tiny", action="store_true", help="tiny model on CPU: exercise the code path only")
    ap.add_argument("--json-out", help="also write the result here")
    args = ap.parse_args()
    if args.cpu_tiny:
        args.seq_len, args.micro_batch = min(args.seq_len, 64), min(args.micro_batch, 2)
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    result = run(args)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{result['device']} x{result['world_size']}: {result['params'] / 1e9:.2f}B params, "
              f"seq {result['seq_len']} x micro-batch {result['micro_batch']}, {result['param_dtype']}"
              f"{', compiled' if result['compile'] else ''}: step {result['step_s'] * 1e3:.0f} ms, "
              f"{result['tokens_per_s_per_device']:.0f} tokens/s/device, "
              f"{result['tflops_per_device']:.1f} TFLOP/s, MFU {result['mfu']:.1%}")
        print(json.dumps(result))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
