"""`benchmarks/curve_bend.py`'s measure of text shared by two splits: the share of one split's
64-token windows (one every 64 tokens) found verbatim anywhere in the other."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "curve_bend.py"


def load_script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as the script runs: sweep_seeds.py beside it
    spec = importlib.util.spec_from_file_location("curve_bend", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shared_share_counts_exactly_the_windows_copied_from_the_other_split(monkeypatch):
    curve_bend = load_script(monkeypatch)
    rng = np.random.default_rng(0)
    train = rng.integers(0, 257, 20_000)
    val = rng.integers(0, 257, 6400)  # 100 windows
    known = curve_bend.known_windows(train)
    assert curve_bend.found_share(train, known) == 1.0
    assert curve_bend.found_share(val, known) == 0.0
    # 2,048 training tokens copied into val at token 1,024: the 32 windows wholly inside them are
    # found; the windows that straddle the copy's ends are not.
    val[1024:3072] = train[5000:7048]
    assert curve_bend.found_share(val, known) == 0.32
    # Found wherever they lie in the other split, and not when one token of each copy differs.
    val[1024:3072:64] = (val[1024:3072:64] + 1) % 257
    assert curve_bend.found_share(val, known) == 0.0
