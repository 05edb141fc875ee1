"""`raylm status RUN`: what a user looks for while a run goes on, read from what its directory
(local or s3://) already holds: the lease (is it running, who holds it), metrics.jsonl (step,
losses, throughput, ETA), events.jsonl (the last failures, restarts and guard actions), the
checkpoints (the newest complete one) and config.yaml (the steps it trains to). No Ray, no torch.

On S3 the records are those uploaded with the last checkpoint: a step or two of checkpoint
intervals behind the run's own console.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import yaml

from raylm.config import CONFIG_FILE, StorageConfig
from raylm.data import storage
from raylm.progress import format_duration
from raylm.train.checkpoint import format as checkpoint
from raylm.train.lease import describe_holder, read_holder, why_stale
from raylm.train.observe.records import EVENTS_FILE, METRICS_FILE, read_records
from raylm.train.resilience.guard_stop import STOP_MARKER

# What a user asks of a run's story: why it stopped or restarted, and what the guard did.
NOTABLE_EVENTS = ("failure", "resumed", "replica_lost", "replica_healed", "preempted", "interrupted", "lease_taken_over", "lease_lost",
                  "checkpoint_failed", "checkpoint_recovered", "checkpoint_skipped", "config_changed",
                  "rollback", "batch_skipped", "noise_masking", "lr_cut", "hard_batch", "samples_quarantined", "guard_stopped")
RECENT_ROWS = 20  # the rows that throughput and the ETA are taken over
SHOWN_EVENTS = 5
# A directory that is not a run: the entries looked into for runs (a stat each, on S3 a request),
# and the runs named.
LISTED_ENTRIES, SHOWN_RUNS = 100, 5


@dataclass
class RunStatus:
    uri: str
    state: str  # running, finished, stopped, stopped by the guard, not started
    detail: str
    step: Optional[int] = None
    steps: Optional[int] = None
    loss: Optional[float] = None
    val_loss: Optional[float] = None
    val_step: Optional[int] = None
    tokens_per_s: Optional[float] = None
    eta_s: Optional[float] = None
    checkpoint: Optional[str] = None
    events: list[dict] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def _config(uri: str, storage_cfg: Optional[StorageConfig]) -> dict:
    """The run's config.yaml as plain YAML (not loaded through the schema: a status must show a run
    whose config an older or newer raylm wrote)."""
    try:
        loaded = yaml.safe_load(storage.read_bytes(storage.join(uri, CONFIG_FILE), storage_cfg))
    except (FileNotFoundError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _setting(config: dict, section: str, key: str, default: object) -> object:
    value = (config.get(section) or {}).get(key)
    return default if value is None else value


def _rate(rows: list[dict]) -> Optional[float]:
    """Seconds per step over the last rows, by their wall times (evaluations and saves included)."""
    timed = [r for r in rows[-RECENT_ROWS:] if isinstance(r.get("time"), (int, float))]
    if len(timed) < 2 or timed[-1]["step"] <= timed[0]["step"]:
        return None
    return (timed[-1]["time"] - timed[0]["time"]) / (timed[-1]["step"] - timed[0]["step"])


def run_status(uri: str, storage_cfg: Optional[StorageConfig] = None) -> RunStatus:
    """The status of the run at `uri`; FileNotFoundError when there is no run there."""
    storage.refuse_file(uri, "a run directory")
    if not storage.exists(uri, storage_cfg):
        raise FileNotFoundError(f"{uri} does not exist")
    config = _config(uri, storage_cfg)
    steps = _setting(config, "train", "steps", None)
    stop_at = _setting(config, "train", "stop_at_step", None)
    end = stop_at if isinstance(stop_at, int) and isinstance(steps, int) and stop_at < steps else steps
    metrics, dropped = read_records(storage.join(uri, METRICS_FILE), storage_cfg)
    # A step trained again after a rollback or a restart is written again: the file's order counts.
    metrics = [r for r in metrics if isinstance(r.get("step"), int)]
    events, dropped_events = read_records(storage.join(uri, EVENTS_FILE), storage_cfg)
    latest = checkpoint.latest_complete(uri, storage_cfg)
    saved_step = checkpoint.step_of(latest.rstrip("/").rsplit("/", 1)[-1]) if latest else None
    status = RunStatus(uri, "not started", "no step written yet", steps=end, checkpoint=latest,
                       events=[e for e in events if e.get("event") in NOTABLE_EVENTS][-SHOWN_EVENTS:],
                       dropped=dropped + dropped_events)
    if metrics:
        last = metrics[-1]
        status.step, status.loss = last["step"], last.get("loss")
        evaluated = [r for r in metrics if isinstance(r.get("val_loss"), (int, float))]
        if evaluated:
            status.val_loss, status.val_step = evaluated[-1]["val_loss"], evaluated[-1]["step"]
        rates = [r["tokens_per_s"] for r in metrics[-RECENT_ROWS:] if isinstance(r.get("tokens_per_s"), (int, float))]
        status.tokens_per_s = sum(rates) / len(rates) if rates else None
    holder = read_holder(uri, storage_cfg)
    stopped_by_guard = storage.exists(storage.join(uri, STOP_MARKER), storage_cfg)
    if not (config or metrics or events or dropped or dropped_events or latest or holder or stopped_by_guard):
        _refuse_if_not_a_run(uri, storage_cfg)
    stale = why_stale(holder, float(_setting(config, "run", "lease_timeout_s", 120.0))) if holder else None
    if holder and not stale:
        status.state, status.detail = "running", f"held by {describe_holder(holder)}"
        seconds_per_step = _rate(metrics)
        if seconds_per_step is not None and isinstance(end, int) and status.step is not None:
            status.eta_s = seconds_per_step * max(0, end - status.step)
    elif saved_step is not None and isinstance(steps, int) and saved_step >= steps:
        status.state, status.detail = "finished", f"its checkpoint at step {saved_step} is the last of train.steps={steps}"
    elif saved_step is not None and isinstance(end, int) and saved_step >= end:  # end < steps: stop_at_step's
        status.state, status.detail = "stopped at train.stop_at_step", (
            f"its checkpoint at step {saved_step} is train.stop_at_step={stop_at} of train.steps={steps}; the same "
            f"command with a later train.stop_at_step, or none, resumes from {latest}")
    elif stopped_by_guard:
        status.state, status.detail = "stopped by the guard", f"{STOP_MARKER}: a plain resume refuses to replay it"
    elif not metrics and saved_step == 0 and (source := _imported_from(latest, storage_cfg)):
        # No command has run on it, so none can be run again: say which one trains it.
        status.detail = (f"imported from {source}; raylm train {storage.join(uri, CONFIG_FILE)} "
                         f"data.path=DATA trains it")
    elif (metrics or latest) and _trial_finished(uri, storage_cfg):
        status.state, status.detail = "finished", "a sweep's trial: its result is final.json"
    elif metrics or latest:
        status.state = "stopped"
        where = f"resumes from {latest}" if latest else "starts it again (no complete checkpoint)"
        status.detail = (f"a stale lease: {stale}; " if stale else "") + f"the same command {where}"
    return status


def _trial_finished(uri: str, storage_cfg: Optional[StorageConfig]) -> bool:
    """Whether `uri` is a sweep's trial that finished: its steps are the sweep's, not config.yaml's."""
    from raylm.sweep.plan import FINAL_FILE  # scipy's import, for a run not running or finished

    return storage.exists(storage.join(uri, FINAL_FILE), storage_cfg)


def _imported_from(checkpoint_uri: str, storage_cfg: Optional[StorageConfig]) -> Optional[str]:
    """The model directory `raylm import` made this step-0 checkpoint from, if it did."""
    try:
        state = json.loads(storage.read_bytes(storage.join(checkpoint_uri, checkpoint.TRAIN_STATE), storage_cfg))
    except (storage.StorageError, ValueError):  # absent or unreadable: the checkpoint check says so elsewhere
        return None
    source = state.get("imported_from") if isinstance(state, dict) else None
    return source if isinstance(source, str) else None


def _refuse_if_not_a_run(uri: str, storage_cfg: Optional[StorageConfig]) -> None:
    """A directory with none of a run's files is a run not started yet when it is empty (the lease is
    a run's first file), and otherwise not a run: often the directory of runs (`raylm status runs`),
    whose runs are named."""
    entries = storage.list_dir(uri, storage_cfg)
    if not entries:
        return
    from raylm.sweep.results import SWEEP_FILE  # scipy's import, on this error's path only

    if SWEEP_FILE in entries:
        trials = storage.join(uri, "trials")
        raise FileNotFoundError(f"{uri} is a sweep's directory, not a run's: each trial is a run in {trials} "
                                f"(raylm status {storage.join(trials, 'TRIAL_ID')}); the sweep's results are its "
                                f"trials.csv and fit.json (raylm sweep --refit {uri})")
    runs = [storage.join(uri, name) for name in entries[:LISTED_ENTRIES]
            if storage.exists(storage.join(uri, name, CONFIG_FILE), storage_cfg)]
    shown = ", ".join(runs[:SHOWN_RUNS]) + (", ..." if len(runs) > SHOWN_RUNS else "")
    raise FileNotFoundError(f"{uri} holds no run (no {CONFIG_FILE}, {METRICS_FILE}, lease or checkpoint)" +
                            (f"; the runs in it: {shown}" if runs else ""))


def _ago(t: object) -> str:
    return f"{format_duration(time.time() - t)} ago" if isinstance(t, (int, float)) else "at an unknown time"


def _event_line(event: dict) -> str:
    # A float as 4 significant digits: a heal's seconds or a canary loss to 16 read as noise.
    shown = lambda v: f"{v:.4g}" if isinstance(v, float) else v  # noqa: E731
    details = ", ".join(f"{k}={shown(v)}" for k, v in event.items()
                        if k not in ("event", "time") and isinstance(v, (str, int, float)) and len(str(v)) < 80)
    return f"  {event.get('event')} {_ago(event.get('time'))}" + (f": {details}" if details else "")


def render(status: RunStatus) -> str:
    """The status as a few lines of text, the state first."""
    lines = [f"{status.uri}: {status.state} ({status.detail})"]
    if status.step is not None:
        of = f"/{status.steps}" if status.steps is not None else ""
        val = f", val loss {status.val_loss:.4f} at step {status.val_step}" if status.val_loss is not None else ""
        loss = f", loss {status.loss:.4f}" if isinstance(status.loss, (int, float)) else ""
        lines.append(f"step {status.step}{of}{loss}{val}")
    if status.tokens_per_s is not None:
        eta = f", eta {format_duration(status.eta_s)}" if status.eta_s is not None else ""
        lines.append(f"{status.tokens_per_s:,.0f} tokens/s{eta}")
    lines.append(f"newest complete checkpoint: {status.checkpoint or 'none'}")
    if status.events:
        lines.append("last events:")
        lines += [_event_line(e) for e in status.events]
    lines += [f"raylm: dropped {line}" for line in status.dropped]
    return "\n".join(lines)


def watch(uri: str, storage_cfg: Optional[StorageConfig], every_s: float) -> None:
    """`render` again every `every_s` seconds, on a terminal in place of the last, until Ctrl-C or
    the run has finished: nothing after that changes it (`raylm status RUN --watch && ...` waits for it)."""
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            status = run_status(uri, storage_cfg)
            print(f"{clear}{render(status)}\n{'' if clear else '-' * 40}", flush=True)
            if status.state == "finished":
                return
            time.sleep(every_s)
    except KeyboardInterrupt:  # the way out of --watch: no error
        print(file=sys.stderr)
