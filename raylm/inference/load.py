"""A trained checkpoint, found and checked, as a plain single-process model with its tokenizer and
config (local or s3:// checkpoints and runs): what generation, evaluation and export start from."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import warnings
from typing import Iterator, Optional

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raylm.config import CONFIG_FILE, Config, ConfigError, StorageConfig, saved_config
from raylm.data import storage
from raylm.model.sizes import count_params
from raylm.model.transformer import Transformer
from raylm.data.tokenizer import TOKENIZER_FILE, Tokenizer, tokenizer_from_json
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.resume import read_saved_config
from raylm.train.checkpoint.metadata import METADATA_FILE, read_metadata


def resolve_checkpoint(uri: str, storage_cfg: Optional[StorageConfig] = None, announce: bool = True,
                       checksums: bool = False) -> str:
    """A checkpoint directory, or the newest complete one inside a run directory (local or s3://),
    by its manifest and files' sizes; with `checksums`, also by every file's sha256, read where it
    lies: for a driver that picks the checkpoint its workers load (`sound_checkpoint` checks the
    copy it loads). A checkpoint named directly that fails its checksum raises CheckpointError."""
    for resolved in _candidates(uri, storage_cfg, announce):
        problem = _checksum_problem(resolved, storage_cfg) if checksums else None
        if problem and resolved == uri:
            raise checkpoint.CheckpointError(f"checkpoint {uri} cannot be used: {problem}")
        if problem:
            if announce:
                _pass_over(resolved, problem)
            continue
        if announce and resolved != uri:
            print(f"raylm: using checkpoint {resolved}", file=sys.stderr, flush=True)
        return resolved
    raise _none_usable(uri)


def _checksum_problem(uri: str, storage_cfg: Optional[StorageConfig]) -> Optional[str]:
    """The first file of the checkpoint at `uri` that does not match its manifest's size and sha256."""
    try:
        manifest = checkpoint.read_manifest(uri, storage_cfg)
    except checkpoint.CheckpointError as e:
        return str(e)
    return next(filter(None, (checkpoint.file_problem(uri, name, entry, storage_cfg)
                              for name, entry in manifest.items())), None)


def _pass_over(candidate: str, problem: str) -> None:
    print(f"raylm: passing over {candidate}: {problem}", file=sys.stderr, flush=True)


def _none_usable(run_uri: str) -> FileNotFoundError:
    return FileNotFoundError(f"{run_uri}: no checkpoint of this run can be used (each one passed over above)")


def _candidates(uri: str, storage_cfg: Optional[StorageConfig], announce: bool = True) -> Iterator[str]:
    """`uri` if it is a checkpoint; else the complete checkpoints of the run directory `uri`,
    newest first, each finished one passed over named with its reason (if `announce`). Raises
    when there is none."""
    storage.refuse_file(uri, "a checkpoint directory, or a run directory that holds checkpoints")
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    if checkpoint.is_checkpoint_name(name) or storage.exists(storage.join(uri, checkpoint.TRAIN_STATE), storage_cfg):
        yield uri  # a checkpoint, whole or not: check_sound says what is wrong with it
        return
    problems, found = [], False
    for candidate in checkpoint.checkpoint_uris(uri, storage_cfg):
        if not storage.exists(storage.join(candidate, checkpoint.MANIFEST), storage_cfg):
            problems.append((candidate, f"no {checkpoint.MANIFEST} (the save did not finish)"))
            continue  # an unfinished save never claimed to be whole: passed over silently
        problem = checkpoint.incomplete_reason(candidate, storage_cfg)
        if problem is None:
            found = True
            yield candidate
        else:
            problems.append((candidate, problem))
            if announce:
                _pass_over(candidate, problem)
    if not found:
        why = "".join(f"\n  {name}: {problem}" for name, problem in problems)
        raise FileNotFoundError(f"{uri} is neither a checkpoint nor a run directory holding a complete one" +
                                (f"; its checkpoints cannot be used:{why}" if why else ""))


@contextlib.contextmanager
def sound_checkpoint(uri: str, storage_cfg: Optional[StorageConfig] = None) -> Iterator[tuple[str, str]]:
    """The checkpoint `uri`, or the newest one of the run directory `uri` whose every file matches
    its manifest's checksum, as (its uri, a local directory holding it); in a run directory a
    damaged newer one is passed over, named with the reason, and the one used is named."""
    for candidate in _candidates(uri, storage_cfg):
        is_run = candidate != uri
        with local_checkpoint(candidate, storage_cfg) as directory:
            if not is_run:
                checkpoint.check_sound(directory, candidate, require_manifest=True)
            elif problem := checkpoint.local_problem(directory):  # a run's candidates have their manifest
                _pass_over(candidate, problem)
                continue
            if is_run:
                print(f"raylm: using checkpoint {candidate}", file=sys.stderr, flush=True)
            yield candidate, directory
            return
    raise _none_usable(uri)


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
    with sound_checkpoint(uri, storage_cfg) as (resolved, directory):
        try:
            cfg = saved_config(read_saved_config(directory))
        except ConfigError as e:
            raise ConfigError(f"{uri}: the checkpoint's {CONFIG_FILE} cannot be used: {e}") from e
        model = _build_model(cfg, directory, resolved)
        checkpoint.load_model_weights(directory, model, check=False)
        tokenizer = read_checkpoint_tokenizer(directory, resolved)
    model.eval()
    return model, tokenizer, cfg


def read_checkpoint_tokenizer(directory: str, uri: str, storage_cfg: Optional[StorageConfig] = None) -> Tokenizer:
    """The tokenizer saved in the checkpoint `directory` (a local copy of `uri`, or `uri` itself;
    `uri` names it in errors)."""
    data = storage.read_bytes(storage.join(directory, TOKENIZER_FILE), storage_cfg)
    try:
        return tokenizer_from_json(data.decode("utf-8"), name=storage.join(uri, TOKENIZER_FILE))
    except ValueError as e:  # not UTF-8, not JSON, not a tokenizer
        raise checkpoint.CheckpointError(f"{uri}: its {TOKENIZER_FILE} cannot be used: {e}") from None


def _build_model(cfg: Config, directory: str, uri: str) -> Transformer:
    """The model the saved config describes, built only when the checkpoint's tensors can fill
    it: a config.yaml that claims more parameters than were saved (corrupt, or forged along with
    the manifest) must not make this process allocate them."""
    with open(os.path.join(directory, METADATA_FILE), "rb") as f:
        entries = read_metadata(f.read()).state_dict_metadata  # parsed once already by check_sound
    saved = sum(math.prod(e.size) for name, e in entries.items()
                if name.startswith("model.") and isinstance(e, TensorStorageMetadata))
    m = cfg.model
    # The one allocation the saved tensors do not bound: the RoPE table, max_seq_len x head_dim.
    rope_bytes = 4 * m.max_seq_len * (m.d_model // max(1, m.n_heads)) if m.pos_embedding == "rope" else 0
    available = _available_memory()
    if available is not None and 2 * rope_bytes > available:
        raise checkpoint.CheckpointError(
            f"{uri}: its {CONFIG_FILE} gives model.max_seq_len={m.max_seq_len:,}, whose RoPE table needs "
            f"{rope_bytes / 2**30:,.1f} GiB, more than half this machine's available memory "
            f"({available / 2**30:,.1f} GiB): the config does not belong to these weights")
    try:
        claimed = count_params(m)
        if claimed <= saved:
            return Transformer(m)
    except (ValueError, ArithmeticError, RuntimeError, MemoryError) as e:  # sizes no model can have
        raise checkpoint.CheckpointError(f"{uri}: the model its {CONFIG_FILE} describes cannot be built "
                                         f"({type(e).__name__}: {str(e)[:200]})") from None
    raise checkpoint.CheckpointError(f"{uri}: its {CONFIG_FILE} describes a model of {claimed:,} parameters, "
                                     f"its tensors hold {saved:,}: the config does not belong to these weights")


def _available_memory() -> Optional[int]:
    """Bytes the kernel says can be allocated without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
