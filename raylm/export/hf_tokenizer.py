"""Tokenizer files for a Hugging Face model directory, and back.

A raylm tokenizer of kind "hf" already is a Hugging Face tokenizer.json. The byte tokenizer
(ids 0..255 are UTF-8 bytes, 256 is <|endoftext|>) is written as its exact Hugging Face
equivalent (`raylm.data.tokenizer.byte_tokenizer_json`), which `named_tokenizer` reads back as
the byte tokenizer: an import and a `raylm prepare --tokenizer` of the exported directory.
"""

from __future__ import annotations

import json
from typing import Optional

from raylm.config import StorageConfig
from raylm.data import storage
from raylm.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, Tokenizer, byte_tokenizer_json

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


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

