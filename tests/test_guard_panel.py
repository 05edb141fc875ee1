"""The stability guard's panel, reduced (`benchmarks/guard_panel.py --quick`: 300 steps a case, a
fifth of the poison, checks every 25 steps), on a text every Python carries (the standard
library's pydoc topics) in place of Shakespeare: the clean run is left alone; a poisoned window
and a too-high LR are acted on. Whether acting pays is the full panel's measure
(benchmarks/RESULTS.md): 300 steps are too few for a restart at a lower LR to catch up with the
run it replaces. Left to the full panel: the demo's case (its model costs more than the rest
together) and the contiguous one (300 steps do not reach its domain boundary); a NaN is
tests/train/resilience/test_guard.py's, on real ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pydoc_data.topics
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1800)
def test_the_reduced_guard_panel_leaves_clean_runs_alone_and_saves_troubled_ones(tmp_path):
    text = tmp_path / "topics.txt"
    shutil.copy(pydoc_data.topics.__file__, text)
    out = tmp_path / "panel.json"
    done = subprocess.run([sys.executable, "benchmarks/guard_panel.py", "--quick", "--input", str(text),
                           "--workdir", str(tmp_path / "panel"), "--cost-rounds", "0", "--jobs", "2", "--json-out", str(out),
                           "--high-lr", "0.3",
                           "--cases", "clean, shuffled: nanoGPT;poisoned;too-high"],
                          cwd=REPO, capture_output=True, text=True, timeout=1700,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(done.stdout[-6000:])
    report = json.loads(out.read_text())
    on = {name: cases["True"] for name, cases in report.items()}
    off = {name: cases["False"] for name, cases in report.items() if "False" in cases}
    clean = on["clean, shuffled: nanoGPT"]
    assert clean["stopped"] is None and clean["skipped_samples"] == 0, clean
    assert clean["val_loss"] <= off["clean, shuffled: nanoGPT"]["val_loss"] * 1.01, (clean, off)
    assert clean["actions"]["rollback"] == 0 and clean["actions"]["lr_cut"] == 0, clean
    # Stalled at the unigram level: back to its best snapshot with the whole schedule halved at each
    # stall, nothing skipped by the stalls. How many stalls it takes (and whether a spike on the way
    # is judged noise) floating point decides: at 0.1, 100x nanoGPT's LR, this text's run stalls on
    # one CPU and trains at 80% of the unigram loss on another; at 0.25, 0.3 and 0.35 it stalled
    # every time on this machine.
    high = on["too-high LR"]
    assert high["stopped"] is None and high["extra"]["stalls"] >= 1, high
    assert high["lr_scale"] == 0.5 ** high["extra"]["stalls"] and high["extra"]["skipped_by_stalls"] == 0, high
    poisoned = on["poisoned window"]
    assert poisoned["stopped"] is None and poisoned["actions"]["batch_skipped"] >= 1, poisoned
    assert poisoned["val_loss"] < off["poisoned window"]["val_loss"], (poisoned, off["poisoned window"])
