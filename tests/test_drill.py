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


def _drill_module(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("drill", REPO / "benchmarks" / "drill.py")
    drill = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "drill", drill)
    spec.loader.exec_module(drill)
    return drill


def test_replica_mode_counts_given_up_steps_reduced_quorum_heals_and_restarted_workers(monkeypatch, tmp_path):
    """`--fault-tolerance replica`: the goodput's replica costs and each group loss's figures, from
    records such as a run writes (2 groups; group 0 lost after step 2, healed at step 4)."""
    drill = _drill_module(monkeypatch)
    assert "parallel.fault_tolerance=replica" in drill.run_args("d", tmp_path, 10, True, [], "replica")
    assert "parallel.min_workers=1" in drill.run_args("d", tmp_path, 10, True, [])
    # Steps of 1 s; steps 3 and 4 trained by one group of 2 (half of each lost), step 3 after 2.5 s
    # given up and waited for the quorum.
    rows = [{"step": s, "time": 100.0 + s, "step_time": 1.0, "replicas": 2 if s not in (3, 4) else 1,
             "replica_s": 2.5 if s == 3 else 0.0} for s in range(1, 7)]
    times = drill.goodput(rows, [], 90.0, 110.0)
    assert times["replica_given_up_s"] == 2.5 and times["reduced_quorum_s"] == 1.0
    assert times["reduced_quorum_steps"] == 2 and times["useful_s"] == 5.0 and times["goodput"] == 5.0 / 20
    assert times["startup_restarts_resizes_evaluation_s"] == 20 - 5.0 - 2.5 - 1.0
    # Each group loss: the first replica_lost after it and that group's next replica_healed.
    log = tmp_path / "driver.log"
    log.write_text("(RayTrainWorker pid=7) raylm: replica group 0 of 2 in process 7\n"
                   "(RayTrainWorker pid=8) raylm: replica group 1 of 2 in process 8\n"
                   "(RayTrainWorker pid=9) raylm: replica group 0 of 2 in process 9: joins the running quorum\n")
    assert drill.group_processes(log) == {0: [7, 9], 1: [8]}
    events = [{"event": "replica_lost", "group": 0, "step": 3, "retried": 1, "time": 103.0},
              {"event": "replica_healed", "group": 0, "step": 5, "seconds": 2.0, "time": 105.5}]
    kill = drill.Fault("worker_killed", at_step=2, time=101.5)
    nan = drill.Fault("non_finite_loss", at_step=4, time=104.0)
    fake = type("FakeDrill", (), {"lives": [drill.group_processes(log), {0: [10], 1: [11]}]})()
    figures = drill.replica_figures(fake, [kill, nan], events)
    assert kill.detail == {"group": 0, "steps_lost": 1, "next_step_s": 1.5, "heal_s": 4.0, "healed_at_step": 5}
    assert nan.detail == {}
    # Two drivers started 2 groups each; the kill started one more: no healthy worker restarted.
    assert {k: figures[k] for k in ("steps_lost", "next_step_s", "heal_s", "healthy_restarts", "replica_faults")} == \
        {"steps_lost": 1, "next_step_s": 1.5, "heal_s": 4.0, "healthy_restarts": 0, "replica_faults": 1}
