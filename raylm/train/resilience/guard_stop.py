"""The stability guard's stop, seen from outside the training: the marker a stopped run leaves in
its run directory, and the check that refuses to replay the divergence until an operator changes
a setting. No torch here: the driver checks it before any worker starts."""

from __future__ import annotations

import json

from raylm.config import Config, config_to_dict
from raylm.data import storage
from raylm.errors import DeterministicError

STOP_MARKER = "guard_stopped.json"
# Changing any of these on resume is an operator's intervention after a guard stop.
INTERVENTION_SECTIONS = ("optim", "schedule", "guard")
INTERVENTION_KEYS = ("data.skip",)


class GuardStopped(DeterministicError):
    """The guard gave up: repeated rollbacks did not get the run past its trouble."""


def intervention_settings(cfg: Config) -> dict:
    """The settings an operator changes to get a stopped run past its trouble."""
    tree = config_to_dict(cfg)
    settings = {section: tree[section] for section in INTERVENTION_SECTIONS}
    settings.update({key: tree[key.split(".")[0]][key.split(".")[1]] for key in INTERVENTION_KEYS})
    return settings


def refuse_guard_stopped(run_uri: str, cfg: Config) -> None:
    """Raise GuardStopped if the guard stopped this run and none of the settings an operator
    would change differs from then; with changed settings, clear the stop (an event says so)."""
    uri = storage.join(run_uri, STOP_MARKER)
    if not storage.exists(uri, cfg.storage):
        return
    marker = json.loads(storage.read_bytes(uri, cfg.storage))
    now = intervention_settings(cfg)
    changed = sorted(k for k in now if now[k] != marker["settings"].get(k))
    if not changed:
        raise GuardStopped(f"{marker['message']} (refusing to replay it with the same settings)")
    storage.delete_file(uri, cfg.storage)
    print(f"raylm: guard: resuming a stopped run with changed {', '.join(changed)}", flush=True)
