"""One sweep trial: a Ray Tune function trainable that runs the training loop of `raylm train`
(`raylm.train.loop.train`) in-process on one worker, the issue's allowance for tiny CPU trials.

Its run directory is `<sweep>/trials/<trial id>` (`search.trial_name`): metrics.jsonl and a
checkpoint at every evaluation. A restarted trial (Tune's FailureConfig, or a resumed sweep's)
resumes from its newest checkpoint there; a trial that had finished reports its final result again
from `final.json` instead of training twice. A trial whose loss turns non-finite (its learning
rate too high; the stability guard is off in trials) ends as diverged, not retried.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings

import torch
from ray import tune

from raylm.sweep.ladder import trial_config
from raylm.sweep.plan import FINAL_FILE, TrialPlan, trial_dir
from raylm.sweep.search import PROGRESS
from raylm.train.env import LocalEnv
from raylm.train.hooks import Hook
from raylm.train.loop import train
from raylm.train.observe.records import METRICS_FILE, read_jsonl
from raylm.train.preflight import preflight
from raylm.train.spec import RunSpec

PID_FILE = "worker.pid"  # the process training this trial now (chaos tests kill it)
STARTED_FILE = "started"


class TuneReporter(Hook):
    """Each validation loss goes to Tune with the fraction of the budget trained (ASHA's clock)."""

    after_metrics_written = True  # ASHA may stop the trial at this report: its metrics row is kept

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, run, step: int, metrics: dict) -> None:
        if "val_loss" in metrics:
            tune.report({"val_loss": metrics["val_loss"], "loss": metrics["loss"], "step": metrics["step"],
                         "tokens": metrics["tokens"], PROGRESS: metrics["step"] / self.steps})


def _metrics(run_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, METRICS_FILE))


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)  # whole or absent: a reader never sees half a file


def run_trial(config: dict, plan: TrialPlan) -> None:
    run_dir = trial_dir(plan.trials_dir, config["trial"])
    os.makedirs(run_dir, exist_ok=True)
    final_path = os.path.join(run_dir, FINAL_FILE)
    if os.path.exists(final_path):
        with open(final_path) as f:
            tune.report(json.load(f))
        return
    started_path = os.path.join(run_dir, STARTED_FILE)
    if not os.path.exists(started_path):
        with open(started_path, "w") as f:
            f.write(str(time.time()))
    with open(started_path) as f:
        started = float(f.read())
    with open(os.path.join(run_dir, PID_FILE), "w") as f:
        f.write(str(os.getpid()))

    torch.set_num_threads(min(plan.threads, os.cpu_count() or 1))  # more threads than cores only contend
    # DCP says so at every checkpoint of a single process, which is what a trial is.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    spec = RunSpec.from_dict(plan.spec)
    rung = plan.rungs[config["rung"]]
    cfg = trial_config(plan.sweep, spec.config, rung, config["lr"], config["batch"],
                       run_name=f"{spec.config.run.name}/trials/{os.path.basename(run_dir)}",
                       seed=config.get("seed", 0), output_multiplier=config.get("output_multiplier"))
    trial = spec.with_config(cfg)
    preflight(trial, run_dir)
    try:
        train(trial, LocalEnv(run_dir, use_gpu=plan.use_gpu), (TuneReporter(cfg.train.steps),))
    except FloatingPointError as e:  # a learning rate too high: an outcome of the search, not a failure to retry
        print(f"raylm: trial diverged: {e}", flush=True)
        rows = _metrics(run_dir)
        step = rows[-1]["step"] if rows else 0
        final = {"val_loss": math.inf, "diverged": True, "step": step, "tokens": step * cfg.train.global_batch_size
                 * spec.seq_len, PROGRESS: step / cfg.train.steps, "wall_s": time.time() - started}
    else:
        last = next(r for r in reversed(_metrics(run_dir)) if "val_loss" in r)  # the loop evaluates at the end
        final = {"val_loss": last["val_loss"], "loss": last["loss"], "step": last["step"], "tokens": last["tokens"],
                 PROGRESS: last["step"] / cfg.train.steps, "wall_s": time.time() - started}
    _write_json(final_path, final)
    tune.report(final)
