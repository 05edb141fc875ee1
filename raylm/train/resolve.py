"""Fill in what a config leaves to the data (vocabulary size, sequence length) and refuse
what contradicts it."""

from __future__ import annotations

import dataclasses

from raylm.config import Config, ConfigError
from raylm.data.manifest import Manifest


def padded_vocab(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def resolve_for_data(cfg: Config, manifest: Manifest) -> Config:
    """`cfg` with model.vocab_size and train.seq_len set from the prepared dataset."""
    m, t = cfg.model, cfg.train
    vocab = padded_vocab(manifest.vocab_size, m.vocab_multiple) if m.vocab_size is None else m.vocab_size
    if vocab < manifest.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the dataset's tokenizer vocabulary "
            f"({manifest.vocab_size}, tokenizer {manifest.tokenizer.kind} {manifest.tokenizer.sha256[:12]}); "
            "set it to null to take the dataset's, or re-prepare the data with the model's tokenizer")
    if t.seq_len is not None and t.seq_len != manifest.seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} but the dataset was packed with seq_len="
                          f"{manifest.seq_len}; re-run `raylm prepare --seq-len {t.seq_len}` or drop the key")
    if manifest.seq_len > m.max_seq_len:
        raise ConfigError(f"the dataset's seq_len ({manifest.seq_len}) exceeds model.max_seq_len "
                          f"({m.max_seq_len})")
    return dataclasses.replace(cfg, model=dataclasses.replace(m, vocab_size=vocab),
                               train=dataclasses.replace(t, seq_len=manifest.seq_len))
