"""The stability guard's panel, reduced (`benchmarks/guard_panel.py --quick`: 300 steps a case, a
fifth of the poison, checks every 25 steps), on a text every Python carries (the standard
library's pydoc topics) in place of Shakespeare: the clean run is left alone, a poisoned window
is acted on and costs less than it does unguarded. Left to the full panel: the demo's case (its
model costs more than the rest together), the contiguous one (300 steps do not reach its domain
boundary) and the too-high LR (300 steps are too few for a restart at a lower LR to catch up with
the run it replaces, so only what the guard did could be checked here, and floating point decides
how often a run at 100x nanoGPT's LR stalls); a stall's restart at a scaled LR, a stall again up to
guard.max_rollbacks, and a NaN are tests/train/resilience/test_guard.py's, on real ranks."""

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
def test_the_reduced_guard_panel_leaves_a_clean_run_alone_and_saves_a_poisoned_one(tmp_path):
    text = tmp_path / "topics.txt"
    shutil.copy(pydoc_data.topics.__file__, text)
    out = tmp_path / "panel.json"
    done = subprocess.run([sys.executable, "benchmarks/guard_panel.py", "--quick", "--input", str(text),
                           "--workdir", str(tmp_path / "panel"), "--cost-rounds", "0", "--jobs", "2", "--json-out", str(out),
                           "--cases", "clean, shuffled: nanoGPT;poisoned"],
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
    poisoned = on["poisoned window"]
    assert poisoned["stopped"] is None and poisoned["actions"]["batch_skipped"] >= 1, poisoned
    assert poisoned["val_loss"] < off["poisoned window"]["val_loss"], (poisoned, off["poisoned window"])
