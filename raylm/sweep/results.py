"""The files of a sweep directory: what was asked, the trials, the fits and the recommended run.

Each is written whole or not at all: a sweep run again over its directory rewrites them, and
`raylm sweep --refit` reads them back with no data and no Ray.
"""

from __future__ import annotations

import csv
import io
import json
import os

import numpy as np
import yaml

from raylm.config import Config, config_to_dict
from raylm.data import storage
from raylm.errors import ConfigError
from raylm.sweep import analysis
from raylm.sweep.analysis import STOPPED

SWEEP_FILE, TRIALS_FILE, FIT_FILE, RECOMMENDED_FILE = "sweep.yaml", "trials.csv", "fit.json", "recommended.yaml"
CHECK_PLAN_FILE, ASHA_STATE_FILE = "check_plan.json", "asha_state.pkl"
COLUMNS = ("trial_id", "phase", "rung", "size", "budget", "params", "params_non_embedding", "params_total", "tokens",
           "flops_per_token", "flops", "lr", "batch", "steps", "val_loss", "progress", "tokens_trained", "status",
           "wall_s", "seed", "output_multiplier")


def write_trials(directory: str, rows: list[dict]) -> None:
    # Whole or not at all: a sweep run again over its directory rewrites it, and --refit needs it.
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    storage.write_bytes(os.path.join(directory, TRIALS_FILE), text.getvalue().encode())


def read_trials(directory: str) -> list[dict]:
    """trials.csv's rows with their numbers as numbers (a column a sweep of an earlier raylm did not
    write takes its default)."""
    path = os.path.join(directory, TRIALS_FILE)
    if not os.path.exists(path):
        started = os.path.exists(os.path.join(directory, SWEEP_FILE))  # interrupted, or stopped at an error
        raise ConfigError(f"{directory} holds no {TRIALS_FILE}: " + (
            "its sweep has not finished its ladder; run the sweep's command again to resume it" if started
            else "not a finished sweep directory"))
    text = ("trial_id", "phase", "rung", "budget", "status")
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            parsed = {}
            for k, v in {"seed": "0", "output_multiplier": "1", **row}.items():
                if k not in COLUMNS:
                    continue
                try:
                    parsed[k] = v if k in text and v is not None else float(v)
                except (TypeError, ValueError):
                    what = f"has no {k}: the line is cut short" if v is None else f"{k}={v!r} is not a number"
                    raise ConfigError(f"{path} line {reader.line_num}: {what}; a sweep writes this file whole, so "
                                      "it was edited or copied in part") from None
            rows.append(parsed)
    return rows


def asha_savings(rows: list[dict]) -> dict:
    planned = sum(r["flops"] for r in rows)
    trained = sum(r["tokens_trained"] * r["flops_per_token"] for r in rows)
    return {"trials": len(rows), "stopped_early": sum(r["status"] == STOPPED for r in rows),
            "planned_flops": planned, "trained_flops": trained, "saved_fraction": 1 - trained / planned}


def recommended_yaml(cfg: Config, info: dict, sweep_dir: str) -> str:
    p = info["predicted_loss"]
    header = (f"# Recommended by `raylm sweep` ({sweep_dir}):\n"
              f"# {info['params']:,} parameters, {info['tokens']:,} tokens, {info['flops']:.3g} FLOPs, "
              f"lr {info['lr']:.3g}, batch {info['batch']}.\n"
              f"# Predicted final val loss: {p['loss']:.4f} "
              f"(interval {p['interval'][0]:.4f} - {p['interval'][1]:.4f}).\n")
    if cfg.model.parametrization == "mup":
        header += (f"# µP based at d_model {cfg.model.mup_base_width}, output multiplier "
                   f"{cfg.model.mup_output_multiplier:g}: the learning rate found there, at which every size of the "
                   "ladder trained.\n")
    if allocation := info.get("allocation"):
        low, high = allocation["ladder_tokens_per_param"]
        header += (f"# {info['tokens_per_param']:.3g} tokens per parameter, not the fit's optimum "
                   f"({allocation['fit_tokens_per_param']:,.3g}): outside the {low:g} to {high:g} the ladder trained.\n")
    return header + yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def fitted_with() -> dict[str, str]:
    """The libraries the fits ran on. Where the ladder leaves the Chinchilla form underdetermined,
    L-BFGS stops at another alpha on another scipy or numpy (benchmarks/RESULTS.md: a record's chosen
    predictor changed), so a refit must be able to tell that its numbers may not be the sweep's."""
    import scipy

    return {"scipy": scipy.__version__, "numpy": np.__version__}


def write_fit(directory: str, result: dict, rows: list[dict], laws: analysis.Laws) -> None:
    from raylm.sweep import plots

    storage.write_bytes(os.path.join(directory, FIT_FILE), json.dumps(result, indent=1).encode())  # whole or not at all
    plots.write_all(os.path.join(directory, "plots"), rows, result, laws)
