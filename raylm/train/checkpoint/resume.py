"""Resuming: which checkpoint to resume from, and what may change when a run resumes.

`load_latest` loads the newest checkpoint whose files match its manifest (checksums included,
of what each rank reads), passing over corrupt ones by name (stderr and a "checkpoint_skipped"
event); when finished checkpoints exist and none is usable it refuses rather than start again
from step 0. `latest_usable` is the same choice by the cheap checks, for the driver.

What may change: DCP loads by name and ignores entries the new model does not ask for, so a
model with fewer layers, or the same tensors split into other heads, would load silently and
train on weights that mean something else. The driver compares the checkpoint's saved config
with the new one before any worker starts, and refuses listing every difference among the keys
that fix the meaning of the saved state (resolved configs: vocab_size and seq_len filled from
the data):

- the model's shape: d_model, n_layers, n_heads, n_kv_heads (unset means n_heads), vocab_size,
  norm, pos_embedding, mlp, ffn_hidden, parallel_block, tie_embeddings, bias; ffn_multiple
  when ffn_hidden is unset (it then decides the MLP width), vocab_multiple when vocab_size is
  unset, and max_seq_len with learned positions (the position table's size);
- train.seq_len: the data position counts sequences of this length;
- the tokenizer (its sha256, recorded in train_state.json): token ids mean other text.

Nor may the order of the training samples change once a run has trained some (`check_same_order`):
the data position counts samples of that order, so under another one some samples of the epoch
would be trained twice and others never. data.seed, data.chunk_rows, the mixture's weights
(normalised) and the datasets themselves (each manifest's sha256, recorded in train_state.json)
stay as saved; a dataset that moved (another path, the same manifest) is the same dataset.

Everything else may change: the run's length, LR, schedule, intervals, batch size, parallel
layout, dropout, norm_eps and rope_theta (numerics and a deliberate context-extension knob,
not the saved tensors' meaning), max_seq_len with RoPE (no weights depend on it), data.skip.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Optional, TypeVar

import yaml

from raylm.config import CONFIG_FILE, Config, ConfigError, StorageConfig, config_changes, config_to_dict
from raylm.data import storage
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.errors import CheckpointError, CorruptCheckpointError, UnusableCheckpointsError
from raylm.train.checkpoint.format import TRAIN_STATE
from raylm.train.observe.records import EVENTS_FILE, append_event

CONFIG_HISTORY_FILE = "config_history.jsonl"  # every change an operator made on resume

_SHAPE_KEYS = ("d_model", "n_layers", "n_heads", "vocab_size", "norm", "pos_embedding", "mlp", "ffn_hidden",
               "parallel_block", "tie_embeddings", "bias")


def _fixed_values(tree: dict, other: dict) -> dict[str, Any]:
    """The values of `tree` that a resume must keep, by dotted key. Conditional keys count when
    their condition holds in either tree (`other` is the tree it is compared with)."""
    model, other_model = tree.get("model") or {}, other.get("model") or {}
    values = {f"model.{k}": model.get(k) for k in _SHAPE_KEYS}
    values["model.n_kv_heads"] = model.get("n_kv_heads") or model.get("n_heads")
    if model.get("ffn_hidden") is None or other_model.get("ffn_hidden") is None:
        values["model.ffn_multiple"] = model.get("ffn_multiple")
    if model.get("vocab_size") is None or other_model.get("vocab_size") is None:
        values["model.vocab_multiple"] = model.get("vocab_multiple")
    if "learned" in (model.get("pos_embedding"), other_model.get("pos_embedding")):
        values["model.max_seq_len"] = model.get("max_seq_len")
    values["train.seq_len"] = (tree.get("train") or {}).get("seq_len")
    return values


def check_resume_compatible(saved: dict, new: dict, saved_tokenizer_sha256: Optional[str] = None,
                            new_tokenizer_sha256: Optional[str] = None) -> None:
    """Raise ConfigError listing every key whose change would make the saved state mean
    something else (see the module docstring); `saved` and `new` are config trees as in
    config.yaml. The tokenizers are compared when both hashes are given."""
    old_values, new_values = _fixed_values(saved, new), _fixed_values(new, saved)
    differences = [f"{key}: saved {old_values[key]!r}, now {new_values[key]!r}"
                   for key in sorted(old_values) if old_values[key] != new_values[key]]
    if saved_tokenizer_sha256 and new_tokenizer_sha256 and saved_tokenizer_sha256 != new_tokenizer_sha256:
        differences.append(f"tokenizer: saved sha256 {saved_tokenizer_sha256[:12]}, "
                           f"now {new_tokenizer_sha256[:12]}")
    if differences:
        raise ConfigError("cannot resume: the checkpoint's saved state means something else under the new config "
                          f"({len(differences)} difference(s)):\n  " + "\n  ".join(differences) +
                          "\nKeep these as saved, or start a new run (another run.name). The run length, LR, "
                          "schedule, intervals and parallel layout may change on resume.")


def read_saved_config(checkpoint_uri: str, storage_cfg: Optional[StorageConfig] = None) -> dict:
    """The config tree saved in the checkpoint at `checkpoint_uri` (local or s3://)."""
    uri = storage.join(checkpoint_uri, CONFIG_FILE)
    try:
        tree = yaml.safe_load(checkpoint.read_file(uri, storage_cfg))
    except yaml.YAMLError as e:
        raise CheckpointError(f"{uri} is not valid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise CheckpointError(f"{uri} does not hold a config (a mapping of sections)")
    return tree


def _order_values(tree: dict) -> dict[str, Any]:
    """What, besides the datasets themselves, fixes the order of the training samples."""
    data = tree.get("data") or {}
    weights = [float(c.get("weight", 1.0)) for c in data.get("mixture") or []] or [1.0]
    return {"data.seed": data.get("seed"), "data.chunk_rows": data.get("chunk_rows"),
            "data.mixture weights (normalised)": [round(w / sum(weights), 9) for w in weights]}


def _dataset_paths(tree: dict) -> list[str]:
    data = tree.get("data") or {}
    return [f"data.mixture[{i}] {c.get('path')}" for i, c in enumerate(data.get("mixture") or [])] or \
        [f"data.path {data.get('path')}"]


def check_same_order(saved: dict, new: dict, position: int, saved_data_sha256: Optional[list[str]] = None,
                     new_data_sha256: Optional[list[str]] = None) -> None:
    """Raise ConfigError listing every difference in what orders the training samples, once the
    run has trained `position` > 0 of them (see the module docstring); the datasets are compared
    by their manifests' sha256 where the checkpoint recorded them."""
    if position <= 0:
        return
    old_values, new_values = _order_values(saved), _order_values(new)
    differences = [f"{key}: saved {old_values[key]!r}, now {new_values[key]!r}"
                   for key in old_values if old_values[key] != new_values[key]]
    if saved_data_sha256 and new_data_sha256 and saved_data_sha256 != new_data_sha256:
        if len(saved_data_sha256) != len(new_data_sha256):
            differences.append(f"datasets: saved {len(saved_data_sha256)}, now {len(new_data_sha256)}")
        else:
            differences += [f"{path}: not the dataset trained (its manifest differs: prepared again, or another one)"
                            for path, old, now in zip(_dataset_paths(new), saved_data_sha256, new_data_sha256)
                            if old != now]
    if differences:
        raise ConfigError(f"cannot resume: the run has trained {position:,} samples in an order the new config does "
                          f"not give ({len(differences)} difference(s)):\n  " + "\n  ".join(differences) +
                          "\nThe data position counts samples of the saved order: under another, samples of this "
                          "epoch would be trained twice and others never. Keep these as saved (data.skip may "
                          "change), or train these weights on other data as a new run: raylm export, then "
                          "raylm import.")


def check_resume(checkpoint_uri: str, new: dict, tokenizer_sha256: str,
                 storage_cfg: Optional[StorageConfig] = None, data_sha256: Optional[list[str]] = None) -> int:
    """Refuse what a resume from the checkpoint at `checkpoint_uri` may not change
    (`check_resume_compatible` and `check_same_order`, against the config and the train state
    saved in it; `data_sha256`: the new run's datasets, as `RunSpec.data_sha256`); returns the
    data position it resumes at."""
    state_uri = storage.join(checkpoint_uri, TRAIN_STATE)
    try:
        state = json.loads(storage.read_bytes(state_uri, storage_cfg))
        saved_tokenizer, position = state["tokenizer_sha256"], int(state.get("position", 0))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{state_uri} is not valid ({type(e).__name__}: {e})") from e
    saved = read_saved_config(checkpoint_uri, storage_cfg)
    check_resume_compatible(saved, new, saved_tokenizer, tokenizer_sha256)
    check_same_order(saved, new, position, state.get("data_sha256"), data_sha256)
    return position


def skip_behind(position: int, skip: list[list[int]]) -> Optional[str]:
    """A warning when data.skip ranges lie (in part) behind the data position a run resumes at:
    those samples were trained already, and skipping them does nothing (step numbers given for
    sample positions, most likely)."""
    behind = [[start, min(end, position)] for start, end in skip if start < position]
    if not behind:
        return None
    return (f"data.skip {behind} lies behind the data position {position:,} this run resumes at: those samples "
            "were trained already, and skipping them does nothing (the ranges count samples, not steps)")


# Keys that differ between any two invocations without being a change of the run.
_NOT_CHANGES = ("run.ray_address", "run.ray_num_cpus", "train.stop_at_step", "checkpoint.resume")


def changes_since(checkpoint_dir: str, cfg: Config, storage_cfg: Optional[StorageConfig] = None) -> dict[str, list]:
    """What changed since the checkpoint at `checkpoint_dir` was written (dotted key -> [old, new]):
    the operator's changes that a resume records (`record_config_change`)."""
    changes = config_changes(read_saved_config(checkpoint_dir, storage_cfg), config_to_dict(cfg))
    return {key: change for key, change in changes.items() if key not in _NOT_CHANGES}


def record_config_change(run_dir: str, step: int, changes: dict[str, list]) -> None:
    """An event, and a row of the run's config history (config_history.jsonl)."""
    row = {"event": "config_changed", "time": time.time(), "step": step, "changes": changes}
    append_event(os.path.join(run_dir, EVENTS_FILE), row)
    append_event(os.path.join(run_dir, CONFIG_HISTORY_FILE), row)
    print(f"raylm: resuming at step {step} with changed " +
          ", ".join(f"{key} {old!r} → {new!r}" for key, (old, new) in changes.items()), flush=True)


def _report(run_uri: str, skipped: list[tuple[str, str]], found: bool, allow_none_usable: bool,
            events_path: Optional[str]) -> None:
    for uri, reason in skipped if events_path else ():
        print(f"raylm: skipping checkpoint {uri}: {reason}", file=sys.stderr, flush=True)
        append_event(events_path, {"event": "checkpoint_skipped", "time": time.time(), "uri": uri, "reason": reason})
    if not found and skipped and not allow_none_usable:
        listing = "\n  ".join(f"{uri}: {reason}" for uri, reason in skipped)
        raise UnusableCheckpointsError(
            f"{run_uri} holds {len(skipped)} finished checkpoint(s) and none is usable:\n  {listing}\n"
            "Training will not silently start again from step 0: repair or remove them, or set "
            "checkpoint.on_unusable=start_over to train from step 0 beside them.")


def latest_usable(run_uri: str, storage_cfg: Optional[StorageConfig] = None, allow_none_usable: bool = False,
                  events_path: Optional[str] = None) -> Optional[str]:
    """The newest usable checkpoint to resume from by the cheap checks (sizes), or None when
    the run has none (for the driver: what the workers will try first).

    Finished checkpoints passed over (an unparseable manifest, train state or metadata, a file
    missing or of the wrong size) are reported when `events_path` (the run's events.jsonl) is
    given, on stderr and as "checkpoint_skipped" events: pass it from the one process that keeps
    the run's record. When finished checkpoints exist and none is usable, raises
    UnusableCheckpointsError naming each, unless `allow_none_usable` (training then starts from
    step 0 beside them).
    """
    latest, skipped = checkpoint.scan(run_uri, storage_cfg)
    _report(run_uri, skipped, latest is not None, allow_none_usable, events_path)
    return latest


T = TypeVar("T")


def load_latest(run_uri: str, load: Callable[[str], T], storage_cfg: Optional[StorageConfig] = None,
                agree: Callable[[bool], bool] = lambda ok: ok, allow_none_usable: bool = False,
                events_path: Optional[str] = None) -> Optional[T]:
    """`load(uri)` of the newest checkpoint of the run that loads, called on every rank together;
    None when the run has none. As `latest_usable`, and a checkpoint that `load` finds corrupt
    (CorruptCheckpointError, raised on every rank together: a file that does not match its
    manifest, whichever rank read it) is passed over for the previous one. `agree(ok)` is one
    decision for every rank (World.agree(ok, "all")): a save unfinished for one rank is for all.
    """
    skipped: list[tuple[str, str]] = []
    for uri in checkpoint.checkpoint_uris(run_uri, storage_cfg):
        if not agree(storage.exists(storage.join(uri, checkpoint.MANIFEST), storage_cfg)):
            continue  # an unfinished save
        try:
            loaded = load(uri)
        except CorruptCheckpointError as e:
            skipped.append((uri, e.problem))
            continue
        _report(run_uri, skipped, True, allow_none_usable, events_path)
        return loaded
    _report(run_uri, skipped, False, allow_none_usable, events_path)
    return None
