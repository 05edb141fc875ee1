"""End to end on a local Ray cluster: Ray Train workers, Ray Data streaming, DCP checkpoints."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylm.config import ConfigError, load_config
from raylm.data.prepare import prepare_dataset
from raylm.launch.driver import launch
from tests.support.cli import run_main
from tests.support.filesystems import tmpfs
from tests.support.fixtures import write_corpus
from tests.support.processes import session_processes, signal_when

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def ray_config(dataset, storage, *extra):
    return load_config(None, [
        f"data.path={dataset}", "data.chunk_rows=8", "run.storage_path=" + str(storage),
        "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32",
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_batches=2",
        "optim.lr=1e-2", "schedule.warmup_steps=2", "schedule.min_lr=1e-3", "parallel.num_workers=2",
        "run.max_failures=0", *extra])


def records(run_dir, name: str) -> list[dict]:
    with open(os.path.join(run_dir, name)) as f:
        return [json.loads(line) for line in f]


def metrics(run_dir):
    return records(run_dir, "metrics.jsonl")


def events(run_dir):
    return records(run_dir, "events.jsonl")


def test_two_workers_loss_falls_and_generate_prints_a_continuation(tiny_dataset, tmp_path, monkeypatch):
    # Relative paths, as a user types them: workers run in other directories.
    monkeypatch.chdir(tmp_path)
    # A Ray the run joined (the session's), whose record of runs Train keeps: its controller
    # imported torch (for rank 0's torch version) at every start of the workers.
    probe = tmp_path / "probe.jsonl"
    monkeypatch.setenv("RAY_TRAIN_CALLBACKS", "tests.support.run_probe.RunProbe")
    monkeypatch.setenv("RAYLM_RUN_PROBE", str(probe))
    callers_sigint = signal.getsignal(signal.SIGINT)
    launch(ray_config(os.path.relpath(tiny_dataset), "runs", "run.name=falls", "train.steps=20",
                      "train.eval_every=10", "checkpoint.every_steps=10"))
    # Ray Train's abort-on-Ctrl-C went with the run: after it, a Ctrl-C exited 0 via the dead controller.
    assert signal.getsignal(signal.SIGINT) == callers_sigint
    records = [json.loads(line) for line in probe.read_text().splitlines()]
    assert [r["where"] for r in records] == ["driver", "controller, workers started", "controller, run finished"]
    assert [r for r in records[1:] if r["torch"]] == []  # the driver is this test process: torch is in
    tmp_path = tmp_path / "runs"
    run_dir = tmp_path / "falls"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.5
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= rows[0].keys()
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20]
    saved = load_config(run_dir / "config.yaml")
    assert saved.model.vocab_size == 257 and saved.train.seq_len == 32
    assert any(name.startswith("events.") for name in os.listdir(run_dir / "tensorboard"))
    assert {"checkpoint_00000010", "checkpoint_00000020"} <= set(os.listdir(run_dir))

    out = subprocess.run([sys.executable, "-m", "raylm.cli", "generate", "--checkpoint", str(run_dir),
                          "--prompt", "The king", "--max-new-tokens", "60", "--seed", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The king") and len(out.stdout.strip()) > len("The king") + 30


def test_stopped_run_resumes_with_the_losses_of_an_uninterrupted_one(tiny_dataset, tmp_path):
    # keep_last=1 prunes step 2's checkpoint, which Ray Train's own record of the reported ones
    # still names: the resume must not trip on it (as a resubmitted job once did every time).
    common = ("train.steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=1", "train.eval_every=0",
              "model.dropout=0.1")
    launch(ray_config(tiny_dataset, tmp_path, "run.name=straight", *common))
    launch(ray_config(tiny_dataset, tmp_path, "run.name=resumed", *common, "train.stop_at_step=4"))
    assert [r["step"] for r in metrics(tmp_path / "resumed")] == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match=r"checkpoint.resume=never but .*resumed already holds checkpoints"):
        launch(ray_config(tiny_dataset, tmp_path, "run.name=resumed", *common, "checkpoint.resume=never"))
    with pytest.raises(FileNotFoundError, match=r"checkpoint.resume=required but .*nothing holds no complete"):
        launch(ray_config(tiny_dataset, tmp_path, "run.name=nothing", *common, "checkpoint.resume=required"))
    # Another order of the samples: some of the epoch would be trained twice, others never.
    with pytest.raises(ConfigError, match=r"has trained 32 samples in an order .* \(2 difference\(s\)\):\n"
                                          r"  data.seed: saved 0, now 5\n  data.chunk_rows: saved 8, now 4\n"):
        launch(ray_config(tiny_dataset, tmp_path, "run.name=resumed", *common, "data.seed=5", "data.chunk_rows=4"))
    other = str(tmp_path / "prepared-again")
    prepare_dataset([write_corpus(tmp_path / "other-text", documents=60, seed=1)], other, seq_len=32)
    with pytest.raises(ConfigError, match=rf"\n  data.path {other}: not the dataset trained \(its manifest differs"):
        launch(ray_config(other, tmp_path, "run.name=resumed", *common))
    # The same dataset elsewhere is the same data: it resumes, as if uninterrupted.
    moved = shutil.copytree(tiny_dataset, tmp_path / "moved")
    launch(ray_config(moved, tmp_path, "run.name=resumed", *common))
    straight = {r["step"]: r["loss"] for r in metrics(tmp_path / "straight")}
    resumed = {r["step"]: r["loss"] for r in metrics(tmp_path / "resumed")}
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6), step


def test_ctrl_c_and_a_sigterm_to_the_process_group_end_the_run_naming_its_last_checkpoint_and_the_same_command_resumes(
        tiny_dataset, tmp_path):
    """A user's Ctrl-C, then a SIGTERM (Slurm's `scancel`, `timeout`), each sent to the command's
    whole process group as a shell or a scheduler does: Ray Train aborts the workers, raylm says
    where the run stands and exits 130 or 143, as a shell does for those signals, and nothing
    trains on after it. The same command goes on from that checkpoint (here told to stop a few
    steps later). A local Ray's daemons once shared the group: the SIGTERM killed its GCS, the
    workers trained on unattended and the driver waited 60 s to exit 1."""
    command = [sys.executable, "-m", "raylm.cli", "train", f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}",
               "run.name=ctrl-c", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
               "train.steps=400", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
               "schedule.warmup_steps=1", "checkpoint.every_steps=4", "parallel.num_workers=2",
               "parallel.cpus_per_worker=1"]
    env = {**os.environ, "RAY_ADDRESS": ""}
    run = tmp_path / "ctrl-c"

    def checkpoints() -> list[str]:
        """The complete ones (an interrupted save leaves a directory without its manifest)."""
        return sorted(p.parent.name for p in run.glob("checkpoint_*/checkpoint_manifest.json"))

    def stopped_by(sig: signal.Signals, after: str) -> tuple[int, str]:
        """Run the command until it saves a checkpoint past `after`, then signal its process group."""
        with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) as proc:
            deadline = time.monotonic() + 300
            while not checkpoints() or checkpoints()[-1] <= after:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.2)
            os.killpg(proc.pid, sig)
            out, err = proc.communicate(timeout=60)  # Ray's 60 s wait for a dead GCS would fail here
        left = checkpoints()
        time.sleep(3)
        assert checkpoints() == left, "the run trained on after its command exited"
        return proc.returncode, out + err

    status, said = stopped_by(signal.SIGINT, after="checkpoint_00000007")
    assert status == 130, said[-3000:]
    named = re.search(r"raylm: interrupted; the last checkpoint is (\S+/checkpoint_(\d{8})): the same command "
                      r"resumes from it", said)
    assert named and os.path.isdir(named.group(1)), said[-3000:]
    saved, first_stop = int(named.group(2)), named.group(1)
    assert saved >= 8 and saved % 4 == 0

    status, said = stopped_by(signal.SIGTERM, after=os.path.basename(named.group(1)))
    assert status == 143, said[-3000:]
    assert f"raylm: resuming from {named.group(1)} if its files pass their checksums" in said
    named = re.search(r"raylm: stopped by SIGTERM; the last checkpoint is (\S+/checkpoint_(\d{8})): the same "
                      r"command resumes from it", said)
    assert named and os.path.isdir(named.group(1)) and int(named.group(2)) > saved, said[-3000:]
    saved = int(named.group(2))

    again = subprocess.run([*command, f"train.stop_at_step={saved + 4}"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"raylm: resuming from {named.group(1)} if its files pass their checksums" in again.stdout
    assert [r["step"] for r in metrics(run)] == list(range(1, saved + 5))
    # The operator's stops are in the run's record, with where each left the run.
    stops = [{k: e[k] for k in ("signal", "last_checkpoint")} for e in events(run) if e["event"] == "interrupted"]
    assert stops == [{"signal": "SIGINT", "last_checkpoint": first_stop},
                     {"signal": "SIGTERM", "last_checkpoint": named.group(1)}], stops


@pytest.mark.parametrize("when, sig", [("the run's lease is taken", signal.SIGTERM),
                                       ("its local Ray starts", signal.SIGTERM),
                                       ("its local Ray starts", signal.SIGINT)])
def test_a_sigterm_or_ctrl_c_before_training_starts_ends_the_run_as_one_during_training(tiny_dataset, tmp_path, when, sig):
    """A job cancelled in its first seconds: exit 143 with the line that says so, the lease
    released, the run directory that the command created gone, and no Ray process left. Before,
    Python's default killed the driver without a word, its lease left to go stale; while
    `ray.init` ran, Ray's own handler made it exit 15, and the agents of the half-started raylet
    lived on. A Ctrl-C (to the group, as a terminal sends it) then left those agents too."""
    command = [sys.executable, "-m", "raylm.cli", "train", f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}",
               "run.name=early", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
               "train.steps=400", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
               "parallel.num_workers=1"]
    run = tmp_path / "early"
    status, out, err, left = signal_when(
        command, lambda pid: (run / "run.lease").exists() if when == "the run's lease is taken" else
        any(name == "raylet" for _, name, _ in session_processes(pid)), sig, cwd=REPO,
        env={**os.environ, "RAY_ADDRESS": ""})
    stopped = "stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted"
    assert status == 128 + sig, out[-3000:] + err[-3000:]
    assert f"raylm: {stopped} before training started: the same command starts it again" in err
    assert not left, left
    assert not run.exists(), os.listdir(run)  # the lease released, and nothing else was written


@pytest.fixture
def tiny_filesystem(tmp_path):
    yield from tmpfs(tmp_path, "256k")


def test_a_run_whose_final_save_failed_ends_with_an_error_not_done(tiny_dataset, tiny_filesystem):
    """A user trial: with checkpoint.allow_failures on a full disk, every save failed, the final
    one included; `raylm train` printed `done: step 10` and exited 0, the weights nowhere. The run
    directory here is on a real 256 KiB filesystem, too small for a checkpoint of the model."""
    storage = tiny_filesystem
    overrides = [f"data.path={tiny_dataset}", f"run.storage_path={storage}", "run.name=unsaved", "data.chunk_rows=8",
                 "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32",
                 "train.global_batch_size=8", "train.micro_batch_size=2", "schedule.warmup_steps=2",
                 "parallel.num_workers=1", "run.max_failures=0", "train.steps=4", "checkpoint.every_steps=2",
                 "train.eval_every=0", "train.tensorboard=false", "checkpoint.allow_failures=true",
                 "checkpoint.write_attempts=1"]
    outcome = run_main("train", *overrides)
    assert outcome.status == 1, outcome.stdout[-2000:] + outcome.stderr[-2000:]
    assert "done:" not in outcome.stdout
    assert (f"raylm: error: step 4: the run trained to its end, but no checkpoint has been written to "
            f"{storage / 'unsaved'} since step 2 (") in outcome.stderr
    assert "the final one included: all its steps (it has no checkpoint) are lost" in outcome.stderr


def test_a_run_on_a_ray_without_a_dashboard_starts_no_placement_group_cleaner(ray_session, monkeypatch):
    """Train's cleaner asks the State API (the dashboard) each second whether the controller
    lives; on a Ray without one (the session's, a notebook's `ray.init(include_dashboard=False)`)
    it could only warn, and it held the run's end for seconds. With a dashboard it stays."""
    import ray.train
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from raylm.launch.driver import _trainer_class

    def cleaner() -> bool:
        trainer = _trainer_class(own_ray=False, dashboard=False, fixed_on_own_ray=False)(
            lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1))
        return any(isinstance(c, PlacementGroupCleanerCallback) for c in trainer._create_default_callbacks())

    assert not cleaner()
    monkeypatch.setenv("RAY_OVERRIDE_DASHBOARD_URL", "http://127.0.0.1:8265")  # Ray's own override of the URL
    assert cleaner()


@pytest.mark.parametrize("own_ray, user_setting, tracked", [
    (False, None, True), (True, None, False), (False, "0", False)])
def test_runs_are_tracked_on_a_joined_cluster_and_the_setting_stays_with_the_trainer(
        monkeypatch, own_ray, user_setting, tracked):
    """On a cluster it joins, a run is in Ray Train's record of runs (what an elastic start reads to
    free a dead run's reservation) unless the user turned the record off; the process's environment
    is as it was after, so that a later run of the same process on a Ray of its own starts no state
    actor."""
    import ray.train
    from ray.train.v2._internal.callbacks.state_manager import StateManagerCallback

    from raylm.launch.coordinator import TRAIN_STATE_TRACKING
    from raylm.launch.driver import _trainer_class

    if user_setting is None:
        monkeypatch.delenv(TRAIN_STATE_TRACKING, raising=False)
    else:
        monkeypatch.setenv(TRAIN_STATE_TRACKING, user_setting)
    trainer = _trainer_class(own_ray, dashboard=False, fixed_on_own_ray=own_ray)(
        lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1))
    callbacks = trainer._create_default_callbacks()
    assert any(isinstance(c, StateManagerCallback) for c in callbacks) == tracked
    assert os.environ.get(TRAIN_STATE_TRACKING) == user_setting
