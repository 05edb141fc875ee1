"""The reference for benchmarks/gpu_check.py's last section: GPT-2 124M as nanoGPT's model.py and
train.py train it on a GPU, rewritten independently of raylm (nothing here imports raylm or Ray).

    python3 benchmarks/_gpt2_reference.py --data DIR --out RESULT.json [--iters 30] [--batch-size 12]
        [--block-size 1024] [--n-layer 12] [--n-head 12] [--n-embd 768] [--vocab-size 50304]
        [--device cuda] [--compile | --no-compile]

which stands for nanoGPT's `python train.py --batch_size=12 --gradient_accumulation_steps=1
--max_iters=ITERS --eval_interval=ITERS+1 --always_save_checkpoint=False --dropout=0.0 --bias=True`
on one GPU: torch.compile of the whole model, bf16 autocast (fp16 where the GPU has no bf16, none
on a CPU), TF32 matmuls, fused AdamW on CUDA, warmup + cosine LR, clipping at 1.0, a batch drawn
from a memmap per step (pinned, copied without blocking while the previous step's work is
queued), and `loss.item()` every iteration (nanoGPT's log_interval=1). Evaluation and checkpoints
are left out: nanoGPT's first evaluation comes at iteration 0 and the timing is of training steps.

DIR holds train.bin (uint16 token ids, as nanoGPT's data/*/prepare.py writes). RESULT.json gets
each iteration's wall time and loss; the caller leaves out the first iterations (compilation).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

LEARNING_RATE, MIN_LR, WEIGHT_DECAY, BETA1, BETA2, GRAD_CLIP = 6e-4, 6e-5, 1e-1, 0.9, 0.95, 1.0
WARMUP_ITERS, LR_DECAY_ITERS, SEED = 2000, 600000, 1337  # nanoGPT's train.py defaults


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT does
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.block_size, config.n_embd),
            "drop": nn.Dropout(config.dropout), "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias)})
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, device_type: str) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=(BETA1, BETA2), **({"fused": True} if fused else {}))


def get_lr(it: int, lr_decay_iters: int = LR_DECAY_ITERS) -> float:
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    if it > lr_decay_iters:
        return MIN_LR
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP_ITERS) / (lr_decay_iters - WARMUP_ITERS)))
    return MIN_LR + coeff * (LEARNING_RATE - MIN_LR)


def get_batch(data_dir: str, batch_size: int, block_size: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # A new memmap per batch, as nanoGPT does (it avoids a memory leak there).
    data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device.type == "cuda":  # pinned, so that the copy overlaps the queued work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def train(args: argparse.Namespace) -> dict:
    """`args.iters` optimizer steps; each one's wall time and loss."""
    device = torch.device(args.device)
    torch.manual_seed(SEED)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float16
    ctx = torch.autocast(device_type="cuda", dtype=dtype) if cuda else nullcontext()
    config = GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config).to(device)
    scaler = torch.amp.GradScaler(device.type, enabled=cuda and dtype == torch.float16)
    optimizer = model.configure_optimizers(device.type)
    if args.compile:
        model = torch.compile(model)
    times, losses = [], []
    X, Y = get_batch(args.data, args.batch_size, args.block_size, device)
    t0 = time.time()
    for it in range(args.iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        with ctx:
            _, loss = model(X, Y)
        X, Y = get_batch(args.data, args.batch_size, args.block_size, device)  # while the GPU runs the forward
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item()  # nanoGPT's log line: the iteration's one host sync
        t1 = time.time()
        times.append(t1 - t0)
        losses.append(lossf)
        t0 = t1
        print(f"iter {it}: loss {lossf:.4f}, time {times[-1] * 1000:.2f}ms", flush=True)
    return {"step_times": times, "losses": losses, "tokens_per_iter": args.batch_size * args.block_size,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "compile": args.compile,
            "autocast": str(dtype).removeprefix("torch.") if cuda else None,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a directory holding train.bin")
    parser.add_argument("--out", required=True, help="RESULT.json")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    result = train(args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
