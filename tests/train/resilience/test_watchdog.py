"""The progress watchdog on the real loop: a run whose data never arrives fails within the
watchdog's limit, naming what it waited for; the limit follows the measured step time; a run
that ends otherwise leaves no watchdog behind.

Data that never arrives: a copy of the tiny dataset whose train shards are named pipes with no
writer, so that opening one blocks for ever, as a read from a dead mount or a hung store would.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from raylm.data.manifest import load_manifest
from raylm.train.hooks import Hook
from raylm.train.loop import train, train_local
from raylm.train.resilience.watchdog import EXIT_STATUS, ProgressTimeout, ProgressWatchdog
from tests.train.test_loop import tiny_config


@pytest.fixture
def stuck_dataset(tiny_dataset, tmp_path):
    """The tiny dataset with its train shards replaced by named pipes nobody writes to."""
    out = str(tmp_path / "stuck")
    shutil.copytree(tiny_dataset, out)
    pipes = load_manifest(out, None).shard_uris(out, "train")
    for pipe in pipes:
        os.remove(pipe)
        os.mkfifo(pipe)
    yield out
    for pipe in pipes:  # release a reader still blocked in open(): it reads an empty file
        try:
            os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader left
            pass


def stuck_config(dataset: str, loader: str):
    # verify=false: checking the shards' hashes would block the driver before training.
    return tiny_config(dataset, f"data.loader={loader}", "data.verify=false", "train.eval_every=0",
                       "train.steps=5", "checkpoint.every_steps=0")


class StartTime(Hook):
    def on_train_start(self, run):
        self.at = time.monotonic()


def test_a_run_whose_data_never_arrives_fails_within_the_limit_naming_the_wait(
        ray_session, stuck_dataset, tmp_path):
    from raylm.launch.ray_watchdog import describe_pending

    job_id = ray_session.get_runtime_context().get_job_id()
    watchdog = ProgressWatchdog(startup_s=5, factor=20, min_s=2, describe=lambda: describe_pending(job_id))
    start = StartTime()
    with pytest.raises(ProgressTimeout) as raised:
        train_local(stuck_config(stuck_dataset, "ray"), str(tmp_path), (start, watchdog))
    waited = time.monotonic() - start.at
    message = str(raised.value)
    print(message)
    assert message == watchdog.reason
    assert "rank 0: no training step" in message and "waiting for the first batch (step 0)" in message
    assert "past the limit of 5 s (start-up allowance, run.watchdog_startup_s)" in message
    # Where the training thread waited (for its reader actor), and the cluster's state.
    where = message.split("Training thread at:")[1]
    assert "_wait (raylm.data.stream:" in where and "_ray_batches (raylm.data.stream:" in where
    assert "CPUs used per node: 127.0.0.1" in message
    # The thread wakes each second; the wait for the reader takes the exception within 0.5 s.
    assert 5 <= waited < 5 + 2 + 5  # + a slow cluster query


def test_a_worker_blocked_in_native_code_exits_with_the_reason(stuck_dataset, tmp_path):
    # The local engine waits in a lock without timeout: the raised exception never lands, so
    # the process must end itself. A process of its own, since it does exactly that.
    script = textwrap.dedent(f"""
        from raylm.train.loop import train_local
        from raylm.train.resilience.watchdog import ProgressWatchdog
        from tests.train.test_loop import tiny_config
        cfg = tiny_config({stuck_dataset!r}, "data.loader=local", "data.verify=false", "train.eval_every=0",
                          "train.steps=5", "checkpoint.every_steps=0")
        train_local(cfg, {str(tmp_path)!r}, (ProgressWatchdog(startup_s=3, exit_grace_s=2),))
        print("NOT REACHED")
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=os.getcwd())
    elapsed = time.monotonic() - start
    print(done.stderr[-3000:])
    assert done.returncode == EXIT_STATUS
    assert "NOT REACHED" not in done.stdout
    assert "raylm: watchdog: rank 0: no training step" in done.stderr
    assert "waiting for the first batch (step 0)" in done.stderr and "_thread_batches (raylm.data.stream:" in done.stderr
    assert "still blocked 2 s after the timeout; exiting the process" in done.stderr
    assert elapsed < 60  # start-up (imports, model) + 3 s + 2 s


class Stall(Hook):
    """Sleeps at the start of one step for a multiple of the watchdog's limit for that step."""

    def __init__(self, watchdog: ProgressWatchdog, step: int, times_limit: float):
        self.watchdog, self.step, self.times_limit = watchdog, step, times_limit
        self.limit = self.median = None

    def on_step_begin(self, run, step):
        if step == self.step:
            self.limit, self.median = self.watchdog.limit, statistics.median(self.watchdog.step_times)
            time.sleep(self.times_limit * self.limit)


@pytest.mark.parametrize("times_limit", [0.5, 2.0])
def test_the_limit_follows_the_step_time(tiny_dataset, tmp_path, times_limit):
    cfg = tiny_config(tiny_dataset, "train.steps=8", "train.eval_every=0", "checkpoint.every_steps=0")
    watchdog = ProgressWatchdog(startup_s=120, factor=5, min_s=1, exit_grace_s=30)
    stall = Stall(watchdog, step=6, times_limit=times_limit)
    if times_limit < 1:
        train_local(cfg, str(tmp_path), (watchdog, stall))
        assert watchdog.reason is None
        assert stall.limit == max(1.0, 5 * stall.median)
        return
    with pytest.raises(ProgressTimeout, match="running step 6 for .* past the limit of") as raised:
        train_local(cfg, str(tmp_path), (watchdog, stall))
    # Six measured steps: the floor or 5 × their median, not the start-up allowance.
    assert stall.limit == max(1.0, 5 * stall.median) < 120
    assert f"median step time {stall.median:.3g} s" in str(raised.value)
    assert "on_step_begin (tests.train.resilience.test_watchdog:" in str(raised.value)  # where it was stuck


class Fail(Hook):
    def on_step_begin(self, run, step):
        if step == 2:
            raise RuntimeError("an unrelated failure")


def test_a_run_that_fails_otherwise_leaves_no_watchdog_behind(tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset, "train.steps=8", "train.eval_every=0", "checkpoint.every_steps=0")
    watchdog = ProgressWatchdog(startup_s=1, factor=1, min_s=0.5, exit_grace_s=0.5)
    with pytest.raises(RuntimeError, match="an unrelated failure"):
        train_local(cfg, str(tmp_path), (watchdog, Fail()))
    time.sleep(3)  # past every deadline: a watchdog still armed would fire, then end this process
    assert watchdog.reason is None


def _stuck_ray_train_worker(config: dict) -> None:
    """A Ray Train worker as raylm.launch.driver runs it, with a short watchdog given Ray's hooks."""
    import ray

    from raylm.launch.worker import RayTrainEnv
    from raylm.launch.ray_watchdog import describe_pending, fail_worker_group
    from raylm.train.spec import RunSpec

    spec = RunSpec.from_dict(config["run"])
    job_id = ray.get_runtime_context().get_job_id()
    # A grace longer than the test allows: only Ray Train's failure handling can end this worker.
    watchdog = ProgressWatchdog(startup_s=5, describe=lambda: describe_pending(job_id), fail=fail_worker_group,
                                exit_grace_s=600)
    train(spec, RayTrainEnv(spec.config), (watchdog,))


@pytest.mark.slow
def test_ray_train_fails_the_worker_group_with_the_watchdogs_reason(ray_session, stuck_dataset, tmp_path):
    import ray.train
    from ray.train.torch import TorchTrainer

    from raylm.train.spec import local_run_dir, run_uri
    from raylm.launch.recovery import RecoveryLog
    from raylm.train.observe.records import EVENTS_FILE, read_jsonl
    from raylm.train.spec import resolve_run

    # The local engine: the training thread blocks in a lock, where a raised exception never
    # lands, so the failure can only come through Ray Train.
    cfg = stuck_config(stuck_dataset, "local")
    cfg.run.storage_path, cfg.run.name, cfg.parallel.num_workers = str(tmp_path), "stuck", 1
    spec = resolve_run(cfg)
    trainer = TorchTrainer(
        _stuck_ray_train_worker, train_loop_config={"run": spec.to_dict()},
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(
            name="stuck", storage_path=str(tmp_path), failure_config=ray.train.FailureConfig(max_failures=0),
            callbacks=[RecoveryLog(local_run_dir(spec.config), run_uri(spec.config), None)]))
    with pytest.raises(Exception, match="ProgressTimeout: rank 0: no training step") as raised:
        trainer.fit()
    print(raised.value)
    (failure,) = [e for e in read_jsonl(f"{local_run_dir(spec.config)}/{EVENTS_FILE}") if e["event"] == "failure"]
    cause = failure["cause"]["0"]
    assert cause.startswith("ProgressTimeout: rank 0: no training step for")
    assert "waiting for the first batch (step 0)" in cause and "_thread_batches (raylm.data.stream:" in cause


class WatcherWakeups(Hook):
    """Counts the watching thread's wakes (its voluntary context switches: each wake ends in
    another wait, and may first wait for the GIL the training thread holds: up to 2 switches a
    wake, 10 in 5 s once on 2 loaded cores) over the steps after the first. Not the involuntary
    ones: the scheduler takes the CPU from a running thread as often as the machine's load has it
    (9 against a bound of 7 once)."""

    def __init__(self, last_step: int):
        self.last_step, self.start, self.switches, self.seconds = last_step, None, None, None

    @staticmethod
    def _count() -> int:
        import threading

        (watcher,) = [t for t in threading.enumerate() if t.name.startswith("raylm-watchdog")]
        with open(f"/proc/self/task/{watcher.native_id}/status") as f:
            return sum(int(line.split()[1]) for line in f if line.split(":")[0] == "voluntary_ctxt_switches")

    def on_step_end(self, run, step, metrics):
        if step == 1:
            self.start = (self._count(), time.monotonic())
        elif step == self.last_step - 1:
            self.switches, self.seconds = self._count() - self.start[0], time.monotonic() - self.start[1]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="counts a thread's switches in /proc")
def test_steps_do_not_wake_the_watcher(tiny_dataset, tmp_path):
    """Each step re-arms the watchdog twice; a small model's hundred steps a second used to wake
    its thread as often, and each wake took the GIL from the training thread."""
    steps = 150
    cfg = tiny_config(tiny_dataset, f"train.steps={steps}", "train.eval_every=0", "checkpoint.every_steps=0")
    watchdog = ProgressWatchdog(startup_s=120, factor=5, min_s=1, exit_grace_s=30)
    wakeups = WatcherWakeups(steps)
    train_local(cfg, str(tmp_path), (watchdog, wakeups))
    assert watchdog.reason is None
    # It wakes about once a second (its own period), not 2 × 148 times.
    assert wakeups.switches <= 3 * wakeups.seconds + 4, (wakeups.switches, wakeups.seconds)
