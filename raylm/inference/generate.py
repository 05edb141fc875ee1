"""Sample text from a trained checkpoint in a single process (local or s3:// checkpoints and runs)."""

from __future__ import annotations

from typing import Optional

import torch

from raylm.config import StorageConfig
from raylm.inference.load import load_for_inference
from raylm.model.transformer import Transformer


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, seed: Optional[int] = None, vocab_size: Optional[int] = None) -> list[int]:
    """Autoregressive sampling; temperature 0 is greedy. `vocab_size`: the tokenizer's, when the
    model's embedding is padded beyond it (those ids decode to nothing and are never sampled)."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    max_len = model.cfg.max_seq_len
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
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def generate_text(checkpoint_uri: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: Optional[int] = 200, seed: Optional[int] = None,
                  storage_cfg: Optional[StorageConfig] = None) -> str:
    model, tokenizer, _ = load_for_inference(checkpoint_uri, storage_cfg)
    new = generate(model, tokenizer.encode(prompt), max_new_tokens, temperature, top_k, seed, tokenizer.vocab_size)
    return tokenizer.decode(new)
