"""Autoregressive sampling from any function of token ids to logits: a plain model, or a sharded
one that every rank calls with the same ids."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from raylm.model.transformer import Transformer


@torch.no_grad()
def generate(model: Transformer | Callable[[torch.Tensor], torch.Tensor], prompt_ids: list[int],
             max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None, seed: Optional[int] = None,
             vocab_size: Optional[int] = None, max_len: Optional[int] = None,
             stop: Optional[Callable[[list[int]], bool]] = None) -> list[int]:
    """Autoregressive sampling; temperature 0 is greedy. `vocab_size`: the tokenizer's, when the
    model's embedding is padded beyond it (those ids decode to nothing and are never sampled).
    `model` may be any function of (1, T) ids to logits given `max_len` (the context it takes);
    `stop(new_ids)` ends the generation early when it returns True."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    max_len = max_len or model.cfg.max_seq_len
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -max_len:])[:, -1, :vocab_size].float()  # (1, V)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, nxt.to(ids.device)], dim=1)
        if stop is not None and stop(ids[0, len(prompt_ids):].tolist()):
            break
    return ids[0, len(prompt_ids):].tolist()
