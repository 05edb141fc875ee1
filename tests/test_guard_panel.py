"""The stability guard's panel, reduced (`benchmarks/guard_panel.py --quick`: 300 steps a case, a
fifth of the poison, checks every 25 steps; the demo's case, whose model costs more than the rest
together, is left to the full panel), on a text every Python carries
(the standard library's pydoc topics) in place of Shakespeare: the clean runs, shuffled and
crossing a domain boundary, are left alone; a poisoned window, a too-high LR and a NaN are acted
on. Whether acting pays is the full panel's measure (benchmarks/RESULTS.md): 300 steps are too
few for a restart at a lower LR to catch up with the run it replaces."""

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
                           "--workdir", str(tmp_path / "panel"), "--cost-rounds", "0", "--json-out", str(out),
                           "--cases", "clean, shuffled: nanoGPT;clean, contiguous;poisoned;too-high;NaN"],
                          cwd=REPO, capture_output=True, text=True, timeout=1700,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(done.stdout[-6000:])
    report = json.loads(out.read_text())
    on = {name: cases["True"] for name, cases in report.items()}
    off = {name: cases["False"] for name, cases in report.items() if "False" in cases}
    for name in ("clean, shuffled: nanoGPT", "clean, contiguous"):
        assert on[name]["stopped"] is None and on[name]["skipped_samples"] == 0, (name, on[name])
        assert on[name]["val_loss"] <= off[name]["val_loss"] * 1.01, (name, on[name], off[name])
        assert on[name]["actions"]["rollback"] == 0 and on[name]["actions"]["lr_cut"] == 0, (name, on[name])
    nan = on["NaN once"]
    assert nan["stopped"] is None and nan["skipped_samples"] == 0 and nan["actions"]["rerun"] == 1
    # Stalled at the unigram level: back to its best snapshot with the whole schedule halved, no skip.
    high = on["too-high LR"]
    assert high["stopped"] is None and high["actions"]["rollback"] >= 1 and high["lr_scale"] == 0.5, high
    assert high["skipped_samples"] == 0
    poisoned = on["poisoned window"]
    assert poisoned["stopped"] is None and poisoned["actions"]["batch_skipped"] >= 1, poisoned
    assert poisoned["val_loss"] < off["poisoned window"]["val_loss"], (poisoned, off["poisoned window"])
