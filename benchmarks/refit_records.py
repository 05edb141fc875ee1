"""Do the recorded sweeps' numbers come back on this machine? `raylm sweep --refit` on a scratch
copy of each sweep directory under benchmarks/sweeps/, compared with the fit.json it recorded.

The fits are L-BFGS runs, and where the Chinchilla form is underdetermined (on 2 sizes every
alpha fits the rungs alike; a valley towards alpha = infinity) where the optimizer stops depends
on the scipy and numpy it runs on. This prints, for each record, the chosen predictor, the
held-out error and each predictor's cross-validated error, recorded and refitted, marking what
differs at 4 significant digits, then the counts. Other library versions, e.g. installed with
`pip install --target /tmp/oldsci scipy==1.14.1 numpy==2.1.3`:

    OMP_NUM_THREADS=1 python benchmarks/refit_records.py
    PYTHONPATH=/tmp/oldsci OMP_NUM_THREADS=1 python benchmarks/refit_records.py

`--local-sizes N` refits every copy with `fit.local_sizes: N` (0: the local form on every size)
instead, and ends with the mean absolute held-out error (seeds averaged where the record has
them) of the records as recorded and as refitted: what another choice of that setting would have
predicted from the same trials.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sweep_seeds import with_local_sizes

from raylm.sweep.results import fitted_with

RECORDS = Path(__file__).resolve().parent / "sweeps"


def figures(fit: dict) -> dict[str, object]:
    """What a reader of RESULTS.md takes from a record, rounded to 4 significant digits."""
    def rounded(x):
        return None if x is None else float(f"{x:.4g}")
    averaged = fit["check"].get("averaged") or {}
    out = {"chosen predictor": fit["predictor"]["chosen"],
           "held-out error": rounded(fit["check"]["relative_error"]),
           "held-out error, seeds": rounded(averaged.get("relative_error"))}
    for name, predictor in fit["predictors"].items():
        out[f"{name} cross-validated"] = rounded(predictor.get("cross_validation", {}).get("mean_abs_error"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="*", type=Path, help="sweep directories (default: every one under benchmarks/sweeps)")
    parser.add_argument("--local-sizes", type=int, help="refit with this fit.local_sizes (0: every size)")
    args = parser.parse_args()
    records = args.records or sorted(p for p in RECORDS.iterdir() if (p / "fit.json").exists())
    print(", ".join(f"{name} {version}" for name, version in fitted_with().items()))
    same: dict[str, int] = {}
    errors: list[tuple[float, float]] = []  # (recorded, refitted) held-out error, seeds averaged where run
    with tempfile.TemporaryDirectory() as scratch:
        for record in records:
            copy = Path(scratch) / record.name
            shutil.copytree(record, copy)
            if args.local_sizes is not None:
                copy = Path(with_local_sizes(str(copy), args.local_sizes))
            run = subprocess.run([sys.executable, "-m", "raylm.cli", "sweep", "--refit", str(copy)],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"{record}: raylm sweep --refit exited with {run.returncode}:\n{run.stderr[-2000:]}")
            recorded = figures(json.loads((record / "fit.json").read_text()))
            refitted = figures(json.loads((copy / "fit.json").read_text()))
            print(record.name)
            errors.append(tuple(f["held-out error, seeds"] if f["held-out error, seeds"] is not None
                                else f["held-out error"] for f in (recorded, refitted)))
            for key, value in recorded.items():
                moved = value != refitted[key]
                same[key] = same.get(key, 0) + (not moved)
                print(f"  {key:28s} {value!s:>12} -> {refitted[key]!s:<12}{'  MOVED' if moved else ''}")
    print(f"\nreproduced, of {len(records)} records:")
    for key, count in same.items():
        print(f"  {key:28s} {count}")
    if args.local_sizes is not None:
        for i, name in enumerate(("recorded", f"fit.local_sizes={args.local_sizes}")):
            held_out = [abs(e[i]) for e in errors]
            print(f"{name}: mean |held-out error| {sum(held_out) / len(held_out):.2%}, largest {max(held_out):.2%}, "
                  f"within 2% {sum(e < 0.02 for e in held_out)} of {len(held_out)}")


if __name__ == "__main__":
    main()
