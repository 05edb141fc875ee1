"""The reference for benchmarks/nanogpt_shakespeare.py: nanoGPT's model.py and train.py, as run by
nanoGPT's README on a CPU, rewritten independently of raylm (nothing here imports raylm or Ray).

    python benchmarks/_nanogpt_reference.py --data DIR --out RESULT.json [--iters 2000]

which stands for nanoGPT's

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

DIR holds nanoGPT's data/shakespeare_char output: train.bin and val.bin (uint16 character ids)
and meta.json (its vocabulary size). What nanoGPT does is kept, costs included: a memmap opened
per batch, an evaluation of both splits every 250 iterations (the first at iteration 0), a
checkpoint whenever the val loss improves, `loss.item()` and a log line every iteration, and
max_iters + 1 optimizer steps. RESULT.json gets each iteration's time and loss, the evaluations,
and the wall-clock times of the first and last iteration; the final weights go beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# nanoGPT's config/train_shakespeare_char.py with the README's CPU overrides.
N_LAYER, N_HEAD, N_EMBD, BLOCK_SIZE, BATCH_SIZE, DROPOUT, BIAS = 4, 4, 128, 64, 12, 0.0, False
LEARNING_RATE, WEIGHT_DECAY, BETA1, BETA2, GRAD_CLIP = 1e-3, 1e-1, 0.9, 0.99, 1.0
WARMUP_ITERS, MIN_LR, EVAL_INTERVAL, EVAL_ITERS, SEED = 100, 1e-4, 250, 20, 1337


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's, from before torch had `bias=False`)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD, bias=BIAS)  # q, k, v in one matmul
        self.c_proj = nn.Linear(N_EMBD, N_EMBD, bias=BIAS)
        self.resid_dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=DROPOUT if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD, bias=BIAS)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD, bias=BIAS)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(N_EMBD, BIAS), CausalSelfAttention()
        self.ln_2, self.mlp = LayerNorm(N_EMBD, BIAS), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, N_EMBD), wpe=nn.Embedding(BLOCK_SIZE, N_EMBD), drop=nn.Dropout(DROPOUT),
            h=nn.ModuleList([Block() for _ in range(N_LAYER)]), ln_f=LayerNorm(N_EMBD, BIAS)))
        self.lm_head = nn.Linear(N_EMBD, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

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
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=(BETA1, BETA2))  # fused only on CUDA


def get_lr(it: int, lr_decay_iters: int) -> float:
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    if it > lr_decay_iters:
        return MIN_LR
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP_ITERS) / (lr_decay_iters - WARMUP_ITERS)))
    return MIN_LR + coeff * (LEARNING_RATE - MIN_LR)


def get_batch(data_dir: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    # A new memmap per batch, as nanoGPT does (it avoids a memory leak there).
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - BLOCK_SIZE, (BATCH_SIZE,))
    x = torch.stack([torch.from_numpy(data[i:i + BLOCK_SIZE].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + BLOCK_SIZE].astype(np.int64)) for i in ix])
    return x, y


@torch.no_grad()
def estimate_loss(model: GPT, data_dir: str) -> dict:
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(EVAL_ITERS)
        for k in range(EVAL_ITERS):
            _, loss = model(*get_batch(data_dir, split))
            losses[k] = loss.item()
        out[split] = float(losses.mean())
    model.train()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="train.bin, val.bin, meta.json")
    parser.add_argument("--out", required=True, help="RESULT.json; the final weights go beside it")
    parser.add_argument("--iters", type=int, default=2000, help="max_iters and lr_decay_iters")
    args = parser.parse_args()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(SEED)
    with open(os.path.join(args.data, "meta.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    model = GPT(vocab_size)
    optimizer = model.configure_optimizers()
    times, losses, evals = [], [], []
    best_val, first_end = 1e9, None
    X, Y = get_batch(args.data, "train")
    t0 = time.time()
    for it in range(args.iters + 1):  # nanoGPT stops once iter_num > max_iters
        lr = get_lr(it, args.iters)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % EVAL_INTERVAL == 0:
            est = estimate_loss(model, args.data)
            evals.append({"iter": it, **est})
            print(f"step {it}: train loss {est['train']:.4f}, val loss {est['val']:.4f}", flush=True)
            if est["val"] < best_val:
                best_val = est["val"]
                if it > 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": it,
                                "best_val_loss": best_val}, os.path.join(out_dir, "ckpt.pt"))
        _, loss = model(X, Y)
        X, Y = get_batch(args.data, "train")  # the next batch, while (on a GPU) the step runs
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        first_end = first_end or t1
        lossf = loss.item()
        times.append(dt)
        losses.append(lossf)
        print(f"iter {it}: loss {lossf:.4f}, time {dt * 1000:.2f}ms", flush=True)
    torch.save(model.state_dict(), os.path.join(out_dir, "final.pt"))
    with open(args.out, "w") as f:
        json.dump({"step_times": times, "losses": losses, "evals": evals, "first_step_end": first_end,
                   "last_step_end": t0, "threads": torch.get_num_threads(), "vocab_size": vocab_size}, f)


if __name__ == "__main__":
    main()
