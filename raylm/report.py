"""`raylm report`: figures and one self-contained HTML page for one or more runs.

A run directory (local or s3://) holds metrics.jsonl (one row per committed step; a resume
drops the rows of steps that were trained again), events.jsonl (failures, resumes, and the
stability guard's actions) and config.yaml; with `train.profile`, profile/ holds its traces (the
page links them). Every figure has the step on its x axis with each event drawn where it happened;
runs given together are overlaid. Keys a run lacks (MFU on an old run, activation norms before
the guard writes them) are left out, not errors. A record line the report cannot use (torn by a
kill, garbled, a metrics row without an integer "step") is left out and named; a run with no
metrics row left is refused.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Optional

from raylm.config import CONFIG_FILE, StorageConfig
from raylm.data import storage
from raylm.errors import RecordError
from raylm.train.checkpoint import format as checkpoint
from raylm.train.observe.records import EVENTS_FILE, METRICS_FILE, PROFILE_DIR, read_records

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NORM_KEY = re.compile(r"^(act|activation|param)_?norm")  # the guard's per-layer norms
EVENT_COLORS = {"failure": "tab:red", "resumed": "tab:orange", "resize": "tab:purple", "rollback": "tab:brown",
                "batch_skipped": "tab:olive", "lr_cut": "tab:blue", "hard_batch": "tab:gray", "rerun": "tab:pink",
                "guard_stopped": "black", "checkpoint_failed": "tab:red", "checkpoint_recovered": "tab:green",
                "lease_taken_over": "tab:cyan", "preempted": "gold", "samples_quarantined": "khaki",
                "replica_lost": "crimson", "replica_healed": "seagreen", "noise_masking": "olive",
                "rows_masked": "yellowgreen"}
RUN_STYLES = ("-", "--", ":", "-.")


# The fields the summary and figures compute with, and what each must hold: a row with anything
# else there (a hand-edited or garbled record) is dropped and named rather than failing the report.
INTEGER, NUMBER, TIMESTAMP, FLAG, TEXT = "an integer", "a number", "a finite number", "true or false", "a string"
METRIC_FIELDS = {"step": INTEGER, "tokens": INTEGER, "global_batch": INTEGER, "skipped_samples": INTEGER,
                 "time": TIMESTAMP, "step_time": NUMBER, "guard_s": NUMBER, "data_wait": NUMBER,
                 "checkpoint_s": NUMBER, "discarded_s": NUMBER, "val_loss": NUMBER}
EVENT_FIELDS = {"step": INTEGER, "from_step": INTEGER, "to_step": INTEGER, "steps_lost": INTEGER,
                "skipped_samples": INTEGER, "time": TIMESTAMP, "lr_cut": FLAG, "resize": TEXT}


def _holds(value: object, kind: str) -> bool:
    if kind in (FLAG, TEXT):
        return isinstance(value, bool if kind == FLAG else str)
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # JSON's true is no count
        return False
    return isinstance(value, int) if kind == INTEGER else kind == NUMBER or math.isfinite(value)


def _problem(row: dict, fields: dict[str, str], required: tuple[str, ...] = ()) -> Optional[str]:
    """Why `row` cannot be used (read_records' `problem`), or None."""
    for key in required:
        if key not in row:
            return f'no "{key}"'
    for key, kind in fields.items():
        if key in row and not _holds(row[key], kind):
            return f'"{key}" is {json.dumps(row[key])[:40]}, not {kind}'
    return None


class NothingToReport(RecordError):
    """A run whose metrics.jsonl holds no row to report; the message names the file and why each
    line was dropped. The user named the run, so it is their input: exit 2."""

    exit_code = 2


@dataclass
class RunRecord:
    uri: str
    label: str
    rows: list[dict]
    events: list[dict]
    config: Optional[str]
    summary: dict = field(default_factory=dict)
    profiles: list[str] = field(default_factory=list)
    """URIs of the profiler traces and memory snapshots under the run's profile/."""
    dropped: list[str] = field(default_factory=list)
    """The record lines left out: torn by a kill, garbled, or a field the report computes with
    holding no value it can use (`METRIC_FIELDS`, `EVENT_FIELDS`)."""


def _saved_world_size(uri: str, step: int, storage_cfg: Optional[StorageConfig]) -> Optional[int]:
    """The world size that wrote the checkpoint of `step`, if it is still there."""
    state = storage.join(uri, checkpoint.dir_name(step), checkpoint.TRAIN_STATE)
    if not storage.exists(state, storage_cfg):
        return None
    return json.loads(storage.read_bytes(state, storage_cfg)).get("world_size")


def _event_step(event: dict, rows: list[dict]) -> Optional[int]:
    """Where an event goes on the step axis: its own step, the step it resumed from, the
    last step written before it (rows with times), or the checkpoint it restarted from."""
    for key in ("step", "from_step"):
        if isinstance(event.get(key), (int, float)):
            return int(event[key])
    if "time" in event and rows and "time" in rows[0]:
        before = [r["step"] for r in rows if r.get("time", float("inf")) <= event["time"]]
        return before[-1] if before else 0
    name = str(event.get("restart_from") or "").rstrip("/").rsplit("/", 1)[-1]
    return checkpoint.step_of(name)


def load_run(uri: str, label: str, storage_cfg: Optional[StorageConfig] = None) -> RunRecord:
    storage.refuse_file(uri, f"the run directory that holds {METRICS_FILE}")
    metrics_uri = storage.join(uri, METRICS_FILE)
    if not storage.exists(metrics_uri, storage_cfg):
        if not storage.exists(uri, storage_cfg):
            raise FileNotFoundError(f"{uri} does not exist")
        raise FileNotFoundError(f"{uri} is not a run directory, or its run has no step yet: no {METRICS_FILE}")
    rows, dropped = read_records(metrics_uri, storage_cfg, lambda row: _problem(row, METRIC_FIELDS, ("step",)))
    if not rows:
        why = "; ".join(line.removeprefix(f"{metrics_uri} ") for line in dropped[:3])
        more = f"; {len(dropped) - 3} more line(s) like them" if len(dropped) > 3 else ""
        raise NothingToReport(f"{metrics_uri} holds no row to report (one JSON object with an integer \"step\" "
                              f"per line): {why + more if dropped else 'it is empty'}")
    # A step trained again after a guard rollback is written again: its last row is the one kept.
    rows = sorted({row["step"]: row for row in rows}.values(), key=lambda r: r["step"])
    events, dropped_events = read_records(storage.join(uri, EVENTS_FILE), storage_cfg,
                                          lambda row: _problem(row, EVENT_FIELDS))
    config_uri = storage.join(uri, CONFIG_FILE)
    if not storage.exists(config_uri, storage_cfg):  # runs outside `raylm train`: the newest checkpoint's
        latest = checkpoint.latest_complete(uri, storage_cfg)
        config_uri = storage.join(latest, CONFIG_FILE) if latest else None
    config = storage.read_bytes(config_uri, storage_cfg).decode() if config_uri else None
    world = None
    for event in events:
        event["_step"] = _event_step(event, rows)
        if event.get("event") == "resumed":
            # An earlier raylm's events lack from_world_size: the checkpoint resumed from says it.
            before = event.get("from_world_size") or _saved_world_size(uri, event.get("from_step", 0), storage_cfg) \
                or world
            if before is not None and event.get("world_size") not in (None, before):
                event["resize"] = f"{before}→{event['world_size']}"
            world = event.get("world_size", world)
    profile_dir = storage.join(uri, PROFILE_DIR)
    profiles = [storage.join(profile_dir, name) for name in storage.list_dir(profile_dir, storage_cfg)
                if name.endswith((".json", ".json.gz", ".pickle"))]
    run = RunRecord(uri, label, rows, events, config, profiles=profiles, dropped=dropped + dropped_events)
    run.summary = summarize(run)
    return run


def split_step_time(rows: list[dict]) -> tuple[float, float, float]:
    """The committed steps' time as (compute, the guard's own work in them, their wait for data):
    compute is goodput's numerator, here and in benchmarks/drill.py. A step of replica groups
    (parallel.fault_tolerance=replica) trained while some were down counts for the share that
    trained (`replicas` of the most the run had): the rest of its time is `replica_capacity_lost`'s."""
    guard = sum(r.get("guard_s", 0.0) for r in rows)
    waits = sum(r.get("data_wait", 0.0) for r in rows)
    steps = sum(r["step_time"] for r in rows if "step_time" in r)
    return steps - replica_capacity_lost(rows) - guard - waits, guard, waits


def replica_capacity_lost(rows: list[dict]) -> float:
    """Seconds of the groups that were down: each step's time times the share of the replica
    groups missing from it."""
    groups = max((r["replicas"] for r in rows if "replicas" in r), default=0)
    return sum(r["step_time"] * (1 - r["replicas"] / groups) for r in rows if "replicas" in r and "step_time" in r)


def time_lost_to_failures(events: list[dict], median_step: float) -> float:
    """Seconds from each failure (or preemption) to the resume that followed it, plus the steps
    that resume trained again (its `steps_lost`, at `median_step` seconds each)."""
    lost, failure_time = 0.0, None
    for event in sorted((e for e in events if "time" in e), key=lambda e: e["time"]):
        if event.get("event") in ("failure", "preempted"):
            failure_time = failure_time or event["time"]
        elif event.get("event") == "resumed":
            if failure_time is not None:
                lost += event["time"] - failure_time
            lost += event.get("steps_lost", 0) * median_step
            failure_time = None
    return lost


def summarize(run: RunRecord) -> dict:
    """Final losses, tokens, time; time lost to failures; goodput.

    Productive time is the compute of the committed steps (their step time less the guard's work
    and the wait for data in them); the guard's time is its work in them and the steps it
    discarded (skipped batches, rollbacks: `discarded_s`). Time lost to a failure (or a
    preemption) is the gap from it to the resume that followed it, plus the steps trained again (the resume's
    `steps_lost`, at the median step time); a guard rollback loses the steps it trains again.
    Wall time comes from timestamps (metrics rows' `time`, when the loop writes it, and events);
    without them goodput is over the time accounted for: steps, checkpoint stalls and losses.
    """
    rows, events = run.rows, run.events
    step_times = [r["step_time"] for r in rows if "step_time" in r]
    productive, guard_s, data_waits = split_step_time(rows)
    median_step = statistics.median(step_times) if step_times else 0.0
    stalls = sum(r.get("checkpoint_s", 0.0) for r in rows)
    lost = time_lost_to_failures(events, median_step)
    # A lost replica group: the others' step given up and their wait for the quorum without it
    # (`replica_s`, outside step_time), and the share of each step the group was down for.
    lost_to_replicas = sum(r.get("replica_s", 0.0) for r in rows) + replica_capacity_lost(rows)
    rollbacks = [e for e in events if e.get("event") == "rollback"]
    lost_to_rollbacks = sum(max(0, e.get("step", 0) - e.get("to_step", 0)) for e in rollbacks) * median_step
    val = [r for r in rows if "val_loss" in r]
    times = [r["time"] for r in rows if "time" in r] + [e["time"] for e in events if "time" in e]
    wall = (max(times) - min(times) + (step_times[0] if step_times else 0.0)) if rows and "time" in rows[0] else None
    accounted = wall if wall is not None else productive + stalls + lost + lost_to_replicas + lost_to_rollbacks
    return {
        "steps": rows[-1]["step"] if rows else 0,
        "tokens": rows[-1].get("tokens") if rows else None,
        "final loss": rows[-1].get("loss") if rows else None,
        "final val_loss": val[-1]["val_loss"] if val else None,
        "best val_loss": min(r["val_loss"] for r in val) if val else None,
        "failures": sum(e.get("event") == "failure" for e in events),
        "preemptions": sum(e.get("event") == "preempted" for e in events),
        "restarts": sum(e.get("event") == "resumed" for e in events),
        "resizes": sum("resize" in e or e.get("event") == "resize" for e in events),
        "replica groups lost": sum(e.get("event") == "replica_lost" for e in events),
        "replica groups healed": sum(e.get("event") == "replica_healed" for e in events),
        "skipped samples": _skipped(rows, events),
        "skipped tokens": _skipped(rows, events) * _tokens_per_sample(rows),
        "rollbacks": len(rollbacks),
        # A rollback that only left out its suspects kept the LR (runs before the field: so did any
        # that left out samples but the same-place one, which cut too).
        "LR cuts": sum(e.get("event") == "lr_cut" for e in events)
        + sum(e.get("lr_cut", not e.get("skipped")) for e in rollbacks),
        "productive time (s)": productive,
        "guard (s)": guard_s + sum(r.get("discarded_s", 0.0) for r in rows),
        "data waits (s)": data_waits,
        "checkpoint stalls (s)": stalls,
        "time lost to failures (s)": lost,
        "time lost to replica losses (s)": lost_to_replicas,
        "time lost to rollbacks (s)": lost_to_rollbacks,
        "wall time (s)": wall,
        "goodput": productive / accounted if accounted else None,
        "goodput basis": "wall time" if wall is not None else "steps + checkpoint stalls + time lost",
    }


def _skipped(rows: list[dict], events: list[dict]) -> int:
    """Samples the stability guard left out: the run's own count, else its events' last."""
    for r in reversed(rows):
        if "skipped_samples" in r:
            return r["skipped_samples"]
    counts = [e["skipped_samples"] for e in events if "skipped_samples" in e]
    return counts[-1] if counts else 0


def _tokens_per_sample(rows: list[dict]) -> int:
    """A sample's tokens (seq_len): what one step adds to `tokens`, over its global batch."""
    for before, after in zip([{"step": 0, "tokens": 0}, *rows], rows):
        if after["step"] == before["step"] + 1 and after.get("global_batch") and "tokens" in after:
            return round((after["tokens"] - before.get("tokens", 0)) / after["global_batch"])
    return 0


# ----------------------------------------------------------------------------- figures


def _mark_events(ax, runs: list[RunRecord]) -> None:
    for run in runs:
        for event in run.events:
            if event.get("_step") is not None:
                kind = "resize" if "resize" in event else event.get("event", "event")
                ax.axvline(event["_step"], color=EVENT_COLORS.get(kind, "tab:cyan"), alpha=0.6, linewidth=1,
                           label=f"event: {kind}")


def _series(run: RunRecord, key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in run.rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _figure(runs: list[RunRecord], panels: list[tuple[str, list[str]]], title: str, log_y: bool = False) -> "Figure":
    """One or more stacked panels (y label, metric keys), every run overlaid."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    fig = Figure(figsize=(9, 3.2 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (ylabel, keys) in zip(axes, panels):
        for i, run in enumerate(runs):
            for key in keys:
                steps, values = _series(run, key)
                if steps:
                    # Evaluations come every train.eval_every steps: points, joined. A line through
                    # one point draws nothing (a run evaluated once, a run of one step).
                    marker = "o" if key.startswith("val_") or len(steps) == 1 else None
                    ax.plot(steps, values, RUN_STYLES[i % len(RUN_STYLES)], marker=marker, markersize=3,
                            label=f"{run.label}: {key}" if len(runs) > 1 or len(keys) > 1 else key)
        _mark_events(ax, runs)
        if log_y:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))  # one legend entry per event kind
        if unique:
            ax.legend(unique.values(), unique.keys(), fontsize=7, loc="best")
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")
    return fig


def _png(fig: "Figure") -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def figures(runs: list[RunRecord]) -> dict[str, tuple[str, bytes]]:
    """file name -> (caption, PNG bytes), for the panels some run has data for."""
    have = {key for run in runs for row in run.rows for key in row}
    norms = sorted(k for k in have if NORM_KEY.match(k))
    specs = [("loss.png", "Loss and validation loss", [("loss", ["loss", "val_loss"])], False),
             ("bits_per_byte.png", "Validation bits per byte", [("bits/byte", ["val_bpb"])], False),
             ("lr.png", "Learning rate", [("lr", ["lr"])], False),
             ("grad_norm.png", "Gradient norm (before clipping)", [("grad norm", ["grad_norm"])], True),
             ("throughput.png", "Throughput and MFU", [("tokens/s", ["tokens_per_s"]), ("MFU", ["mfu"])], False),
             ("norms.png", "Activation and parameter norms", [("norm", norms)], True),
             ("checkpoint_stalls.png", "Checkpoint stalls (s the loop was blocked)", [("s", ["checkpoint_s"])], False)]
    out = {}
    for name, caption, panels, log_y in specs:
        panels = [(label, [k for k in keys if k in have]) for label, keys in panels]
        panels = [p for p in panels if p[1]]
        if panels:
            out[name] = (caption, _png(_figure(runs, panels, caption, log_y)))
    return out


# ----------------------------------------------------------------------------- HTML


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _event_time(event: dict) -> str:
    if "time" not in event:
        return "–"
    return datetime.fromtimestamp(event["time"], tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _href(uri: str, output: Optional[str]) -> str:
    """A link from the report in `output` to `uri`: relative where both are local, so the pair can
    move together; an s3:// URI as it is (a browser cannot open it: copy the file down first)."""
    if output is None or storage.is_s3(uri) or storage.is_s3(output):
        return uri
    return os.path.relpath(uri, output)


def _profiles_html(runs: list[RunRecord], output: Optional[str]) -> str:
    if not any(run.profiles for run in runs):
        return ""
    e = html.escape
    items = "".join(f"<li>{e(run.label)}: " + ", ".join(
        f'<a href="{e(_href(uri, output))}">{e(uri.rsplit("/", 1)[-1])}</a>' for uri in run.profiles) + "</li>"
        for run in runs if run.profiles)
    return ("<h2>Profiles</h2><p>Open a trace (.trace.json) in https://ui.perfetto.dev or chrome://tracing, and a "
            "memory snapshot (.pickle) in https://pytorch.org/memory_viz: each loads the file from disk.</p>"
            f"<ul>{items}</ul>")


def render_html(runs: list[RunRecord], figs: dict[str, tuple[str, bytes]], output: Optional[str] = None) -> str:
    """The page; `output` is where it will be written, for relative links to the runs' profiles."""
    e = html.escape
    head = "".join(f"<th>{e(run.label)}</th>" for run in runs)
    summary = "".join(f"<tr><th>{e(key)}</th>" + "".join(f"<td>{e(_fmt(run.summary[key]))}</td>" for run in runs)
                      + "</tr>" for key in runs[0].summary)
    images = "".join(f'<figure><img alt="{e(caption)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
                     f"<figcaption>{e(caption)}</figcaption></figure>" for caption, png in figs.values())
    events = "".join(
        f"<tr><td>{e(run.label)}</td><td>{e(_event_time(ev))}</td><td>{e(_fmt(ev.get('_step')))}</td>"
        f"<td class=ev-{e(str(ev.get('event')))}>{e(str(ev.get('event')))}"
        f"{e(' (resize ' + ev['resize'] + ')') if 'resize' in ev else ''}</td>"
        f"<td><code>{e(json.dumps({k: v for k, v in ev.items() if k not in ('event', 'time', '_step')}))}</code></td></tr>"
        for run in runs for ev in sorted(run.events, key=lambda ev: ev.get("time", 0)))
    configs = "".join(f"<details><summary>{e(run.label)}: config.yaml</summary><pre>{e(run.config or 'no config.yaml')}"
                      "</pre></details>" for run in runs)
    style = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}"
             "img{max-width:100%}code{font-size:11px}.ev-failure{color:#c00}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>raylm report: "
            f"{e(', '.join(r.label for r in runs))}</title><style>{style}</style></head><body>"
            f"<h1>raylm report</h1><p>{''.join(f'<div>{e(r.label)}: <code>{e(r.uri)}</code></div>' for r in runs)}</p>"
            f"<h2>Summary</h2><table><tr><th></th>{head}</tr>{summary}</table>"
            f"<h2>Figures</h2>{images}"
            f"<h2>Events</h2><table><tr><th>run</th><th>time</th><th>step</th><th>event</th><th>details</th></tr>"
            f"{events or '<tr><td colspan=5>no events</td></tr>'}</table>"
            f"{_profiles_html(runs, output)}"
            f"<h2>Resolved config</h2>{configs}</body></html>\n")


def _labels(uris: list[str]) -> list[str]:
    names = [uri.rstrip("/").rsplit("/", 1)[-1] for uri in uris]
    return [name if names.count(name) == 1 else f"{name} ({i + 1})" for i, name in enumerate(names)]


def write_report(run_uris: list[str], output: Optional[str] = None,
                 storage_cfg: Optional[StorageConfig] = None) -> dict:
    """Figures and report.html for the runs at `run_uris` into `output` (default: the first
    run's `report/`), local or s3://; returns the files written and the record lines left out
    (`RunRecord.dropped`), for the caller to name. `output` is new, empty or an earlier report's
    (a directory holding anything else: FileExistsError). The report is written whole or not at
    all (`storage.writing_over`): a failure (a full disk) leaves an earlier report as it was and no
    part of a new one; figures of an earlier report that this one has not are gone with it."""
    runs = [load_run(uri, label, storage_cfg) for uri, label in zip(run_uris, _labels(run_uris))]
    output = output or storage.join(run_uris[0], "report")
    # A report's own files only: a dataset's or a user's files (a loss.png of their own) are theirs.
    earlier = storage.list_dir(output, storage_cfg) if storage.exists(storage.join(output, "report.html"),
                                                                      storage_cfg) else []
    own = lambda name: name in earlier and (name == "report.html" or name.endswith(".png"))  # noqa: E731
    replace = storage.claim_output(output, "a report", own, overwrite=True, storage=storage_cfg)
    figs = figures(runs)
    files = {**{name: png for name, (_, png) in figs.items()}, "report.html": render_html(runs, figs, output).encode()}
    with storage.writing_over(output, storage_cfg, replace, commit="report.html") as target:
        for name in sorted(files, key=lambda n: n == "report.html"):  # the page last: it names the figures
            storage.write_bytes(storage.join(target, name), files[name], storage_cfg)
    return {"output": output, "files": list(files), "runs": {r.label: r.summary for r in runs},
            "dropped": [line for r in runs for line in r.dropped]}
