"""Checkpoint safety: completeness, crash mid-write, a full disk, retention."""

import contextlib
import json
import os
import tempfile
from typing import Iterator

import pytest

from cluster.chaos import fill_filesystem
from raylm.data import storage
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.errors import CheckpointWriteError
from raylm.train.hooks import Hook
from raylm.train.env import LocalEnv
from raylm.train.loop import train, train_local
from raylm.train.observe.records import read_jsonl
from raylm.train.spec import resolve_run
from tests.support.checkpoints import flip_byte
from tests.support.filesystems import tmpfs
from tests.train.test_loop import losses, tiny_config


def checkpoints(run_dir):
    return sorted(n for n in os.listdir(run_dir) if n.startswith(checkpoint.PREFIX))


def test_crash_mid_write_resumes_from_the_previous_complete_checkpoint(tiny_dataset, tmp_path):
    common = ("train.steps=8", "checkpoint.every_steps=2", "train.eval_every=0")
    train_local(tiny_config(tiny_dataset, *common), str(tmp_path / "straight"))
    run = tmp_path / "crashed"
    train_local(tiny_config(tiny_dataset, *common, "train.stop_at_step=6"), str(run))
    # What a crash while writing step 6 leaves: a shard cut short and no final manifest.
    step6 = run / "checkpoint_00000006"
    os.remove(step6 / checkpoint.MANIFEST)
    shard = next(p for p in step6.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    assert "no checkpoint_manifest.json" in checkpoint.incomplete_reason(str(step6))
    assert checkpoint.latest_complete(str(run)) == str(run / "checkpoint_00000004")

    train_local(tiny_config(tiny_dataset, *common), str(run))
    straight, resumed = losses(tmp_path / "straight"), losses(run)
    for step in (5, 6, 7, 8):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6)
    # The recovery is on record, and the redone steps appear once in the metrics.
    with open(run / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, 9))
    with open(run / "events.jsonl") as f:
        (event,) = [json.loads(line) for line in f]
    assert event["event"] == "resumed" and event["from_step"] == 4 and event["steps_lost"] == 2


def test_manifest_records_every_file_and_detects_a_changed_one(tiny_dataset, tmp_path):
    train_local(tiny_config(tiny_dataset, "train.steps=2", "train.eval_every=0"), str(tmp_path))
    ckpt = tmp_path / "checkpoint_00000002"
    listed = json.loads((ckpt / checkpoint.MANIFEST).read_text())["files"]
    assert {".metadata", "train_state.json", "config.yaml", "tokenizer.json", "rng/rank_00000.pt"} <= set(listed)
    assert checkpoint.incomplete_reason(str(ckpt)) is None
    (ckpt / "config.yaml").write_text("changed")
    assert "config.yaml" in checkpoint.incomplete_reason(str(ckpt))


def test_old_checkpoints_storage_will_not_remove_wait_for_the_next_save(tiny_dataset, tmp_path, monkeypatch, capsys):
    """Storage that failed just after a checkpoint was published (a suite run's S3 outage began
    there) failed the removal of the older ones, and that error restarted the run from the
    checkpoint just written. The outage is injected at that one call: a real one cannot be timed
    between the manifest and the listing."""
    listed = []
    real_list_dir = storage.list_dir

    def list_dir(uri, storage_cfg=None):
        listed.append(uri)
        if len(listed) == 3:
            raise storage.StorageUnreachableError(f"{uri}: cannot connect to endpoint (injected)")
        return real_list_dir(uri, storage_cfg)

    monkeypatch.setattr(storage, "list_dir", list_dir)
    final = train_local(tiny_config(tiny_dataset, "train.steps=6", "checkpoint.every_steps=1", "checkpoint.keep_last=2",
                                    "train.eval_every=0"), str(tmp_path))
    assert final["step"] == 6 and len(listed) > 3
    assert "older checkpoints under" in capsys.readouterr().out
    assert checkpoints(tmp_path) == ["checkpoint_00000005", "checkpoint_00000006"]  # pruned at the next save


def test_retention_keeps_the_last_k_and_every_mth(tiny_dataset, tmp_path):
    train_local(tiny_config(tiny_dataset, "train.steps=10", "checkpoint.every_steps=1", "checkpoint.keep_last=2",
                      "checkpoint.keep_every=4", "train.eval_every=0"), str(tmp_path))
    assert checkpoints(tmp_path) == ["checkpoint_00000004", "checkpoint_00000008",
                                     "checkpoint_00000009", "checkpoint_00000010"]
    assert checkpoint.retained(["checkpoint_00000001"], 0, None) == {"checkpoint_00000001"}
    # Ray Train keeps a file in the run directory whose name starts alike: not a checkpoint.
    (tmp_path / "checkpoint_manager_snapshot.json").write_text("{}")
    assert checkpoint.latest_complete(str(tmp_path)) == str(tmp_path / "checkpoint_00000010")


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A real 256 KiB filesystem (tmpfs): too small for a checkpoint of the test model."""
    yield from tmpfs(tmp_path, "256k")


def test_full_disk_stops_training_with_a_clear_error(tiny_dataset, tiny_filesystem, tmp_path):
    run = tiny_filesystem / "run"
    cfg = tiny_config(tiny_dataset, "train.steps=6", "checkpoint.every_steps=3", "train.eval_every=0",
                      "train.tensorboard=false", "checkpoint.write_attempts=2")
    with pytest.raises(CheckpointWriteError, match=r"step 3: no checkpoint could be written .* not enough free space"):
        train_local(cfg, str(run))
    assert max(losses(run)) == 3  # stopped at the failed save, not one step later
    assert checkpoint.latest_complete(str(run)) is None


def test_allowed_failures_train_on_warning_every_step_but_a_final_save_that_fails_fails_the_run(
        tiny_dataset, tiny_filesystem, capsys):
    """A user trial: every save of the run failed on a full disk, the final one included, and the
    run said `done` and exited 0; its weights were nowhere, and its warning spoke of a checkpoint
    "since step 5" when none had ever been written."""
    run = tiny_filesystem / "run"
    cfg = tiny_config(tiny_dataset, "train.steps=6", "checkpoint.every_steps=3", "train.eval_every=0",
                      "checkpoint.write_attempts=1", "checkpoint.allow_failures=true")
    with pytest.raises(CheckpointWriteError) as failed:
        train_local(cfg, str(run))
    assert str(failed.value).startswith(f"step 6: the run trained to its end, but no checkpoint has been written to "
                                        f"{run} since step 3 (")
    assert "the final one included: all its steps (it has no checkpoint) are lost" in str(failed.value)
    out = capsys.readouterr().out
    assert max(losses(run)) == 6  # it trained on, loudly
    assert out.count("WARNING: no checkpoint could be written since step 3 (") == 4  # steps 3, 4, 5, 6
    assert out.count("a failure now loses all its steps (it has no checkpoint)") == 4
    assert checkpoint.latest_complete(str(run)) is None


class FillDisk(Hook):
    """A stray file takes every free byte of the run's filesystem at `fill`, and is deleted at
    `free` (steps as the loop counts them)."""

    def __init__(self, directory: str, fill: int, free: int):
        self.path, self.fill, self.free = os.path.join(directory, "stray"), fill, free

    def on_step_begin(self, run, step):
        if step == self.fill:
            fill_filesystem(self.path)
        if step == self.free:
            os.remove(self.path)


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 8 MiB filesystem (tmpfs): room for the test model's checkpoints, until filled."""
    yield from tmpfs(tmp_path, "8m")


def test_a_full_disk_is_loud_loses_no_record_and_saves_again_once_freed(tiny_dataset, small_filesystem, capsys):
    """IBM's run silently stopped checkpointing when its disk filled. Here a stray file fills the
    disk from step 5 to step 10: the saves at steps 6 and 9 fail, with an event each and a
    warning and an `unprotected_steps` metric every step; every metrics row of those steps is
    written once there is space; the save at step 12 succeeds, with a `checkpoint_recovered`."""
    run = small_filesystem / "run"
    cfg = tiny_config(tiny_dataset, "train.steps=14", "checkpoint.every_steps=3", "train.eval_every=0",
                      "checkpoint.write_attempts=1", "checkpoint.allow_failures=true", "checkpoint.keep_last=10")
    train_local(cfg, str(run), hooks=(FillDisk(str(small_filesystem), fill=4, free=9),))
    rows = {r["step"]: r for r in read_jsonl(str(run / "metrics.jsonl"))}
    assert sorted(rows) == list(range(1, 15))  # nothing lost to the full disk
    assert [s for s in rows if "unprotected_steps" in rows[s]] == list(range(7, 13))
    assert rows[12]["unprotected_steps"] == 6
    events = read_jsonl(str(run / "events.jsonl"))
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [6, 9] and all("space" in e["error"] for e in failed)
    (recovered,) = [e for e in events if e["event"] == "checkpoint_recovered"]
    assert recovered["step"] == 12 and recovered["unprotected_since"] == 6
    assert checkpoints(run) == ["checkpoint_00000003", "checkpoint_00000012", "checkpoint_00000014"]
    assert checkpoint.latest_complete(str(run)) == str(run / "checkpoint_00000014")
    out = capsys.readouterr().out
    assert out.count("WARNING: no checkpoint could be written since step 6 (") == 6  # steps 6 .. 11
    assert out.count("a failure now loses the steps since step 3 (its newest checkpoint)") == 6


class FreeDisk(Hook):
    """The stray file goes at the beginning of each step in `steps`."""

    def __init__(self, stray: str, steps: set[int]):
        self.stray, self.steps = stray, steps

    def on_step_begin(self, run, step):
        if step in self.steps:
            os.remove(self.stray)


class FreeDiskAndFail(FreeDisk):
    """The stray file goes at the beginning of `step`, and the step fails."""

    def on_step_begin(self, run, step):
        super().on_step_begin(run, step)
        if step in self.steps:
            raise RuntimeError(f"injected failure at step {step}")


def test_rows_a_full_disk_held_back_are_written_if_space_returns_before_the_run_ends(
        tiny_dataset, small_filesystem, capsys):
    """The disk fills as step 5 begins and is freed as step 15 fails: the rows held back (those past
    what the last block of metrics.jsonl still held) are written as the run ends."""
    run = small_filesystem / "run"
    cfg = tiny_config(tiny_dataset, "train.steps=16", "checkpoint.every_steps=0", "train.eval_every=0",
                      "checkpoint.write_attempts=1", "checkpoint.allow_failures=true")
    hooks = (FillDisk(str(small_filesystem), fill=4, free=-1),
             FreeDiskAndFail(str(small_filesystem / "stray"), {14}))
    with pytest.raises(RuntimeError, match="injected failure at step 14"):
        train_local(cfg, str(run), hooks=hooks)
    assert f"WARNING: {run / 'metrics.jsonl'}: the disk is full" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(str(run / "metrics.jsonl"))] == list(range(1, 15))


class UploadingEnv(LocalEnv):
    """`LocalEnv` that stages each part off the run's disk and copies it over at publish, as
    `RayTrainEnv` does, so the disk can fill after the space check: at the publish of a step in
    `fill_before_copy` (the copy fails) or `fill_after_copy` (the manifest fails)."""

    def __init__(self, run_dir: str, staging_root: str, stray: str, fill_before_copy: set[int],
                 fill_after_copy: set[int]):
        super().__init__(run_dir)
        self.staging_root, self.stray = staging_root, stray
        self.fill_before_copy, self.fill_after_copy = fill_before_copy, fill_after_copy

    @contextlib.contextmanager
    def staging_dir(self, step: int) -> Iterator[str]:
        with tempfile.TemporaryDirectory(dir=self.staging_root) as directory:
            yield directory

    def publish(self, step: int, directory: str) -> str:
        if step in self.fill_before_copy:
            fill_filesystem(self.stray)
        uri = os.path.join(self.checkpoint_root, checkpoint.dir_name(step))
        storage.copy_dir(directory, uri)
        if step in self.fill_after_copy:
            fill_filesystem(self.stray)
        return uri


def test_a_disk_that_fills_after_the_space_check_fails_the_save_not_the_run(tiny_dataset, small_filesystem, tmp_path):
    """The drill's full disk struck after a save's space check: the upload (then the manifest)
    found no space. Each is a failed save under `allow_failures` (an event, no partial checkpoint
    left), training goes on, and the next save once there is space is published."""
    run = small_filesystem / "run"
    cfg = tiny_config(tiny_dataset, "train.steps=12", "checkpoint.every_steps=3", "train.eval_every=0",
                      "checkpoint.write_attempts=1", "checkpoint.allow_failures=true", "checkpoint.keep_last=10")
    staging = tmp_path / "staging"
    staging.mkdir()
    stray = str(small_filesystem / "stray")
    env = UploadingEnv(str(run), str(staging), stray, fill_before_copy={6}, fill_after_copy={9})
    train(resolve_run(cfg, sizes=range(1, 2)), env, hooks=(FreeDisk(stray, {8, 11}),))
    rows = {r["step"]: r for r in read_jsonl(str(run / "metrics.jsonl"))}
    assert sorted(rows) == list(range(1, 13))
    events = read_jsonl(str(run / "events.jsonl"))
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [6, 9] and all("No space left" in e["error"] for e in failed)
    (recovered,) = [e for e in events if e["event"] == "checkpoint_recovered"]
    assert recovered["step"] == 12 and recovered["unprotected_since"] == 6
    assert checkpoints(run) == ["checkpoint_00000003", "checkpoint_00000012"]
    assert checkpoint.latest_complete(str(run)) == str(run / "checkpoint_00000012")
    assert os.listdir(staging) == []  # every staged part removed, published or not


def _train_ranks(dataset: str, run_dir: str, *extra: str) -> None:
    train_local(tiny_config(dataset, *extra), run_dir)


@pytest.mark.slow
def test_async_saves_resume_like_sync_saves_on_two_ranks(tiny_dataset, tmp_path):
    from tests.support.distributed import run_distributed

    common = ("train.steps=8", "checkpoint.every_steps=2", "train.eval_every=0", "train.tensorboard=false")
    run_distributed(_train_ranks, 2, tiny_dataset, str(tmp_path / "sync"), *common)
    resumed = tmp_path / "async"
    run_distributed(_train_ranks, 2, tiny_dataset, str(resumed), *common, "checkpoint.async_save=true",
                    "train.stop_at_step=6")
    assert checkpoints(resumed) == ["checkpoint_00000002", "checkpoint_00000004", "checkpoint_00000006"]
    written_during = {n: json.loads((resumed / n / checkpoint.MANIFEST).read_text())["steps_during_write"]
                      for n in checkpoints(resumed)}
    # Step 5 trained (and updated the weights) while step 4's checkpoint was being written; the
    # last save is waited for at the end, with no step during it.
    assert written_during["checkpoint_00000004"] >= 1 and written_during["checkpoint_00000006"] == 0
    # What a crash while step 6's checkpoint was written leaves: no manifest. The resume takes
    # step 4's, and reproduces the synchronous run: the background write saw step 4's state.
    os.remove(resumed / "checkpoint_00000006" / checkpoint.MANIFEST)
    run_distributed(_train_ranks, 2, tiny_dataset, str(resumed), *common, "checkpoint.async_save=true")
    sync, async_ = losses(tmp_path / "sync"), losses(resumed)
    assert sorted(async_) == list(range(1, 9))
    for step in range(1, 9):
        assert async_[step] == pytest.approx(sync[step], rel=1e-6), step
    with open(resumed / "events.jsonl") as f:
        (event,) = [json.loads(line) for line in f]
    assert event["event"] == "resumed" and event["from_step"] == 4


def test_resume_passes_over_a_corrupted_checkpoint_for_the_previous_one(tiny_dataset, tmp_path):
    common = ("train.steps=8", "checkpoint.every_steps=2", "train.eval_every=0")
    train_local(tiny_config(tiny_dataset, *common), str(tmp_path / "straight"))
    run = tmp_path / "corrupted"
    train_local(tiny_config(tiny_dataset, *common, "train.stop_at_step=6"), str(run))
    flip_byte(str(run / "checkpoint_00000006" / "__0_0.distcp"))  # same size: only its checksum tells
    train_local(tiny_config(tiny_dataset, *common), str(run))
    straight, resumed = losses(tmp_path / "straight"), losses(run)
    for step in (5, 6, 7, 8):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6)
    with open(run / "events.jsonl") as f:
        skipped, resumed_event = [json.loads(line) for line in f]
    assert skipped["event"] == "checkpoint_skipped" and skipped["uri"] == str(run / "checkpoint_00000006")
    assert skipped["reason"].startswith("__0_0.distcp has sha256")
    assert resumed_event["event"] == "resumed" and resumed_event["from_step"] == 4


class DropAFile(Hook):
    """As step `step` + 1 begins, a file lands in the run's first checkpoint: what a run named into
    it wrote there (`run.name=parent/checkpoint_00000001/child`, before such names were refused)."""

    def __init__(self, run_dir: str, step: int):
        self.path, self.step = os.path.join(run_dir, "checkpoint_00000001", "child", "metrics.jsonl"), step

    def on_step_begin(self, run, step):
        if step == self.step:
            os.makedirs(os.path.dirname(self.path))
            with open(self.path, "w") as f:
                f.write('{"step": 1}\n')


def test_pruning_removes_what_a_checkpoint_holds_and_names_what_else_it_finds(tiny_dataset, tmp_path, capsys):
    """A user trial: the parent run's next save with keep_last=1 deleted the child run inside its
    checkpoint directory with the checkpoint, without a word."""
    run = tmp_path / "parent"
    cfg = tiny_config(tiny_dataset, "train.steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=1",
                      "train.eval_every=0")
    train_local(cfg, str(run), hooks=(DropAFile(str(run), step=1),))
    first = run / "checkpoint_00000001"
    assert [str(p.relative_to(first)) for p in first.rglob("*")] == ["child", "child/metrics.jsonl"]
    assert checkpoint.latest_complete(str(run)) == str(run / "checkpoint_00000003")
    assert not (run / "checkpoint_00000002").exists()
    out = capsys.readouterr().out
    assert out.count(f"raylm: warning: step 2: removed checkpoint {first} but left 1 file(s) there that it does not "
                     "hold (child/metrics.jsonl)") == 1  # once, not at every later save
    (kept,) = [e for e in read_jsonl(str(run / "events.jsonl")) if e["event"] == "checkpoint_files_kept"]
    assert kept["uri"] == str(first) and kept["files"] == ["child/metrics.jsonl"]


def test_a_checkpoint_without_its_manifest_is_removed_by_the_names_a_save_writes(tmp_path):
    """What a save cut short leaves has no manifest to say what is its: the names a save writes."""
    from raylm.train.checkpoint.policy import remove_checkpoint

    directory = tmp_path / "checkpoint_00000004"
    for name in (".metadata.tmp", "__0_0.distcp", "__1_0.distcp", "rng/rank_00000.pt", "train_state.json",
                 "config.yaml", "tokenizer.json", "notes.txt", "child/config.yaml"):
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text("x")
    removed, left = remove_checkpoint(str(directory), None)
    assert sorted(left) == ["child/config.yaml", "notes.txt"] and len(removed) == 7
    assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) == ["child", "child/config.yaml",
                                                                                  "notes.txt"]
    remove_checkpoint(str(tmp_path / "checkpoint_00000005"), None)  # nothing there is fine
