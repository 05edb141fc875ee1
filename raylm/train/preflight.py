"""What a run's directory allows before any worker starts: which checkpoint the run resumes from,
whether the new config may resume it, and whether the stability guard stopped the run. Checked
once, by whoever starts the run (the driver of `raylm train`, or `train_local` in one process),
so that a refusal is one clear error before any work. No torch here."""

from __future__ import annotations

import sys
from typing import Optional

from raylm.config import ConfigError, config_to_dict
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.resume import check_resume, latest_usable, skip_behind
from raylm.train.resilience.guard_stop import refuse_guard_stopped
from raylm.train.spec import RunSpec


def preflight(spec: RunSpec, run_uri: str) -> Optional[str]:
    """Check the run directory at `run_uri` against `spec` (checkpoint.resume, the checkpoint to
    resume from, a guard stop); returns that checkpoint's URI, None for a fresh run."""
    cfg = spec.config
    restore = latest_usable(run_uri, cfg.storage, cfg.checkpoint.on_unusable == "start_over")
    if cfg.checkpoint.resume == "required" and restore is None:
        raise FileNotFoundError(f"checkpoint.resume=required but {run_uri} holds no complete checkpoint")
    if cfg.checkpoint.resume == "never" and (existing := checkpoint.checkpoint_uris(run_uri, cfg.storage)):
        raise ConfigError(f"checkpoint.resume=never but {run_uri} already holds checkpoints ({len(existing)}, the "
                          f"newest {existing[0]}); choose another run.name or remove them")
    if restore:
        position = check_resume(restore, config_to_dict(cfg), spec.tokenizer_sha256, cfg.storage, spec.data_sha256)
        if warning := skip_behind(position, cfg.data.skip):
            print(f"raylm: warning: {warning}", file=sys.stderr, flush=True)
    if cfg.guard.enabled:
        refuse_guard_stopped(run_uri, cfg)
    return restore
