"""The checkpoint format: sharded torch.distributed.checkpoint (DCP) state plus what resuming needs.

A checkpoint directory, `checkpoint_<step, 8 digits>`, holds
- the DCP shards of {"model", "optim"} (each rank writes `__<rank>_<n>.distcp`) and rank 0's
  `.metadata` index;
- `rng/rank_<rank>.pt`: each rank's RNG states as plain tensors and numbers;
- from rank 0: `train_state.json` (step, data position, tokenizer hash, world size) and the
  `files` the loop hands over (`config.yaml`, `tokenizer.json`);
- `checkpoint_manifest.json`, written by `finalize` once every other file is published: each
  file's size and sha256, and the sha256 of each of its blocks (`integrity.block_bytes` long). A
  directory without it is an unfinished save, never resumed from.

Reading never runs code from storage, and a rank reads only what it loads: in `load`, rank 0
reads the manifest, the train state and DCP's metadata for every rank, and each rank its RNG
file, each checked whole against the manifest, then the blocks of the shards its load plan needs,
each checked before anything in it is deserialized (`raylm.train.checkpoint.blocks`). DCP's
metadata goes through a restricted unpickler (`raylm.train.checkpoint.metadata`), its state and
the RNG file through `torch.load(weights_only=True)` (`raylm.train.checkpoint.safe_load`).
Discovery (`scan`, `latest_complete`) is cheap: every file's size, checksums of the small files it
parses; choosing the checkpoint to resume from is `raylm.train.checkpoint.resume`'s. Generation
and export read whole checkpoints and check every file first (`check_sound`).

torch is imported by the functions that read or write state, not by this module nor by
discovery: the driver, `raylm status` and `raylm checkpoint verify` look for checkpoints without it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from raylm.config import StorageConfig
from raylm.data import storage
from raylm.train.checkpoint.errors import CheckpointError, CheckpointWriteError, CorruptCheckpointError
from raylm.train.checkpoint.integrity import (MANIFEST, FileEntry, checked_bytes, file_entry, file_problem,
                                              parse_manifest, read_file, read_manifest)
from raylm.train.checkpoint.metadata import METADATA_FILE, read_metadata, shard_files

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    from raylm.parallel.world import World
    from raylm.train.step import ParallelModel

PREFIX = "checkpoint_"
TRAIN_STATE = "train_state.json"
_MAX_RANKS = 1 << 20  # far beyond any world size; a train_state.json claiming more is corrupt


def dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def is_checkpoint_name(name: str) -> bool:
    """Ours, not another file that starts alike (Ray keeps checkpoint_manager_snapshot.json)."""
    return re.fullmatch(rf"{PREFIX}\d{{8}}", name) is not None


def step_of(name: str) -> Optional[int]:
    """The step of a checkpoint directory's name; None for a name that is not one."""
    return int(name[len(PREFIX):]) if is_checkpoint_name(name) else None


# ----------------------------------------------------------------------------- files and hashes

def _rng_name(rank: int) -> str:
    return f"rng/rank_{rank:05d}.pt"


def _owner(name: str) -> int:
    """The rank that writes `name`: DCP names each rank's shards `__<rank>_<n>.distcp`."""
    m = re.fullmatch(r"__(\d+)_\d+\.distcp|rng/rank_(\d+)\.pt", name)
    return int(m.group(1) or m.group(2)) if m else 0


def own_entries(directory: str, rank: int) -> dict[str, FileEntry]:
    """Size, sha256 and block hashes of the files of `directory` that `rank` wrote (ranks may share it)."""
    return {name: file_entry(os.path.join(directory, name))
            for name in storage.list_files(directory) if _owner(name) == rank and name != MANIFEST}


# ----------------------------------------------------------------------------- save and load

def _state_dict_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Optimizer state flattened to one entry per parameter name ("state.layers.0.w.exp_avg",
    # "param_groups.layers.0.w.lr"): pipeline stages hold different parameters, and only per-name
    # entries let any layout (or a single process) load any other's.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _states(model: "ParallelModel", optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from raylm.parallel.float8 import plain_weights

    # model.model spans all of this rank's parts (pipeline chunks) under the plain model's names.
    model_sd, optim_sd = get_state_dict(model.model, optimizer, options=_state_dict_options())
    return plain_weights(model_sd), optim_sd


def _then(future: Future, fn) -> Future:
    """A future of `fn()` run on a thread once `future` has succeeded (its error otherwise)."""
    out: Future = Future()

    def run() -> None:
        try:
            future.result()
            out.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(e)
    threading.Thread(target=run, name="raylm-checkpoint-hash", daemon=True).start()
    return out


def save(directory: str, model: "ParallelModel", optimizer: torch.optim.Optimizer, world: "World",
         train_state: dict, files: dict[str, str], asynchronous: bool = False,
         async_group: Optional[dist.ProcessGroup] = None) -> Future:
    """Write this rank's part of the checkpoint into `directory` (called on every rank); rank 0
    adds the train state and `files` (name -> text: the config, the tokenizer).

    Returns a future of this rank's `FileEntry`s; `finalize` on rank 0 turns every rank's into
    the manifest. `asynchronous`: the tensors are staged in memory and written and hashed on
    background threads (DCP async_save, its collectives on `async_group`).
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from raylm.train.checkpoint.blocks import SavePlanner
    from raylm.train.checkpoint.safe_load import rng_state

    model_sd, optim_sd = _states(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if asynchronous:
        written = dcp.async_save(state, checkpoint_id=directory, process_group=async_group,
                                 no_dist=not dist.is_initialized(), planner=SavePlanner())
    else:
        dcp.save(state, checkpoint_id=directory, planner=SavePlanner())
    rng = os.path.join(directory, _rng_name(world.rank))
    os.makedirs(os.path.dirname(rng), exist_ok=True)
    torch.save(rng_state(), rng)
    if world.rank == 0:
        for name, text in files.items():
            with open(os.path.join(directory, name), "w") as f:
                f.write(text)
        state = {**train_state, "world_size": world.world_size, "dp_size": model.dp_size}
        with open(os.path.join(directory, TRAIN_STATE), "w") as f:
            json.dump(state, f, indent=1)
    if asynchronous:  # hashed once written, off the training thread
        return _then(written, lambda: own_entries(directory, world.rank))
    done: Future = Future()
    done.set_result(own_entries(directory, world.rank))
    return done


def finalize(uri: str, entries: dict[str, FileEntry], storage_cfg: Optional[StorageConfig] = None,
             extra: Optional[dict] = None) -> None:
    """Write the manifest of the published checkpoint at `uri` from every rank's `entries`,
    after checking that each file arrived whole (its size) and nothing DCP needs is missing.
    Written last: only then is the checkpoint a candidate for resuming. `extra`: more fields."""
    manifest = {"files": {name: vars(e) for name, e in sorted(entries.items())}, **(extra or {})}
    problem = _problem(uri, storage_cfg, checksums=False, manifest=entries)
    if problem:
        raise CheckpointWriteError(f"checkpoint {uri} is incomplete after publishing: {problem}")
    storage.write_bytes(storage.join(uri, MANIFEST), json.dumps(manifest, indent=1).encode(), storage_cfg)


def local_problem(directory: str) -> Optional[str]:
    """`_problem` with every checksum for a local directory (none needed without a manifest,
    a `save` nobody finalized, as in tests that save and load in place: it must be whole)."""
    return _problem(directory, None, checksums=True, require_manifest=os.path.exists(os.path.join(directory, MANIFEST)))


def check_sound(directory: str, name: Optional[str] = None, require_manifest: bool = False) -> None:
    """Raise CheckpointError unless the local checkpoint `directory` (called `name` in the
    message, e.g. the s3:// URI it was copied from) is whole and every file matches its
    manifest's size and sha256. `require_manifest`: for readers of finished checkpoints
    (generate, export), a directory without one is an unfinished save, checked against nothing."""
    if require_manifest and not os.path.exists(os.path.join(directory, MANIFEST)):
        raise CheckpointError(f"checkpoint {name or directory} cannot be used: no {MANIFEST} (the save did not finish)")
    problem = local_problem(directory)
    if problem:
        raise CheckpointError(f"checkpoint {name or directory} cannot be used: {problem}")


@dataclass
class _Shared:
    """What every rank reads of a checkpoint before its state, checked against the manifest."""

    manifest: Optional[dict[str, FileEntry]]  # None: a save nobody finalized (tests that load in place)
    state: dict
    metadata: Metadata


def _read_shared(uri: str, storage_cfg: Optional[StorageConfig]) -> tuple[Optional[bytes], bytes, bytes]:
    """The manifest (None without one), train state and DCP metadata, as checked bytes."""
    raw_manifest = None
    with contextlib.suppress(storage.StorageNotFoundError):
        raw_manifest = read_file(storage.join(uri, MANIFEST), storage_cfg)
    manifest = parse_manifest(raw_manifest) if raw_manifest is not None else None
    return (raw_manifest, checked_bytes(uri, TRAIN_STATE, manifest, storage_cfg),
            checked_bytes(uri, METADATA_FILE, manifest, storage_cfg))


def _parse_shared(uri: str, raw: tuple[Optional[bytes], bytes, bytes], world_size: int,
                  storage_cfg: Optional[StorageConfig]) -> _Shared:
    """`_read_shared`'s files parsed, and every file they name there (the shards; each rank's RNG
    file, in the same world size)."""
    raw_manifest, raw_state, raw_metadata = raw
    manifest = parse_manifest(raw_manifest) if raw_manifest is not None else None
    state = _parse_train_state(raw_state)
    try:
        metadata = read_metadata(raw_metadata)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{METADATA_FILE} is not valid DCP metadata: {e}") from e
    present = set(manifest) if manifest is not None else set(storage.list_files(uri, storage_cfg))
    needed = {info.relative_path for info in (metadata.storage_data or {}).values()}
    if state["world_size"] == world_size:
        needed |= {_rng_name(r) for r in range(world_size)}
    if missing := sorted(needed - present):
        raise CheckpointError(f"missing {', '.join(missing[:5])}")
    return _Shared(manifest, state, metadata)


def _shared(uri: str, world: "World", storage_cfg: Optional[StorageConfig]) -> _Shared:
    """What every rank needs of the checkpoint at `uri`, read from storage once: by rank 0, and
    broadcast (on 992 ranks of OPT-175B, DCP's metadata alone is some 400 MB). Raises
    CorruptCheckpointError on every rank when rank 0 finds it wrong."""
    import torch.distributed as dist

    raw, shared, problem = None, None, None
    if world.rank == 0:
        try:
            raw = _read_shared(uri, storage_cfg)
            shared = _parse_shared(uri, raw, world.world_size, storage_cfg)
        except CheckpointError as e:
            problem = str(e)
    if world.world_size > 1:
        box = [None, problem] if problem else [raw, None]
        dist.broadcast_object_list(box, src=0, device=world.device)
        raw, problem = box
    if problem:
        raise CorruptCheckpointError(uri, problem)
    return shared or _parse_shared(uri, raw, world.world_size, storage_cfg)


def _read_rng(uri: str, rank: int, manifest: Optional[dict[str, FileEntry]],
              storage_cfg: Optional[StorageConfig]) -> dict:
    import torch

    name = _rng_name(rank)
    try:
        return torch.load(io.BytesIO(checked_bytes(uri, name, manifest, storage_cfg)), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{name} is not an RNG state: {_first_lines(e)}") from e


def load(uri: str, model: "ParallelModel", optimizer: torch.optim.Optimizer, world: "World",
         tokenizer_sha256: str, storage_cfg: Optional[StorageConfig] = None) -> dict:
    """Restore model, optimizer and this rank's RNG from the checkpoint at `uri` (local or
    s3://), on every rank together; returns the train state.

    Each rank reads only what it loads (see the module docstring), and checks every byte before
    it is deserialized; the files every rank needs are read by rank 0 and broadcast. A checkpoint
    whose files do not match the manifest, or that lacks one it needs, raises
    CorruptCheckpointError on every rank, whichever rank found it: resuming passes over it, and
    the next checkpoint's load overwrites all that this one loaded. Another tokenizer, or state
    that cannot be read, is a CheckpointError (on every rank too)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from raylm.train.checkpoint.blocks import BlockReader
    from raylm.train.checkpoint.safe_load import set_rng_state

    shared = _shared(uri, world, storage_cfg)
    state = shared.state
    rng = None
    # A rank that did not exist at save time (a larger world) keeps its freshly seeded RNG.
    if state["world_size"] == world.world_size:
        problem = None
        try:
            rng = _read_rng(uri, world.rank, shared.manifest, storage_cfg)
        except CheckpointError as e:
            problem = str(e)
        if not world.agree(problem is None, "all"):
            raise CorruptCheckpointError(uri, problem or "another rank found it unusable")
    if state["tokenizer_sha256"] != tokenizer_sha256:
        raise CheckpointError(f"checkpoint {uri} was trained with tokenizer {state['tokenizer_sha256'][:12]} "
                              f"but the dataset uses {tokenizer_sha256[:12]}: refusing to mix tokenizers")
    model_sd, optim_sd = _states(model, optimizer)
    _read_state({"model": model_sd, "optim": optim_sd}, BlockReader(uri, shared.metadata, shared.manifest, storage_cfg))
    set_state_dict(model.model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=_state_dict_options())
    if rng is not None:
        set_rng_state(rng)
    return state


def load_model_weights(directory: str, model: torch.nn.Module, check: bool = True) -> None:
    """Load only the model weights into a plain single-process module (generation, export);
    `check=False` when the caller has just run `check_sound` itself."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from raylm.train.checkpoint.safe_load import SafeReader

    if check:
        check_sound(directory)
    sd = get_model_state_dict(model, options=StateDictOptions())
    _read_state({"model": sd}, SafeReader(directory))
    model.load_state_dict(sd)


def _first_lines(error: BaseException) -> str:
    """What torch's long errors say first, and the global a refused unpickling names."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines[1:] if "GLOBAL" in line]
    return " ".join(lines[:1] + named[:1])[:400]


def _read_state(state: dict, reader: FileSystemReader) -> None:
    """dcp.load through `reader` and the safe planner. DCP gathers every rank's failure and raises
    them on all: a file that does not match its manifest is a CorruptCheckpointError, storage
    that failed is its own error (a restart may cure it), anything else a CheckpointError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from raylm.train.checkpoint.safe_load import SafeLoadPlanner

    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as e:  # a BaseException: it would pass `except Exception` handlers
        failures = sorted((rank, error) for rank, (error, _) in e.failures.items())
        for kind in (CorruptCheckpointError, OSError):
            if found := next((error for _, error in failures if isinstance(error, kind)), None):
                raise found from e
        rank, error = failures[0]
        raise CheckpointError(f"checkpoint {reader.checkpoint_id}: its state cannot be read (rank {rank}: "
                              f"{type(error).__name__}: {_first_lines(error)})") from e


# ----------------------------------------------------------------------------- checking

def _parse_train_state(raw: bytes) -> dict:
    try:
        state = json.loads(raw)
        step, world_size = state["step"], state["world_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{TRAIN_STATE} is not valid ({type(e).__name__}: {e})") from e
    # Checked, not converted: every rank's RNG file is looked for by world_size (2**63 of them would
    # exhaust memory), and a step of 1.5 or "7" is no step a save wrote.
    if type(step) is not int or step < 0 or type(world_size) is not int or not 0 < world_size <= _MAX_RANKS:
        raise CheckpointError(f"{TRAIN_STATE} is not valid: step {step!r}, world_size {world_size!r} "
                              f"(expected a step >= 0 and 1 to {_MAX_RANKS} ranks)")
    return state


def _problem(uri: str, storage_cfg: Optional[StorageConfig], checksums: bool, require_manifest: bool = True,
             manifest: Optional[dict[str, FileEntry]] = None) -> Optional[str]:
    """None when the checkpoint at `uri` is whole and sound, else what is wrong (naming the file).

    With a manifest: every listed file has its size, and its sha256 when `checksums` (the small
    files parsed here always). Then, with or without one: the train state and DCP's metadata
    parse, and every file they need exists (and is listed).
    """
    try:
        if manifest is None and require_manifest:
            manifest = read_manifest(uri, storage_cfg)
        if manifest is not None:
            for name, entry in manifest.items():
                problem = file_problem(uri, name, entry, storage_cfg, checksums or name in (TRAIN_STATE, METADATA_FILE))
                if problem:
                    return problem
        present = set(manifest) if manifest is not None else set(storage.list_files(uri, storage_cfg))
        for name in (METADATA_FILE, TRAIN_STATE):
            if name not in present:
                return f"no {name}" + (" in the manifest" if manifest is not None else " (the save did not finish)")
        world_size = _parse_train_state(read_file(storage.join(uri, TRAIN_STATE), storage_cfg))["world_size"]
        try:
            needed = shard_files(read_file(storage.join(uri, METADATA_FILE), storage_cfg))
        except pickle.UnpicklingError as e:
            return f"{METADATA_FILE} is not valid DCP metadata: {e}"
    except CheckpointError as e:
        return str(e)
    needed |= {_rng_name(r) for r in range(world_size)}
    missing = sorted(needed - present)
    return f"missing {', '.join(missing[:5])}" if missing else None


def incomplete_reason(uri: str, storage_cfg: Optional[StorageConfig] = None,
                      require_manifest: bool = True) -> Optional[str]:
    """None when the checkpoint at `uri` (local or s3://) is whole by the cheap checks of
    discovery (sizes; checksums of the small files), else what is wrong."""
    return _problem(uri, storage_cfg, checksums=False, require_manifest=require_manifest)


def verify(uri: str, storage_cfg: Optional[StorageConfig] = None) -> list[tuple[bool, str]]:
    """`raylm checkpoint verify`: (ok, line) for every file of the checkpoint at `uri`, or of
    every checkpoint of the run at `uri`, against its manifest (size and sha256), then whether
    the files DCP's index and the RNG need are all there. A run's unfinished saves (no
    manifest) are listed as SKIP: they are never resumed from."""
    storage.refuse_file(uri, "a checkpoint directory, or a run directory that holds checkpoints")
    base = uri.rstrip("/").rsplit("/", 1)[-1]
    is_run = not (is_checkpoint_name(base) or storage.exists(storage.join(uri, TRAIN_STATE), storage_cfg))
    targets = checkpoint_uris(uri, storage_cfg) if is_run else [uri]
    if not targets:
        raise FileNotFoundError(f"{uri} is neither a checkpoint nor a run directory holding one")
    lines: list[tuple[bool, str]] = []
    for target in targets:
        try:
            manifest = read_manifest(target, storage_cfg)
        except CheckpointError as e:
            unfinished = not storage.exists(storage.join(target, MANIFEST), storage_cfg)
            lines.append((is_run and unfinished, f"{'SKIP' if is_run and unfinished else 'FAIL'} {target}: {e}"))
            continue
        problems, checked = [], []
        for name, entry in sorted(manifest.items()):
            problem = file_problem(target, name, entry, storage_cfg)
            problems.append(problem)
            unchecked = " (size only: no checksum recorded)" if entry.sha256 is None else ""
            checked.append((problem is None, f"FAIL {target}: {problem}" if problem
                            else f"OK   {storage.join(target, name)}{unchecked}"))
        if not any(problems):
            problem = _problem(target, storage_cfg, checksums=False, manifest=manifest)
            checked.append((problem is None, f"FAIL {target}: {problem}" if problem
                            else f"OK   {target}: whole ({len(manifest)} files)"))
        if is_run and not all(ok for ok, _ in checked) and not storage.exists(storage.join(target, MANIFEST),
                                                                              storage_cfg):
            # Its run removed it meanwhile (checkpoint.keep_last; the manifest goes first): no damage.
            checked = [(True, f"SKIP {target}: removed by its run while it was verified")]
        lines += checked
    return lines


# ----------------------------------------------------------------------------- discovery

def checkpoint_uris(run_uri: str, storage_cfg: Optional[StorageConfig] = None) -> list[str]:
    """Every checkpoint directory of a run, newest first (finished or not)."""
    names = sorted((n for n in storage.list_dir(run_uri, storage_cfg) if is_checkpoint_name(n)), reverse=True)
    return [storage.join(run_uri, n) for n in names]


def scan(run_uri: str, storage_cfg: Optional[StorageConfig]) -> tuple[Optional[str], list[tuple[str, str]]]:
    """The newest usable checkpoint, and the finished ones newer than it that are not (uri, reason).
    Unfinished saves (no manifest) are passed over silently: they never claimed to be whole."""
    skipped = []
    for uri in checkpoint_uris(run_uri, storage_cfg):
        if not storage.exists(storage.join(uri, MANIFEST), storage_cfg):
            continue
        problem = incomplete_reason(uri, storage_cfg)
        if problem is None:
            return uri, skipped
        skipped.append((uri, problem))
    return None, skipped


def latest_complete(run_uri: str, storage_cfg: Optional[StorageConfig] = None) -> Optional[str]:
    """The newest usable checkpoint under a run directory (local or s3://), or None; silent."""
    return scan(run_uri, storage_cfg)[0]


# ----------------------------------------------------------------------------- retention

def retained(names: list[str], keep_last: Optional[int], keep_every: Optional[int]) -> set[str]:
    """Which checkpoint directory names retention keeps (the newest is always kept)."""
    names = sorted(names)
    keep = set(names[-keep_last:] if keep_last else names) | set(names[-1:])
    if keep_every:
        keep |= {n for n in names if step_of(n) % keep_every == 0}
    return keep
