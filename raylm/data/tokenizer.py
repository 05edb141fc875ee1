"""Tokenizers: raw UTF-8 bytes, byte-level BPE trained here, or any Hugging Face tokenizer.json.

Every tokenizer serialises to one JSON text (`to_json`), which `raylm prepare` writes next to the
data so that a dataset always carries the tokenizer that made it; `sha256` fingerprints that text.

raylm alone decides where end-of-text tokens go: documents are encoded without the tokenizer's
own special tokens (a post-processor that appends </s> or prepends <s> is not applied), and
special-token strings that occur inside a document are encoded as ordinary text.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from abc import ABC, abstractmethod
from functools import cached_property, lru_cache
from itertools import chain, islice
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
import pyarrow.fs as pafs
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from raylm.config import ConfigError, StorageConfig
from raylm.data.corpus import Source, builtin_sources, check_sources, find_sources, iter_documents
from raylm.data.storage import StorageError, exists, filesystem_for, is_s3, join, read_bytes, write_bytes
from raylm.progress import Progress

EOT_TOKEN = "<|endoftext|>"
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""End-of-text tokens recognised in a Hugging Face tokenizer, in order of preference."""
BYTE_FORMAT = "raylm.byte/1"
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ConfigError):
    """A tokenizer file that cannot be used; the message names it."""


class Tokenizer(ABC):
    kind: str
    """"byte" or "hf"."""
    name: str
    vocab_size: int
    """One more than the largest token id."""
    eot_id: int
    eot_token: str

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens appear as their strings."""

    @abstractmethod
    def to_json(self) -> str:
        """The tokenizer as JSON text; `tokenizer_from_json` reads it back."""

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, uri: str, storage: Optional[StorageConfig] = None) -> None:
        write_bytes(uri, self.to_json().encode("utf-8"), storage)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, "
                f"eot={self.eot_token!r}:{self.eot_id})")


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes of the text, 256 is <|endoftext|>: no training, no
    unknown tokens, exact round trip of any text."""

    kind = "byte"

    def __init__(self) -> None:
        self.name = "byte"
        self.eot_token = EOT_TOKEN
        self.eot_id = 256
        self.vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif i == self.eot_id:
                out += self.eot_token.encode("utf-8")
            else:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary "
                                 f"0..{self.vocab_size - 1}")
        # Sampled ids can cut a multi-byte character: show U+FFFD rather than fail.
        return out.decode("utf-8", errors="replace")

    def to_json(self) -> str:
        spec = {"format": BYTE_FORMAT, "special_tokens": {EOT_TOKEN: self.eot_id},
                "vocab_size": self.vocab_size}
        return json.dumps(spec, indent=2, sort_keys=True) + "\n"


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer, from the text of its tokenizer.json."""

    kind = "hf"

    def __init__(self, json_text: str, name: str = "hf") -> None:
        self.name = name
        self._json = json_text
        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(json_text)
        except Exception as e:
            raise TokenizerError(f"tokenizer {name}: not a valid Hugging Face tokenizer.json ({e})") from None
        # A document that contains "</s>" or "<|endoftext|>" as text must not end early.
        self._tokenizer.encode_special_tokens = True
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        found = [token for token in EOT_CANDIDATES if token in vocab]
        if not found:
            raise TokenizerError(f"tokenizer {name} has no end-of-text token: none of "
                             f"{', '.join(EOT_CANDIDATES)} is in its vocabulary; add one as a "
                             f"special token")
        self.eot_token = found[0]
        self.eot_id = vocab[self.eot_token]

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self._json


def _json_spec(json_text: str, name: str):
    try:
        return json.loads(json_text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"tokenizer {name}: not valid JSON ({e})") from None


def tokenizer_from_json(json_text: str, name: str = "tokenizer") -> Tokenizer:
    """A tokenizer from the text that `Tokenizer.to_json` (or Hugging Face) wrote."""
    spec = _json_spec(json_text, name)
    if isinstance(spec, dict) and spec.get("format") == BYTE_FORMAT:
        return ByteTokenizer()
    return HFTokenizer(json_text, name=name)


@lru_cache(maxsize=1)
def _byte_vocab() -> dict[str, int]:
    return {char: b for b, char in bytes_to_unicode().items()}


def byte_tokenizer_json() -> str:
    """The Hugging Face tokenizer.json equivalent of the byte tokenizer (what `raylm export` writes
    for it): a byte-level BPE without merges whose vocabulary maps each byte's GPT-2 character to
    the byte's value, so `AutoTokenizer` encodes any text to the same ids."""
    hf = tokenizers.Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(EOT_TOKEN, special=True)])  # id 256, after the 256 bytes
    return hf.to_str()


def named_tokenizer(json_text: str, name: str) -> Tokenizer:
    """A tokenizer.json a user names (`--tokenizer`, a Hugging Face model's): the byte tokenizer
    where it is that tokenizer's equivalent (`byte_tokenizer_json`), so that data prepared with an
    exported byte model's tokenizer and the model imported from it carry the same fingerprint.
    Files raylm wrote for itself (a dataset's, a checkpoint's) are read by `tokenizer_from_json`
    as they were written: runs and manifests recorded their fingerprints."""
    spec = _json_spec(json_text, name)
    model = (spec.get("model") or {}) if isinstance(spec, dict) else {}
    if (model.get("type") == "BPE" and not model.get("merges") and model.get("vocab") == _byte_vocab()
            and [(t.get("id"), t.get("content")) for t in spec.get("added_tokens") or []] == [(256, EOT_TOKEN)]):
        return ByteTokenizer()
    return tokenizer_from_json(json_text, name=name)


def load_tokenizer(spec: str, storage: Optional[StorageConfig] = None) -> Tokenizer:
    """`"byte"`, or the path/URI of a tokenizer.json (or of a directory holding one, such as a
    prepared dataset or a Hugging Face model snapshot)."""
    if spec == "byte":
        return ByteTokenizer()
    fs, path = filesystem_for(spec, storage)
    uri = join(spec, TOKENIZER_FILE) if fs.get_file_info(path).type == pafs.FileType.Directory else spec
    try:
        data = read_bytes(uri, storage)
    except StorageError:
        raise StorageError(f"tokenizer {uri} not found; give 'byte' or the path/URI of a "
                           f"tokenizer.json") from None
    return named_tokenizer(data.decode("utf-8"), name=uri)


# Past the largest vocabularies in use (256k); the trainer allocates for the size asked before it
# reads a byte, and a mistyped 10^10 aborted the process in Rust.
MAX_VOCAB_SIZE = 1 << 20


def train_bpe(input_uris: list[str], vocab_size: int, output_uri: str,
              storage: Optional[StorageConfig] = None, lines_as_documents: bool = False,
              max_documents: Optional[int] = None, overwrite: bool = False) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization, <|endoftext|> special)
    on the documents of `input_uris` (the built-in corpus when empty), write its tokenizer.json
    to `output_uri` and return it. `vocab_size` counts the 256 bytes and <|endoftext|>. An
    existing `output_uri` is refused unless `overwrite`, before any training."""
    if vocab_size <= 257:
        raise ConfigError(f"vocab_size must exceed 257 (256 bytes + {EOT_TOKEN}), got {vocab_size}; "
                          f"use the 'byte' tokenizer for a byte vocabulary")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ConfigError(f"vocab_size must be at most {MAX_VOCAB_SIZE:,}, got {vocab_size:,}")
    if not is_s3(output_uri) and os.path.isdir(output_uri):
        raise ConfigError(f"{output_uri} is a directory: give the path of the tokenizer.json to write")
    if not overwrite and exists(output_uri, storage):
        raise FileExistsError(f"{output_uri} already exists; pass --overwrite to replace it")
    if input_uris:
        sources = check_sources(find_sources(input_uris, lines_as_documents, storage), storage)
    else:
        sources = builtin_sources(max_documents)
    progress = Progress("tokenizer train: reading", len(sources), "files")

    def read(source: Source) -> Iterator[str]:
        yield from iter_documents(source, storage)
        progress.update()

    def documents() -> Iterator[str]:
        for document in islice(chain.from_iterable(map(read, sources)), max_documents):
            progress.update(0, documents=1)
            yield document
        progress.close()
        # The merges are computed after the last document, in Rust, with nothing to count them by.
        print(f"raylm: tokenizer train: computing the merges of {vocab_size:,} tokens", flush=True)

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(documents(), trainer=trainer)
    tokenizer = HFTokenizer(bpe.to_str(), name=output_uri)
    tokenizer.save(output_uri, storage)
    return tokenizer


# ----------------------------------------------------------------------------- bits per byte


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (the characters
    byte-level BPE vocabularies are written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, map(chr, printable))), 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(chars.items()))


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for, (vocab_size,) int64; 0 for special tokens.

    Byte-level BPE vocabularies spell each token in GPT-2's byte alphabet, one character per
    byte, so a token's length is exact even when it holds part of a multi-byte character.
    Other tokenizers are measured by decoding the token alone.
    """
    lengths = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    if isinstance(tokenizer, ByteTokenizer):
        lengths[:256] = 1
        return lengths
    spec = json.loads(tokenizer.to_json())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    alphabet = set(bytes_to_unicode().values())
    vocab = spec.get("model", {}).get("vocab", {})
    pieces = vocab.items() if isinstance(vocab, dict) else ((piece, i) for i, (piece, _) in enumerate(vocab))
    for piece, i in pieces:
        if byte_level and all(c in alphabet for c in piece):
            lengths[i] = len(piece)
        else:
            lengths[i] = len(tokenizer.decode([i]).encode("utf-8"))
    for added in spec.get("added_tokens") or []:
        lengths[added["id"]] = 0 if added.get("special") else len(added["content"].encode("utf-8"))
    return lengths


def bits_per_byte(nats: float, n_bytes: int) -> float:
    return nats / (math.log(2) * n_bytes)
