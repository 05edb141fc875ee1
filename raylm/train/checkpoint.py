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
from typing import Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from raylm.config import StorageConfig
from raylm.data import storage
from raylm.parallel.runtime import ParallelModel, World

PREFIX = "checkpoint_"
TRAIN_STATE = "train_state.json"
CONFIG = "config.yaml"
TOKENIZER = "tokenizer.json"


def dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


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
         train_state: dict, files: dict[str, str]) -> None:
    """Write this rank's part of the checkpoint into `directory` (called on every rank);
    rank 0 adds the train state and `files` (name -> text: the config, the tokenizer)."""
    model_sd, optim_sd = _states(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
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


def load(directory: str, model: ParallelModel, optimizer: torch.optim.Optimizer, world: World,
         tokenizer_sha256: str) -> dict:
    """Restore model, optimizer and this rank's RNG from `directory`; returns the train state."""
    problem = incomplete_reason(directory)
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


def incomplete_reason(uri: str, storage_cfg: Optional[StorageConfig] = None) -> Optional[str]:
    """None when the checkpoint at `uri` (local or s3://) is whole, else what is missing."""
    present = set(storage.list_files(uri, storage_cfg))
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
    names = sorted((n for n in storage.list_dir(run_uri, storage_cfg) if n.startswith(PREFIX)), reverse=True)
    for name in names:
        uri = storage.join(run_uri, name)
        if incomplete_reason(uri, storage_cfg) is None:
            return uri
    return None
