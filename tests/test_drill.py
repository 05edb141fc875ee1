"""The OPT logbook drill's quick version (`benchmarks/drill.py --quick`), as its users run it: one
elastic run on the local multi-node cluster meets a killed worker, a full disk (where this
machine lets the test mount a tmpfs), a poisoned window, a non-finite loss and a killed driver
whose command is run again; no human acts, and every planned sample is trained exactly once but
the ones the guard skipped, which are recorded."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raylm.train.observe.records import read_jsonl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_the_quick_drill_needs_no_human_and_loses_no_sample(tmp_path):
    out = tmp_path / "drill.json"
    done = subprocess.run([sys.executable, "benchmarks/drill.py", "--quick", "--workdir", str(tmp_path / "drill"),
                           "--json-out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["human_actions"] == 0 and report["finished"]
    assert report["samples_once"], {k: report[k] for k in ("samples_missing", "samples_repeated", "samples_unplanned")}
    kinds = {f["kind"] for f in report["faults"]}
    assert {"worker_killed", "non_finite_loss", "driver_killed"} <= kinds
    assert all(f["next_good_step_s"] is not None for f in report["faults"] if f["kind"] != "disk_freed")
    # Every skipped sample is in the run's records: its skip ranges are what the audit left out.
    assert report["skipped_samples"] == sum(end - start for start, end in report["skipped_ranges"])
    run_dir = Path(report["run_dir"])
    events = read_jsonl(str(run_dir / "events.jsonl"))
    names = [e["event"] for e in events]
    assert "rerun" in names and names.count("resumed") >= 2  # the killed worker, the killed driver
    # The skipped batches' time is the guard's, not the run's useful time nor its restarts'.
    assert "batch_skipped" not in names or report["guard_replays_s"] > 0
    assert 0 < report["goodput"] < 1 and report["useful_s"] + report["guard_checks_s"] < report["wall_s"]
    if report["full_disk_fault"]:
        assert {"disk_full", "disk_freed"} <= kinds
        assert "checkpoint_failed" in names and "checkpoint_recovered" in names
    assert (run_dir / "report" / "report.html").exists()
    for key in ("human_actions", "val_loss", "clean_val_loss", "goodput", "samples_once", "skipped_samples", "faults",
                "run_dir", "clean_run_dir"):
        assert key in report


def test_rounds_strike_each_fault_again_in_order_and_every_injected_nan_is_reported(monkeypatch):
    """`--rounds 2`: the issue's fault every ~10 minutes on the full drill. Each kind comes twice,
    in the order of one round (a node returns after it was lost, before the next loss), all in the
    run's middle 80%; each injected non-finite loss is a fault of the report (the guard's rerun)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as the script runs: its helpers beside it
    spec = importlib.util.spec_from_file_location("drill", REPO / "benchmarks" / "drill.py")
    drill = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "drill", drill)  # its dataclasses look their module up
    spec.loader.exec_module(drill)
    kinds = ["worker_killed", "node_lost", "node_returned", "disk_full", "non_finite_loss", "driver_killed"]
    plan = drill.schedule(12000, kinds * 2, seed=0)
    steps = [step for step, _ in plan]
    assert [kind for _, kind in plan] == kinds * 2
    assert steps == sorted(set(steps)) and 1200 <= steps[0] and steps[-1] <= 10800
    # Step 4000 met again by the processes of a restart from an earlier checkpoint: one fault.
    events = [{"event": "rerun", "step": 4000, "time": 100.0}, {"event": "resumed", "time": 150.0},
              {"event": "rerun", "step": 4000, "time": 170.0}, {"event": "rerun", "step": 9000, "time": 200.0}]
    rows = [{"step": 4000, "time": 101.5}, {"step": 4000, "time": 171.0}, {"step": 9000, "time": 200.25}]
    faults = drill.nan_faults(events, rows)
    assert [(f.kind, f.at_step, f.next_good_step_s, f.detail) for f in faults] == \
        [("non_finite_loss", 4000, 1.5, {"reruns": 2}), ("non_finite_loss", 9000, 0.25, {"reruns": 1})]
