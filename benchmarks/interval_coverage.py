"""Are the sweeps' prediction intervals as wide as they should be? For each recorded sweep under
benchmarks/sweeps/, whether the held-out rung's measured loss (the mean of its seeds where the
record has them, else its one trial) lies inside the interval fit.json reported, and how wide
that interval is. A 95% interval that holds the measured loss in far more than 95% of the records
is wider than the data warrant; in far fewer, narrower. The records are not independent (several
are refits or variants of one ladder on one corpus), so the count is a rough check, not a test.

    python benchmarks/interval_coverage.py [records...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "sweeps"


def coverage(fit: dict) -> dict:
    """The held-out rung's interval against its measured loss (seeds averaged where run)."""
    check = fit["check"]
    held_out = ((check.get("averaged") or {}).get("shapes") or [{}])[0]
    losses = held_out.get("losses") or [check["measured_loss"]]
    measured = sum(losses) / len(losses)
    low, high = check["interval"]
    predicted = check["predicted_loss"]
    return {"seeds": len(losses), "error": (predicted - measured) / measured, "low": low / predicted - 1,
            "high": high / predicted - 1, "inside": low <= measured <= high,
            "confidence": fit["parametric"].get("confidence")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="*", type=Path, help="sweep directories (default: every one under benchmarks/sweeps)")
    args = parser.parse_args()
    records = args.records or sorted(p for p in RECORDS.iterdir() if (p / "fit.json").exists())
    rows = []
    for record in records:
        fit = json.loads((record / "fit.json").read_text())
        if fit.get("check", {}).get("measured_loss") is None:
            continue
        row = coverage(fit)
        rows.append(row)
        print(f"{record.name:46s} {fit['check']['predictor']:10s} seeds {row['seeds']}  error {100 * row['error']:+6.2f}%  "
              f"interval {100 * row['low']:+6.2f}/{100 * row['high']:+6.2f}%  {'inside' if row['inside'] else 'OUTSIDE'}")
    for label, group in (("every record", rows), ("seeds averaged", [r for r in rows if r["seeds"] > 1])):
        if group:
            inside = sum(r["inside"] for r in group)
            widths = sorted(r["high"] - r["low"] for r in group)
            stated = ", ".join(sorted({f"{r['confidence']:g}" for r in group}))
            print(f"{label}: {inside} of {len(group)} inside ({100 * inside / len(group):.0f}%) at a stated confidence of "
                  f"{stated}; median width {100 * widths[len(widths) // 2]:.1f} points")


if __name__ == "__main__":
    main()
