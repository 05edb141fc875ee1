"""A run's JSON-lines records: the file names and how they are read and appended. No torch here:
the driver and Ray Train's controller read and append them without importing the training code."""

from __future__ import annotations

import json
import os
from typing import Optional

from raylm.config import StorageConfig
from raylm.data import storage

METRICS_FILE = "metrics.jsonl"  # one row per step, written by rank 0 into the run directory
EVENTS_FILE = "events.jsonl"  # failures, restarts, resizes, skipped checkpoints


def read_jsonl(uri: str, storage_cfg: Optional[StorageConfig] = None) -> list[dict]:
    """The complete rows of a JSON-lines file (local or s3://) that may be being appended to;
    none if it is absent."""
    try:
        lines = storage.read_bytes(uri, storage_cfg).decode().split("\n")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines[:-1] if line.strip()]  # the last is partial or empty


def append_event(path: str, event: dict) -> None:
    """One line of events.jsonl: failures, recoveries, resizes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")
