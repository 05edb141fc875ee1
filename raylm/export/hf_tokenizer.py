"""Tokenizer files for a Hugging Face model directory, and back.

A raylm tokenizer of kind "hf" already is a Hugging Face tokenizer.json. The byte tokenizer
(ids 0..255 are UTF-8 bytes, 256 is <|endoftext|>) is written as its exact Hugging Face
equivalent: a byte-level BPE without merges whose vocabulary maps each byte's GPT-2 character
to the byte's value, so `AutoTokenizer` encodes any text to the same ids.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Optional

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from raylm.config import StorageConfig
from raylm.data import storage
from raylm.data.tokenizer import EOT_TOKEN, ByteTokenizer, Tokenizer, bytes_to_unicode, tokenizer_from_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@lru_cache(maxsize=1)
def _byte_vocab() -> dict[str, int]:
    return {char: b for b, char in bytes_to_unicode().items()}


def byte_tokenizer_json() -> str:
    """The Hugging Face tokenizer.json equivalent of raylm's byte tokenizer."""
    hf = tokenizers.Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(EOT_TOKEN, special=True)])  # id 256, after the 256 bytes
    return hf.to_str()


def is_byte_equivalent(json_text: str) -> bool:
    """Whether a tokenizer.json is the byte tokenizer's equivalent (as `byte_tokenizer_json` writes)."""
    spec = json.loads(json_text)
    model = spec.get("model") or {}
    added = [(t.get("id"), t.get("content")) for t in spec.get("added_tokens") or []]
    return (model.get("type") == "BPE" and not model.get("merges") and model.get("vocab") == _byte_vocab()
            and added == [(256, EOT_TOKEN)])


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    return byte_tokenizer_json() if isinstance(tokenizer, ByteTokenizer) else tokenizer.to_json()


def write_tokenizer_files(directory: str, tokenizer: Tokenizer, max_seq_len: int,
                          storage_cfg: Optional[StorageConfig] = None) -> list[str]:
    """tokenizer.json and tokenizer_config.json (a fast tokenizer; raylm adds no BOS, and
    separates documents with its end-of-text token)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eot_token,
              "bos_token": tokenizer.eot_token, "model_max_length": max_seq_len,
              "clean_up_tokenization_spaces": False}
    storage.write_bytes(storage.join(directory, TOKENIZER_FILE), hf_tokenizer_json(tokenizer).encode(), storage_cfg)
    storage.write_bytes(storage.join(directory, TOKENIZER_CONFIG_FILE), json.dumps(config, indent=2).encode(),
                        storage_cfg)
    return [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]


def read_hf_tokenizer(json_text: str, name: str) -> Tokenizer:
    """The raylm tokenizer of a Hugging Face tokenizer.json: the byte tokenizer when it is the
    byte tokenizer's equivalent (so data prepared with `--tokenizer byte` matches it)."""
    return ByteTokenizer() if is_byte_equivalent(json_text) else tokenizer_from_json(json_text, name=name)
