"""Sample text from a trained checkpoint in a single process (local or s3:// checkpoints and runs)."""

from __future__ import annotations

from typing import Optional

from raylm.config import StorageConfig
from raylm.inference.load import load_for_inference
from raylm.model.sampling import generate


def generate_text(checkpoint_uri: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: Optional[int] = 200, seed: Optional[int] = None,
                  storage_cfg: Optional[StorageConfig] = None) -> str:
    model, tokenizer, _ = load_for_inference(checkpoint_uri, storage_cfg)
    new = generate(model, tokenizer.encode(prompt), max_new_tokens, temperature, top_k, seed, tokenizer.vocab_size)
    return tokenizer.decode(new)
