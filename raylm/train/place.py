"""Where a run may lie: in a directory of its own, never in another run's directory, a checkpoint
or a prepared dataset. Inside a checkpoint, the other run's pruning deleted the run with the
checkpoint (`run.name=parent/checkpoint_00000005/child`); inside a dataset or a run, its files
mixed with theirs (`run.name=data/x` trained into a prepared dataset). Checked as a run takes its
directory's lease (`raylm.train.lease`), before anything is written there. No torch here."""

from __future__ import annotations

import os
from typing import Optional

from raylm.config import ConfigError, StorageConfig
from raylm.data import storage
from raylm.data.manifest import MANIFEST_FILE
from raylm.train.checkpoint import format as checkpoint
from raylm.train.observe.records import EVENTS_FILE, METRICS_FILE


def _what_holds(uri: str, storage_cfg: Optional[StorageConfig], runs: bool = True) -> Optional[str]:
    """What the directory at `uri` is, when it is one a run must not write in: a checkpoint, a
    prepared dataset, or (with `runs`) a run's directory, by its records; else None. A sweep's
    directory holds none of them: its trials' runs lie inside it."""
    def has(name: str) -> bool:
        return storage.exists(storage.join(uri, name), storage_cfg)

    if checkpoint.is_checkpoint_name(uri.rstrip("/").rsplit("/", 1)[-1]) or has(checkpoint.MANIFEST):
        return "a checkpoint directory"
    if has(MANIFEST_FILE):
        return f"a prepared dataset (it holds {MANIFEST_FILE})"
    if runs and (held := [name for name in (METRICS_FILE, EVENTS_FILE) if has(name)]):
        return f"the directory of another run (it holds {', '.join(held)})"
    return None


def _parents(uri: str) -> list[str]:
    """The directories above `uri`, nearest first, up to the file system's root or the bucket."""
    parents = []
    if storage.is_s3(uri):
        while uri.rstrip("/").count("/") > 2:  # s3://bucket/key...: up to s3://bucket
            uri = uri.rstrip("/").rsplit("/", 1)[0]
            parents.append(uri)
        return parents
    uri = os.path.abspath(uri)
    while os.path.dirname(uri) != uri:
        uri = os.path.dirname(uri)
        parents.append(uri)
    return parents


def refuse_a_place_of_another(run_uri: str, storage_cfg: Optional[StorageConfig] = None,
                              field: str = "run.name") -> None:
    """ConfigError when the run directory `run_uri` is a checkpoint directory or a prepared
    dataset, or lies inside one or inside another run's directory; `field` names the setting
    that placed it there. Its own directory being a run's is a resume."""
    if what := _what_holds(run_uri, storage_cfg, runs=False):
        raise ConfigError(f"the run directory {run_uri} ({field}) is {what}: choose a {field} that names a "
                          "directory of its own")
    for parent in _parents(run_uri):
        try:
            what = _what_holds(parent, storage_cfg)
        except storage.StorageAccessError:
            continue  # a directory above that this user may not read holds nothing of theirs
        if what:
            raise ConfigError(f"the run directory {run_uri} ({field}) lies inside {parent}, {what}: a run there mixes "
                              f"its files with it, and inside a checkpoint the other run's pruning deletes it; choose "
                              f"a {field} outside it")
