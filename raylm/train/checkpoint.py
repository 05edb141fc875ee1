"""Sharded checkpoints with torch.distributed.checkpoint: the whole training state.

A checkpoint directory holds the DCP shards of {"model", "optim"} (each rank writes its own
file, rank 0 the `.metadata` index), one RNG file per rank, and from rank 0 the train state
(step, data position), the resolved config and the tokenizer. It is complete only when every
file the DCP index names and every rank's RNG file are present: `is_complete` checks that,
so a directory left by a crash mid-write is never taken as the latest.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import time
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from raylm.config import Config, StorageConfig
from raylm.data import storage
from raylm.parallel.runtime import ParallelModel, World

PREFIX = "checkpoint_"
TRAIN_STATE = "train_state.json"
CONFIG = "config.yaml"
TOKENIZER = "tokenizer.json"


def dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def is_checkpoint_name(name: str) -> bool:
    """Ours, not another file that starts alike (Ray keeps checkpoint_manager_snapshot.json)."""
    return re.fullmatch(rf"{PREFIX}\d{{8}}", name) is not None


def _rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, _rng_name(rank))


def _rng_name(rank: int) -> str:
    return f"rng/rank_{rank:05d}.pt"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# Optimizer state flattened to one entry per parameter name ("state.layers.0.w.exp_avg",
# "param_groups.layers.0.w.lr"): pipeline stages hold different parameters, and only per-name
# entries let any layout (or a single process) load any other's.
_STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _states(model: ParallelModel, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    # model.model spans all of this rank's parts (pipeline chunks) under the plain model's names.
    return get_state_dict(model.model, optimizer, options=_STATE_DICT_OPTIONS)


def save(directory: str, model: ParallelModel, optimizer: torch.optim.Optimizer, world: World,
         train_state: dict, files: dict[str, str], asynchronous: bool = False,
         async_group: Optional[dist.ProcessGroup] = None) -> Optional[Future]:
    """Write this rank's part of the checkpoint into `directory` (called on every rank);
    rank 0 adds the train state and `files` (name -> text: the config, the tokenizer).

    `asynchronous`: the tensors are staged in memory and written on a background thread (DCP
    async_save, its collectives on `async_group`); the returned future completes the write.
    """
    model_sd, optim_sd = _states(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    future = None
    if asynchronous:
        future = dcp.async_save(state, checkpoint_id=directory, process_group=async_group,
                                no_dist=not dist.is_initialized())
    else:
        dcp.save(state, checkpoint_id=directory)
    os.makedirs(os.path.dirname(_rng_file(directory, world.rank)), exist_ok=True)
    torch.save(_rng_state(), _rng_file(directory, world.rank))
    if world.rank == 0:
        for name, text in files.items():
            with open(os.path.join(directory, name), "w") as f:
                f.write(text)
        # Written last: a directory without it is never taken for a checkpoint.
        state = {**train_state, "world_size": world.world_size, "dp_size": model.dp_size}
        with open(os.path.join(directory, TRAIN_STATE), "w") as f:
            json.dump(state, f, indent=1)
    return future


def load(directory: str, model: ParallelModel, optimizer: torch.optim.Optimizer, world: World,
         tokenizer_sha256: str) -> dict:
    """Restore model, optimizer and this rank's RNG from `directory`; returns the train state."""
    problem = incomplete_reason(directory, require_manifest=False)  # Ray hands us only what all ranks reported
    if problem:
        raise RuntimeError(f"cannot resume from {directory}: {problem}")
    with open(os.path.join(directory, TRAIN_STATE)) as f:
        state = json.load(f)
    if state["tokenizer_sha256"] != tokenizer_sha256:
        raise ValueError(f"checkpoint {directory} was trained with tokenizer {state['tokenizer_sha256'][:12]} "
                         f"but the dataset uses {tokenizer_sha256[:12]}: refusing to mix tokenizers")
    model_sd, optim_sd = _states(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    set_state_dict(model.model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=_STATE_DICT_OPTIONS)
    rng = _rng_file(directory, world.rank)
    # A rank that did not exist at save time (a larger world) keeps its freshly seeded RNG.
    if os.path.exists(rng) and state["world_size"] == world.world_size:
        _set_rng_state(torch.load(rng, weights_only=False))
    return state


def load_model_weights(directory: str, model: torch.nn.Module) -> None:
    """Load only the model weights into a plain single-process module (generation, export)."""
    sd = get_model_state_dict(model, options=StateDictOptions())
    dcp.load({"model": sd}, checkpoint_id=directory)
    model.load_state_dict(sd)


def incomplete_reason(uri: str, storage_cfg: Optional[StorageConfig] = None,
                      require_manifest: bool = True) -> Optional[str]:
    """None when the checkpoint at `uri` (local or s3://) is whole, else what is missing.

    Whole means: the final manifest exists and every file it lists has its size (a crash while
    writing leaves no manifest), and every file DCP's index and the per-rank RNG need exists.
    """
    present = set(storage.list_files(uri, storage_cfg))
    if require_manifest:
        if MANIFEST not in present:
            return f"no {MANIFEST} (the save did not finish)"
        listed = json.loads(storage.read_bytes(storage.join(uri, MANIFEST), storage_cfg))["files"]
        for name, size in listed.items():
            if name not in present or storage.file_size(storage.join(uri, name), storage_cfg) != size:
                return f"{name} is missing or not the size the manifest records"
    if ".metadata" not in present:
        return "no DCP .metadata (the save did not finish)"
    if TRAIN_STATE not in present:
        return f"no {TRAIN_STATE}"
    world_size = json.loads(storage.read_bytes(storage.join(uri, TRAIN_STATE), storage_cfg))["world_size"]
    metadata = pickle.loads(storage.read_bytes(storage.join(uri, ".metadata"), storage_cfg))  # DCP's format
    needed = {info.relative_path for info in (metadata.storage_data or {}).values()}
    needed |= {_rng_name(r) for r in range(world_size)}
    missing = sorted(needed - present)
    return f"missing {', '.join(missing[:5])}" if missing else None


def latest_complete(run_uri: str, storage_cfg: Optional[StorageConfig] = None) -> Optional[str]:
    """The newest complete checkpoint under a run directory (local or s3://), or None."""
    names = sorted((n for n in storage.list_dir(run_uri, storage_cfg) if is_checkpoint_name(n)), reverse=True)
    for name in names:
        uri = storage.join(run_uri, name)
        if incomplete_reason(uri, storage_cfg) is None:
            return uri
    return None


# ----------------------------------------------------------------------------- policy

MANIFEST = "checkpoint_manifest.json"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; training stops rather than go on unprotected."""


def finalize(uri: str, storage_cfg: Optional[StorageConfig] = None) -> None:
    """Write the manifest (every file and its size) last: only then is the checkpoint latest."""
    problem = incomplete_reason(uri, storage_cfg, require_manifest=False)
    if problem:
        raise CheckpointWriteError(f"checkpoint {uri} is incomplete after publishing: {problem}")
    files = {name: storage.file_size(storage.join(uri, name), storage_cfg)
             for name in storage.list_files(uri, storage_cfg)}
    storage.write_bytes(storage.join(uri, MANIFEST), json.dumps({"files": files}, indent=1).encode(), storage_cfg)


def retained(names: list[str], keep_last: Optional[int], keep_every: Optional[int]) -> set[str]:
    """Which checkpoint directory names retention keeps (the newest is always kept)."""
    names = sorted(names)
    keep = set(names[-keep_last:] if keep_last else names) | set(names[-1:])
    if keep_every:
        keep |= {n for n in names if int(n[len(PREFIX):]) % keep_every == 0}
    return keep


def _local_state_bytes(model: ParallelModel, optimizer: torch.optim.Optimizer) -> int:
    tensors = [p for part in model.parts for p in part.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def _check_space(uri: str, needed: int) -> None:
    free = storage.free_bytes(uri)
    if free is not None and free < needed:
        raise OSError(28, f"not enough free space for a checkpoint at {uri}: {free / 1e6:.1f} MB free, "
                          f"about {needed / 1e6:.1f} MB needed")


@dataclass
class _Pending:
    """An async save in flight: its staging directory stays open until it is published."""

    step: int
    directory: str
    stack: ExitStack
    future: Future
    metrics: dict


class Checkpointer:
    """When to save, and saving safely: all ranks agree that their part was written before the
    checkpoint is published; failed writes are retried, then stop training unless
    `checkpoint.allow_failures`, in which case every later step warns until a save succeeds.

    With `checkpoint.async_save`, a save returns once the state is staged in memory; each later
    step asks whether every rank's write has finished and then publishes it, and training does
    not end before it is published.
    """

    def __init__(self, cfg: Config, env, model: ParallelModel, optimizer: torch.optim.Optimizer,
                 world: World, files: dict[str, str]):
        self.cfg, self.env, self.model, self.optimizer, self.world, self.files = cfg, env, model, optimizer, world, files
        self.last_save = time.monotonic()
        self.failing_since: Optional[int] = None
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pending: Optional[_Pending] = None
        self.async_group: Optional[dist.ProcessGroup] = None
        if cfg.checkpoint.async_save:
            # DCP's background writes need collectives of their own: on the training group they
            # would interleave with the step's (gloo fails with a size mismatch).
            self.async_group = dist.new_group(backend="gloo") if self.distributed else None

    def due(self, step: int, last: int) -> bool:
        c = self.cfg.checkpoint
        if step == last or (c.every_steps > 0 and step % c.every_steps == 0):
            return True
        if c.every_minutes is None:
            return False
        return self.world.agree(time.monotonic() - self.last_save >= 60 * c.every_minutes, "rank0")

    def _space_needed(self) -> tuple[int, int]:
        """Bytes this rank writes, and bytes of the whole checkpoint."""
        local = _local_state_bytes(self.model, self.optimizer)
        total = torch.tensor([local], device=self.world.device, dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(total)
        return local, int(total.item())

    def save(self, step: int, train_state: dict, metrics: dict) -> None:
        c, root = self.cfg.checkpoint, self.env.checkpoint_root
        self.wait()  # one async save in flight at a time
        local, total = self._space_needed()
        error: Optional[BaseException] = None
        for attempt in range(c.write_attempts):
            error = None
            stack = ExitStack()
            directory = stack.enter_context(self.env.staging_dir(step))
            future = None
            try:
                _check_space(directory, int(1.1 * local))
                if self.world.rank == 0:
                    _check_space(root, int(1.1 * total))
                future = save(directory, self.model, self.optimizer, self.world, train_state, self.files,
                              c.async_save, self.async_group)
            except OSError as e:
                error = e
            if self.world.agree(error is None, "all"):
                if future is not None:
                    self.pending = _Pending(step, directory, stack, future, metrics)
                else:
                    self._publish(step, directory, stack, metrics)
                self.last_save = time.monotonic()
                return
            stack.close()
            if attempt + 1 < c.write_attempts:
                time.sleep(min(30.0, 2.0 ** attempt))
        self._failed(step, error)

    def poll(self) -> None:
        """Publish the async save in flight if every rank has finished writing it."""
        if self.pending is not None and self.world.agree(self.pending.future.done(), "all"):
            self.wait()

    def wait(self) -> None:
        """Finish the async save in flight, if any (blocking)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        error = None
        try:
            pending.future.result()
        except OSError as e:
            error = e
        if self.world.agree(error is None, "all"):
            self._publish(pending.step, pending.directory, pending.stack, pending.metrics)
        else:
            pending.stack.close()
            self._failed(pending.step, error)

    def _failed(self, step: int, error: Optional[BaseException]) -> None:
        c, root = self.cfg.checkpoint, self.env.checkpoint_root
        reason = error or "another rank could not write its part"
        if not c.allow_failures:
            raise CheckpointWriteError(f"step {step}: no checkpoint could be written to {root} ({reason}). "
                                       "Training stops so that it never runs unprotected; free space or fix "
                                       "storage, then resume") from error
        self.failing_since = self.failing_since or step

    def _publish(self, step: int, directory: str, stack: ExitStack, metrics: dict) -> None:
        c, root, storage_cfg = self.cfg.checkpoint, self.env.checkpoint_root, self.cfg.storage
        with stack:
            uri = self.env.publish(step, directory, metrics)
        if self.distributed:
            dist.barrier()  # every rank's part is published before the manifest says so
        if self.world.rank == 0:
            finalize(uri, storage_cfg)
            names = [n for n in storage.list_dir(root, storage_cfg) if is_checkpoint_name(n)]
            for name in sorted(set(names) - retained(names, c.keep_last, c.keep_every)):
                storage.delete_dir(storage.join(root, name), storage_cfg)
        self.failing_since = None
