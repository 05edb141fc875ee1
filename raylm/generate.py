"""Sample text from a trained checkpoint in a single process (local or s3:// checkpoints and runs)."""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from typing import Iterator, Optional

import torch

from raylm.config import CONFIG_FILE, Config, ConfigError, StorageConfig, config_from_dict
from raylm.data import storage
from raylm.model.transformer import Transformer
from raylm.tokenizer import TOKENIZER_FILE, Tokenizer, tokenizer_from_json
from raylm.train import checkpoint
from raylm.train.resume_check import read_saved_config


def resolve_checkpoint(uri: str, storage_cfg: Optional[StorageConfig] = None) -> str:
    """A checkpoint directory, or the newest usable one inside a run directory (local or s3://)."""
    if storage.exists(storage.join(uri, checkpoint.TRAIN_STATE), storage_cfg):
        return uri
    latest = checkpoint.latest_complete(uri, storage_cfg)
    if latest is None:
        raise FileNotFoundError(f"{uri} is neither a checkpoint nor a run directory holding a complete one")
    return latest


@contextlib.contextmanager
def local_checkpoint(uri: str, storage_cfg: Optional[StorageConfig] = None) -> Iterator[str]:
    """The checkpoint at `uri` as a local directory: itself, or a temporary copy of an s3:// one
    (DCP reads files)."""
    if not storage.is_s3(uri):
        yield uri
        return
    with tempfile.TemporaryDirectory(prefix="raylm-checkpoint-") as directory:
        storage.copy_dir(uri, directory, storage_cfg)
        yield directory


def load_for_inference(uri: str, storage_cfg: Optional[StorageConfig] = None) -> tuple[Transformer, Tokenizer, Config]:
    # One process is the point here; DCP warns that it assumes so.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    resolved = resolve_checkpoint(uri, storage_cfg)
    with local_checkpoint(resolved, storage_cfg) as directory:
        checkpoint.check_sound(directory, resolved)  # every checksum, before any file is parsed
        try:
            cfg = config_from_dict(read_saved_config(directory))
        except ConfigError as e:
            raise ConfigError(f"{uri}: the checkpoint's {CONFIG_FILE} cannot be used: {e}") from e
        model = Transformer(cfg.model)
        checkpoint.load_model_weights(directory, model, check=False)
        with open(f"{directory}/{TOKENIZER_FILE}") as f:
            tokenizer = tokenizer_from_json(f.read(), name=f"{uri}/{TOKENIZER_FILE}")
    model.eval()
    return model, tokenizer, cfg


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
