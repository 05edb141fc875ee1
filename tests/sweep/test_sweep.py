"""Real sweeps on a local Ray: every output written, ASHA stopping a hopeless learning rate, the
recommended config training with `raylm train`, and recovery from a killed trial worker, from
a Ctrl-C and from a killed sweep driver."""

import csv
import errno
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import pytest
import yaml

from raylm.config import load_config
from raylm.errors import ConfigError
from raylm.sweep.analysis import rung_bests
from raylm.sweep.fit import eval_power_law
from raylm.sweep.results import fitted_with
from raylm.sweep.results import read_trials as sweep_trials
from raylm.sweep.run import refit, run_sweep
from raylm.sweep.tuner import TrialFailedError
from raylm.train.observe.records import METRICS_FILE, read_jsonl
from tests.support.filesystems import tmpfs
from tests.support.processes import session_processes, signal_when

TINY_SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "sweep-tiny.yaml")
RAYLM = [sys.executable, "-m", "raylm.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def read_trials(directory):
    with open(os.path.join(directory, "trials.csv")) as f:
        return list(csv.DictReader(f))


def finished_trials(directory):
    """trial id -> (final.json text, its mtime, metrics.jsonl mtime)."""
    out = {}
    for final in glob.glob(os.path.join(directory, "trials", "*", "final.json")):
        run_dir = os.path.dirname(final)
        with open(final) as f:
            out[os.path.basename(run_dir)] = (f.read(), os.path.getmtime(final),
                                              os.path.getmtime(os.path.join(run_dir, "metrics.jsonl")))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~3 minutes on 2 idle cores; far longer when the machine is shared
def test_sweep_resumes_after_a_ctrl_c_and_a_killed_driver_and_writes_every_output(tiny_dataset, tmp_path):
    # A second shape of the held-out size: the check is repeated and averaged too (`ladder.seeds`
    # is the Bayesian search's test's, below, to keep this one's time).
    # One trial at a time (the tiny sweep's `trial.max_concurrent`): the ladder's trials are
    # created as others finish.
    command = [*RAYLM, "sweep", TINY_SWEEP, f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}",
               "run.ray_num_cpus=2", "sweep.check_shapes=[{d_model: 40, n_layers: 4, n_heads: 5}]"]
    directory = str(tmp_path / "sweep-tiny")
    ladder_trials = 6 * 2  # 3 fitted sizes x 2 budgets x 2 learning rates

    def interrupt(name: str, done: Callable[[dict], bool], sig: signal.Signals) -> subprocess.Popen:
        """The sweep, sent `sig` (to its process group, as a terminal's Ctrl-C is) once `done` holds
        for its finished trials."""
        with open(tmp_path / f"{name}.log", "w") as log:
            run = subprocess.Popen(command, env=ENV, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 400
            while not done(finished_trials(directory)) and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            assert run.poll() is None, "the sweep ended before it could be interrupted: " + \
                (tmp_path / f"{name}.log").read_text(errors="replace")[-4000:]
            os.killpg(run.pid, sig)
            run.wait(timeout=120)
        return run

    # A Ctrl-C: Tune stops its trials and keeps its state; the sweep says how to go on, with a
    # shell's status for SIGINT.
    first = interrupt("first", lambda finished: len(finished) >= 1, signal.SIGINT)
    said = (tmp_path / "first.log").read_text(errors="replace")
    assert first.returncode == 130, said[-4000:]
    assert "raylm: the sweep was interrupted" in said and "run the same command again to resume it" in said
    assert "Tuner.restore(" not in said  # Tune's own hint, for its Python API, would contradict it
    # A SIGTERM (`timeout`, Slurm, Kubernetes) stops it the same way, with a shell's status for it:
    # it exited 15 without a word, after a stack dump of Ray's.
    # Once one more trial has finished than the Ctrl-C left (two that finished together can leave
    # two: a SIGTERM at once would land before raylm's handler is in place).
    left = len(finished_trials(directory))
    term = interrupt("term", lambda finished: len(finished) > left, signal.SIGTERM)
    said = (tmp_path / "term.log").read_text(errors="replace")
    assert term.returncode == 143, said[-4000:]
    assert "raylm: stopped by SIGTERM: the sweep was interrupted" in said and "SIGTERM received" not in said
    # Tune's state as it saved it on that SIGTERM, and the trials it knew of.
    experiment = os.path.join(directory, "tune-ladder")
    saved = shutil.copytree(experiment, tmp_path / "tune-ladder-saved")
    known = {json.loads(params.read_text())["trial"] for params in saved.glob("*/params.json")}
    # Resumed, then its driver (and the Ray it started, in its process group) dies once a trial
    # created since that state has finished.
    interrupt("second", lambda finished: bool(set(finished) - known), signal.SIGKILL)
    before = finished_trials(directory)
    assert 3 <= len(before) < ladder_trials + 1 and set(before) - known
    # Tune saves its state at most every 10 s: a driver killed just after trials were created and
    # finished leaves a state that never knew them. Tune's state is put back to the one above.
    shutil.rmtree(experiment)
    shutil.copytree(saved, experiment)

    # Its imports listed (`-X importtime`, the driver's alone: Ray's workers are not its children).
    last = subprocess.run([sys.executable, "-X", "importtime", *command[1:]], env=ENV, capture_output=True, text=True,
                          timeout=1200)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "resuming" in last.stdout
    # The driver plans, hands Tune its trials and fits: torch is the trials' (3 s and 200 MB a start).
    assert not re.search(r"^import time:.*\|\s+torch$", last.stderr, re.MULTILINE)

    # Finished trials were kept, not trained again, those Tune had not recorded too: created again
    # by the resumed experiment, each found its directory by its name.
    after = finished_trials(directory)
    for trial_id, record in before.items():
        assert after[trial_id] == record, trial_id
    rows = read_trials(directory)
    ladder = [r for r in rows if r["phase"] == "ladder"]
    assert len(ladder) == ladder_trials and len({r["trial_id"] for r in rows}) == len(rows)
    assert set(before) <= {r["trial_id"] for r in rows}

    # ASHA stopped the hopeless learning rate early; the good one always finished its budget.
    assert all(r["status"] == "completed" for r in ladder if float(r["lr"]) == 1e-2)
    stopped = [r for r in ladder if r["status"] == "stopped_early"]
    assert stopped and all(float(r["lr"]) == 1e-5 and float(r["progress"]) < 1 for r in stopped)
    for r in stopped:  # the evaluation ASHA stopped it at is the last row of its metrics
        last = read_jsonl(os.path.join(directory, "trials", r["trial_id"], METRICS_FILE))[-1]
        assert last["step"] == round(float(r["progress"]) * int(r["steps"])), r
        assert last["val_loss"] == pytest.approx(float(r["val_loss"]), rel=1e-6), r
    for r in rows:
        assert float(r["flops"]) == pytest.approx(float(r["tokens"]) * float(r["flops_per_token"]))

    with open(os.path.join(directory, "fit.json")) as f:
        result = json.load(f)
    assert {"E", "A", "alpha", "B", "beta", "interval", "residuals"} <= result["parametric"].keys()
    assert result["asha"]["stopped_early"] == len(stopped) and 0 < result["asha"]["saved_fraction"] < 1
    assert "lr_vs_params" in result["lr"] and result["compute_optimal"]["table"]
    check = result["check"]
    assert check["params"] == 83280 and check["tokens"] == 2 * 83280 // 512 * 512 and check["measured_loss"] > 0
    assert check["relative_error"] == pytest.approx((check["predicted_loss"] - check["measured_loss"])
                                                    / check["measured_loss"])
    # The predictor was chosen inside the ladder; the check names it and what each one said.
    assert check["predictor"] == result["predictor"]["chosen"] and set(check["by_predictor"]) == {"chinchilla", "local"}
    # Without its largest size the tiny ladder has 2 sizes: too few to determine E + A/N^alpha.
    validation = {name: p["cross_validation"] for name, p in result["predictors"].items()}
    assert "at every alpha" in validation["chinchilla"]["error"] and validation["local"]["mean_abs_error"] > 0
    assert result["predictor"]["chosen"] == "local" and "chinchilla could not be checked" in result["predictor"]["why"]
    # The noise floor: the largest fitted size's rung at its best lr, with two more seeds.
    seeds = [r for r in rows if r["phase"] == "seeds"]
    assert len(seeds) == 2 and {r["seed"] for r in seeds} == {"1", "2"} and {r["rung"] for r in seeds} == {"s2-tpp2"}
    assert all("seed_losses" not in rung for rung in result["rungs"])  # ladder.seeds 1: the fits take seed 0
    noise = result["noise"]
    assert len(noise["losses"]) == 3 and len(set(noise["losses"])) == 3  # other seeds, other losses
    assert check["noise_floor"] == noise["relative_spread"] > 0
    # The held-out rung at the extrapolated lr and x 2^-1/2, x 2^1/2: the pick against the best.
    checks = sorted((float(r["lr"]), float(r["val_loss"])) for r in rows if r["phase"] == "check")
    assert len(checks) == 3 and checks[1][0] == pytest.approx(check["lr"])
    assert checks[2][0] / checks[1][0] == pytest.approx(2 ** 0.5) and checks[1][0] / checks[0][0] == pytest.approx(2 ** 0.5)
    pick = check["lr_pick"]
    assert pick["picked_loss"] == check["measured_loss"] == checks[1][1] and pick["best_loss"] == min(l for _, l in checks)
    assert pick["good"] == (pick["relative_gap"] <= noise["relative_spread"])
    # The check repeated on the other shape, at the rate lr_vs_params gives it; the error is
    # averaged over the two shapes.
    repeats = [r for r in rows if r["phase"] == "check-repeats"]
    assert [(r["rung"], r["seed"]) for r in repeats] == [("s4-check", "0")]
    (shape,) = check["shapes"]
    assert shape["rung"] == "s4-check" and shape["n_layers"] == 4 and shape["params"] != check["params"]
    assert shape["lr"] == pytest.approx(eval_power_law(result["lr"]["lr_vs_params"], shape["params"]))
    assert all(float(r["lr"]) == pytest.approx(shape["lr"]) for r in repeats if r["rung"] == "s4-check")
    averaged = check["averaged"]
    assert averaged["measured_shapes"] == 2 and [e["rung"] for e in averaged["shapes"]] == ["s3-check", "s4-check"]
    assert averaged["shapes"][0]["losses"] == [check["measured_loss"]]
    assert averaged["shapes"][1]["losses"] == [float(repeats[0]["val_loss"])]
    assert averaged["relative_error"] == pytest.approx(sum(e["relative_error"] for e in averaged["shapes"]) / 2)

    # The sweep directory alone refits the same numbers (no data, no Ray).
    os.rename(tiny_dataset, f"{tiny_dataset}.away")
    try:
        again = subprocess.run([*RAYLM, "sweep", "--refit", directory], env=ENV, capture_output=True, text=True,
                               timeout=300)
    finally:
        os.rename(f"{tiny_dataset}.away", tiny_dataset)
    assert again.returncode == 0, again.stderr[-3000:]
    with open(os.path.join(directory, "fit.json")) as f:
        refitted = json.load(f)
    for key in ("predictor", "predictors", "noise", "parametric", "lr", "fitted_with"):
        assert refitted[key] == result[key], key
    assert not [w for w in refitted["warnings"] if w.startswith("refitted with")]
    assert {k: v for k, v in refitted["check"].items()} == result["check"]
    assert f"predictor: {result['predictor']['chosen']}" in again.stdout
    # The refit keeps the sweep's recommendation, and its summary says so.
    (shown,) = [line for line in again.stdout.splitlines() if line.startswith("recommended:")]
    assert shown.endswith("(carried over from the sweep: --refit does not place the recommended run again)"), shown
    for name in ("loss_vs_compute.png", "lr_curves.png", "residuals.png"):
        assert os.path.getsize(os.path.join(directory, "plots", name)) > 10_000

    # recommended.yaml is a complete run config that `raylm train` runs as it is.
    recommended = os.path.join(directory, "recommended.yaml")
    cfg = load_config(recommended)
    assert cfg.model.d_model == result["recommended"]["d_model"] and cfg.optim.lr == result["recommended"]["lr"]
    assert "Predicted final val loss" in open(recommended).read()
    train = subprocess.run([*RAYLM, "train", recommended, "train.stop_at_step=3", f"run.storage_path={tmp_path}/rec"],
                           env=ENV, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "done: step 3" in train.stdout


def test_a_ctrl_c_outside_tunes_experiments_says_the_same_command_resumes_the_sweep(tiny_dataset, tmp_path):
    """Tune takes a Ctrl-C during its experiments; one that lands outside them (here while the
    sweep's local Ray starts, as during the fits between two phases) ended the sweep with a bare
    "raylm: interrupted", which did not say that the same command goes on from what it kept."""
    command = [*RAYLM, "sweep", TINY_SWEEP, f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}",
               "run.ray_num_cpus=2"]
    status, out, err, left = signal_when(
        command, lambda pid: any(name == "raylet" for _, name, _ in session_processes(pid)), signal.SIGINT,
        env={**ENV, "RAY_ADDRESS": ""})
    assert status == 130, out[-2000:] + err[-3000:]
    assert "raylm: the sweep was interrupted" in err and "run the same command again to resume it" in err, err[-3000:]
    assert not left, left


def test_held_out_trials_larger_than_the_cluster_are_refused_before_the_ladder(ray_session, tiny_dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"trial.check_cpus=64.0 but the Ray cluster has \d+ CPUs"):
        run_sweep(TINY_SWEEP, [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", "run.name=too-big",
                               "sweep.trial.check_cpus=64"])
    assert not (tmp_path / "too-big" / "trials").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sweep_refused_before_its_trials_leaves_nothing_that_stops_the_corrected_command(ray_session, tiny_dataset,
                                                                                          tmp_path):
    """A first try asks for trials larger than the cluster: refused, its directory holds no trial,
    so the corrected command runs there. Once trials began, other settings are refused."""
    cheap = [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", "run.name=corrected", "sweep.check=false",
             "sweep.target.flops=null", "sweep.ladder.d_model=[16,24]", "sweep.ladder.tokens_per_param=[2]",
             "sweep.lr.grid=[0.01]", "sweep.fit.bootstrap=0"]
    directory = tmp_path / "corrected"
    with pytest.raises(ConfigError, match=r"trial.cpus=64.0 but the Ray cluster has \d+ CPUs"):
        run_sweep(TINY_SWEEP, [*cheap, "sweep.trial.cpus=64"])
    run_sweep(TINY_SWEEP, cheap)
    rows = read_trials(str(directory))
    assert len(rows) == 2 and all(r["status"] == "completed" for r in rows)
    assert yaml.safe_load((directory / "sweep.yaml").read_text())["sweep"]["trial"]["cpus"] == 1.0

    with pytest.raises(ConfigError, match=r"holds a sweep started with different settings \(sweep differ"):
        run_sweep(TINY_SWEEP, [*cheap, "sweep.lr.grid=[0.003]"])
    assert read_trials(str(directory)) == rows
    assert yaml.safe_load((directory / "sweep.yaml").read_text())["sweep"]["lr"]["grid"] == [0.01]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_trial_error_no_retry_cures_stops_the_sweep_at_once_and_the_same_command_resumes_it(
        ray_session, tiny_dataset, tmp_path):
    """A full disk under the trials' checkpoints: Tune retried the failing trial twice, went on to
    the next, which failed alike, and ended in a traceback once its own state could not be
    written. Now the first such error ends the sweep, naming the trial, and once there is space
    the same command trains every trial."""
    mounts = tmpfs(tmp_path, "160k")  # the sweep's files fit; no trial's first checkpoint does
    disk = next(mounts)
    try:
        overrides = [f"data.path={tiny_dataset}", f"run.storage_path={disk}", "run.name=full", "sweep.check=false",
                     "sweep.target.flops=null", "sweep.ladder.d_model=[16,24]", "sweep.ladder.tokens_per_param=[2]",
                     "sweep.lr.grid=[0.01]", "sweep.fit.bootstrap=0"]
        with pytest.raises(TrialFailedError, match=r"^trial ladder-000-\w+ \(s1-tpp2\) failed with an error that no "
                                                   r"retry cures, so the sweep stopped: step \d+: no checkpoint could "
                                                   r"be written .*No space|not enough free space") as raised:
            run_sweep(TINY_SWEEP, overrides)
        assert raised.value.exit_code == 1
        tried = os.listdir(disk / "full" / "trials")
        assert len(tried) == 1 and tried[0].startswith("ladder-000-")  # no other trial began
        events = disk / "full" / "trials" / tried[0] / "events.jsonl"
        assert not events.exists() or '"resumed"' not in events.read_text()  # nor was it tried again
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        run_sweep(TINY_SWEEP, overrides)
        rows = read_trials(str(disk / "full"))
        assert len(rows) == 2 and all(r["status"] == "completed" for r in rows)
    finally:
        next(mounts, None)  # unmount


def test_a_full_disk_under_tunes_own_state_is_found_in_the_error_it_raises():
    """Tune's controller reports a failure of its own (raylm's ASHA state, Tune's experiment state)
    as a TuneError of the traceback's text, the OSError only in its context."""
    from ray.tune.error import TuneError

    from raylm.sweep.tuner import _disk_full

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise TuneError(traceback.format_exc())
    except TuneError as e:
        assert _disk_full(e).errno == errno.ENOSPC
        assert _disk_full(TuneError("another failure")) is None


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_killed_trial_worker_restarts_from_its_checkpoint(ray_session, tiny_dataset, tmp_path):
    overrides = [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", "run.name=killed-worker",
                 "sweep.check=false", "sweep.target.flops=null", "sweep.ladder.d_model=[16,24]",
                 "sweep.ladder.tokens_per_param=[8]", "sweep.lr.grid=[0.01]", "sweep.fit.bootstrap=0",
                 "sweep.trial.max_concurrent=2"]  # both at once: one's worker is killed while the other trains
    directory = str(tmp_path / "killed-worker")
    killed = {}

    def kill_one_worker():
        deadline = time.monotonic() + 300
        while not killed and time.monotonic() < deadline:
            for run_dir in glob.glob(os.path.join(directory, "trials", "*")):
                pid_file = os.path.join(run_dir, "worker.pid")
                if glob.glob(os.path.join(run_dir, "checkpoint_*", "checkpoint_manifest.json")) \
                        and os.path.exists(pid_file) and not os.path.exists(os.path.join(run_dir, "final.json")):
                    killed[os.path.basename(run_dir)] = pid = int(open(pid_file).read())
                    os.kill(pid, signal.SIGKILL)
                    return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_one_worker, daemon=True)
    killer.start()
    run_sweep(TINY_SWEEP, overrides)
    killer.join()
    assert killed, "no trial worker was killed"
    rows = read_trials(directory)
    assert len(rows) == 2 and all(r["status"] == "completed" and math.isfinite(float(r["val_loss"])) for r in rows)
    (trial_id, pid), = killed.items()
    run_dir = os.path.join(directory, "trials", trial_id)
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed and resumed[0]["from_step"] > 0  # from its own checkpoint, not from scratch
    assert int(open(os.path.join(run_dir, "worker.pid")).read()) != pid
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, max(steps) + 1))  # every step once: the lost ones were redone, not repeated


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trials_that_share_a_worker_process_train_as_each_would_alone(ray_session, tiny_dataset, tmp_path):
    """Tune hands a finished trial's process to the next trial of the phase (`reuse_actors`):
    nothing one trial leaves behind in it (threads, random state, caches) may change the next."""
    common = [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", "sweep.check=false",
              "sweep.target.flops=null", "sweep.ladder.tokens_per_param=[2]", "sweep.fit.bootstrap=0",
              "sweep.early_stopping.asha=false", "sweep.trial.cpus=4"]  # the session's 4 CPUs: one at a time
    callers = [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1)]
    run_sweep(TINY_SWEEP, [*common, "run.name=shared", "sweep.ladder.d_model=[16,24]", "sweep.lr.grid=[1e-2,3e-3]"])
    # Tune's Ctrl-C and SIGUSR1 handlers went with the sweep: after it, a Ctrl-C met only Tune's
    # warning, and a SIGUSR1 set the dead run's event instead of ending the process.
    assert [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1)] == callers
    trials = {os.path.basename(d): d for d in glob.glob(str(tmp_path / "shared" / "trials" / "*"))}
    assert len(trials) == 4
    assert len({open(os.path.join(d, "worker.pid")).read() for d in trials.values()}) == 1, "no process was reused"
    last = max(trials, key=lambda t: float(open(os.path.join(trials[t], "started")).read()))
    (row,) = [r for r in read_trials(str(tmp_path / "shared")) if r["trial_id"] == last]

    # The trial that ran last, after three others in its process, again in a process of its own.
    d_model = 16 if row["size"] == "0" else 24
    run_sweep(TINY_SWEEP, [*common, "run.name=alone", f"sweep.ladder.d_model=[{d_model}]",
                           f"sweep.lr.grid=[{row['lr']}]"])
    (alone,) = glob.glob(str(tmp_path / "alone" / "trials" / "*"))
    shared_rows, alone_rows = ([{k: r[k] for k in ("step", "loss", "val_loss", "lr") if k in r}
                                for r in read_jsonl(os.path.join(run_dir, METRICS_FILE))]
                               for run_dir in (trials[last], alone))
    assert len(shared_rows) > 3 and shared_rows == alone_rows


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bayesian_search_runs_an_optuna_study_per_rung_and_seeds_repeat_each_best(ray_session, tiny_dataset, tmp_path):
    overrides = [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", "run.name=bayes",
                 "sweep.check=false", "sweep.target.flops=null", "sweep.ladder.d_model=[16,24]",
                 "sweep.ladder.tokens_per_param=[4]", "sweep.search.algorithm=bayes", "sweep.lr.low=1e-3",
                 "sweep.lr.high=3e-2", "sweep.search.samples=3", "sweep.fit.bootstrap=0", "sweep.ladder.seeds=2"]
    result = run_sweep(TINY_SWEEP, overrides)
    everything = read_trials(str(tmp_path / "bayes"))
    rows = [r for r in everything if r["phase"] == "ladder"]
    # ladder.seeds=2: each rung once more at its best trial's rate, with seed 1; the fits take the mean.
    seeds = [r for r in everything if r["phase"] == "seeds"]
    assert sorted((r["rung"], r["seed"]) for r in seeds) == [("s0-tpp4", "1"), ("s1-tpp4", "1")]
    one_seed = {b["rung"]: b for b in rung_bests([r for r in sweep_trials(str(tmp_path / "bayes"))
                                                  if r["phase"] == "ladder"])}
    for rung in result["rungs"]:
        best = min((r for r in rows if r["rung"] == rung["rung"] and r["status"] == "completed"),
                   key=lambda r: float(r["val_loss"]))
        (repeat,) = [r for r in seeds if r["rung"] == rung["rung"]]
        assert repeat["lr"] == best["lr"] and repeat["val_loss"] != best["val_loss"]
        assert rung["seed_losses"] == [float(best["val_loss"]), float(repeat["val_loss"])]
        shift = (float(repeat["val_loss"]) - float(best["val_loss"])) / 2  # the mean of two seeds, less seed 0
        assert rung["loss"] == pytest.approx(one_seed[rung["rung"]]["loss"] + shift)
    assert sorted(r["rung"] for r in rows) == ["s0-tpp4"] * 3 + ["s1-tpp4"] * 3
    assert all(1e-3 <= float(r["lr"]) <= 3e-2 for r in rows)  # lr.scale_exponent 0: the range as given
    for rung in ("s0-tpp4", "s1-tpp4"):
        assert len({r["lr"] for r in rows if r["rung"] == rung}) == 3
    assert {r["lr"] for r in rows if r["rung"] == "s0-tpp4"} != {r["lr"] for r in rows if r["rung"] == "s1-tpp4"}
    assert glob.glob(str(tmp_path / "bayes" / "tune-ladder" / "searcher-state-*.pkl"))  # Tune saved the studies


def stdlib_record(tmp_path: Path, bootstrap: Optional[int] = None) -> Path:
    """A scratch copy of the built-in corpus's sweep record (benchmarks/sweeps/), to refit; with
    `bootstrap`, its refits bootstrap that many times instead of the recorded 200."""
    directory = tmp_path / "sweep"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "sweeps", "sweep-cpu-stdlib"),
                    directory)
    if bootstrap is not None:
        record = directory / "sweep.yaml"
        text = record.read_text()
        assert "    bootstrap: 200\n" in text
        record.write_text(text.replace("    bootstrap: 200\n", f"    bootstrap: {bootstrap}\n"))
    return directory


def test_a_ctrl_c_during_a_refit_ends_with_status_130_and_leaves_fit_json_whole(tmp_path, capsys):
    """A refit takes half a minute on 2 cores; a Ctrl-C in it printed a Python traceback. It ends with
    a shell's status for SIGINT and one line, and the fit.json it would have replaced is untouched."""
    from raylm.cli import main

    directory = stdlib_record(tmp_path)
    before = (directory / "fit.json").read_bytes()
    # A raylm process's SIGINT handling on a terminal, whatever handler this test process holds.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl_c = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))  # a terminal's Ctrl-C, mid-fit
    ctrl_c.start()
    try:
        with pytest.raises(SystemExit) as exited:
            main(["sweep", "--refit", str(directory)])
    finally:
        ctrl_c.cancel()
        signal.signal(signal.SIGINT, previous)
    assert exited.value.code == 130
    assert capsys.readouterr().err == "raylm: interrupted\n"
    assert (directory / "fit.json").read_bytes() == before and not (directory / "plots").exists()


def test_a_refit_on_other_libraries_than_the_sweeps_says_so(tmp_path):
    """On scipy 1.17.1 a record's underdetermined Chinchilla fit landed elsewhere than where the sweep
    had fitted it, and its chosen predictor changed (benchmarks/RESULTS.md): a refit says when it
    runs on other libraries than the sweep did, and only then."""
    # The predictor is chosen by cross-validation; the bootstrap gives only the intervals.
    directory = stdlib_record(tmp_path, bootstrap=12)
    fit_path = directory / "fit.json"
    recorded = json.loads(fit_path.read_text())
    fit_path.write_text(json.dumps({**recorded, "fitted_with": {"scipy": "1.14.1", "numpy": "2.1.3"}}))
    first = refit(str(directory))
    assert first["fitted_with"] == fitted_with() and first["predictor"] == recorded["predictor"]
    (warning,) = [w for w in first["warnings"] if w.startswith("refitted with")]
    assert "where the fit.json it replaces was fitted with numpy 2.1.3, scipy 1.14.1" in warning and "chosen predictor" in warning
    again = refit(str(directory))  # fit.json now names this machine's libraries
    assert not [w for w in again["warnings"] if w.startswith("refitted with")]


def test_a_refit_of_a_damaged_trials_csv_names_its_line_and_keeps_fit_json(tmp_path, capsys):
    """A trials.csv cut short (a copy in part, a kill while an earlier raylm wrote it in place) or
    edited ended a refit in a Python traceback; it is one error naming the file, line and column."""
    from raylm.cli import main

    directory = stdlib_record(tmp_path)
    before = (directory / "fit.json").read_bytes()
    lines = (directory / "trials.csv").read_text().splitlines(keepends=True)
    (directory / "trials.csv").write_text("".join(lines[:5]) + lines[5][:40])
    with pytest.raises(SystemExit) as exited:
        main(["sweep", "--refit", str(directory)])
    assert exited.value.code == 2
    assert re.fullmatch(r"raylm: error: \S+/trials.csv line 6: has no \w+: the line is cut short; [^\n]+\n",
                        capsys.readouterr().err)
    header = lines[0].strip().split(",")
    damaged = lines[3].strip().split(",")
    damaged[header.index("val_loss")] = "n/a"
    (directory / "trials.csv").write_text("".join(lines[:3]) + ",".join(damaged) + "\n" + "".join(lines[4:]))
    with pytest.raises(SystemExit) as exited:
        main(["sweep", "--refit", str(directory)])
    assert exited.value.code == 2 and "trials.csv line 4: val_loss='n/a' is not a number" in capsys.readouterr().err
    assert (directory / "fit.json").read_bytes() == before


def test_a_refit_of_a_sweep_that_has_not_finished_says_its_command_resumes_it(tmp_path):
    """A sweep stopped before its ladder was done (a Ctrl-C, a trial's error) has its sweep.yaml
    and no trials.csv; --refit called it "not a finished sweep directory", as any directory."""
    from tests.support.cli import assert_clean_refusal, run_main

    directory = stdlib_record(tmp_path)
    os.remove(directory / "trials.csv")
    outcome = run_main("sweep", "--refit", str(directory))
    assert_clean_refusal(outcome, f"{directory} holds no trials.csv: its sweep has not finished its ladder; run "
                                  "the sweep's command again to resume it")
    outcome = run_main("sweep", "--refit", str(tmp_path))
    assert_clean_refusal(outcome, f"{tmp_path} holds no sweep.yaml: not a sweep directory")


def test_a_refit_says_how_its_bootstrap_progresses(tmp_path, capsys):
    """`raylm sweep --refit` was silent for minutes on a loaded machine while it bootstrapped the
    Chinchilla fit (200 L-BFGS refits): it says what it fits, and how many refits are done."""
    from raylm.cli import main

    directory = stdlib_record(tmp_path, bootstrap=12)
    main(["sweep", "--refit", str(directory)])
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if line.startswith("raylm: fit")]
    assert progress[0] == f"raylm: fitting 36 ladder trials of 4 sizes from {directory / 'trials.csv'}"
    assert progress[1] == "raylm: fit: chinchilla: bootstrap refits: 0/12"
    assert progress[-1].startswith("raylm: fit: chinchilla: bootstrap refits: 12/12 (")
    assert out.index(progress[-1]) < out.index(f"sweep {directory}:")  # before the summary
