"""Sample text from a trained checkpoint in a single process."""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from raylm.config import Config, load_config
from raylm.model.transformer import Transformer
from raylm.tokenizer import Tokenizer, load_tokenizer
from raylm.train import checkpoint


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, or the latest complete one inside a run directory."""
    if os.path.exists(os.path.join(path, checkpoint.TRAIN_STATE)):
        return path
    latest = checkpoint.latest_complete(path)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory holding a complete one")
    return latest


def load_for_inference(path: str) -> tuple[Transformer, Tokenizer, Config]:
    # One process is the point here; DCP warns that it assumes so.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    directory = resolve_checkpoint(path)
    cfg = load_config(os.path.join(directory, checkpoint.CONFIG))
    model = Transformer(cfg.model)
    checkpoint.load_model_weights(directory, model)
    model.eval()
    return model, load_tokenizer(os.path.join(directory, checkpoint.TOKENIZER)), cfg


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, seed: Optional[int] = None) -> list[int]:
    """Autoregressive sampling; temperature 0 is greedy."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    max_len = model.cfg.max_seq_len
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -max_len:])[:, -1, :].float()  # (1, V)
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


def generate_text(checkpoint_path: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: Optional[int] = 200, seed: Optional[int] = None) -> str:
    model, tokenizer, _ = load_for_inference(checkpoint_path)
    new = generate(model, tokenizer.encode(prompt), max_new_tokens, temperature, top_k, seed)
    return tokenizer.decode(new)
