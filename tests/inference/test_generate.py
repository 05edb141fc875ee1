"""`raylm generate` says which checkpoint it samples from, and why a newer one was passed over;
arguments it cannot use are refused by name."""

from __future__ import annotations

import os

import pytest

from raylm.train.loop import train_local
from tests.support.cli import assert_clean_refusal, run_main
from tests.train.test_loop import tiny_config


@pytest.fixture(scope="module")
def run(tiny_dataset, tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("generate") / "run")
    train_local(tiny_config(tiny_dataset, "train.steps=4", "checkpoint.every_steps=2", "train.eval_every=0"), run_dir)
    return run_dir


def damage_newest(run: str, tmp_path, damage: str) -> tuple[str, str, str]:
    """A copy of `run` whose newest checkpoint has a .distcp file damaged: grown ("size"), or one
    byte flipped ("content", which only its checksum tells); (the copy, that checkpoint, the file)."""
    import shutil

    damaged = str(tmp_path / "run")
    shutil.copytree(run, damaged)
    newest = os.path.join(damaged, max(n for n in os.listdir(damaged) if n.startswith("checkpoint_")))
    shard = next(n for n in os.listdir(newest) if n.endswith(".distcp"))
    with open(os.path.join(newest, shard), "r+b") as f:
        if damage == "size":
            f.seek(0, os.SEEK_END)
            f.write(b"extra")  # its size no longer matches the manifest
        else:  # the same size: only its checksum, read from the whole file, tells
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    return damaged, newest, shard


@pytest.mark.parametrize("damage", ["size", "content"])
def test_a_damaged_newest_checkpoint_is_named_with_the_one_used(run, tmp_path, damage):
    damaged, newest, shard = damage_newest(run, tmp_path, damage)
    outcome = run_main("generate", "--checkpoint", damaged, "--prompt", "The", "--max-new-tokens", "5", "--seed", "0")
    assert outcome.status == 0, outcome.stderr
    assert f"raylm: passing over {newest}: {shard} " in outcome.stderr  # "is N bytes" or "has sha256"
    assert f"raylm: using checkpoint {os.path.join(damaged, 'checkpoint_00000002')}" in outcome.stderr
    assert outcome.stdout.startswith("The")


@pytest.mark.parametrize("argv, name", [
    (["--prompt", ""], "--prompt is empty"),
    (["--top-k", "0"], "--top-k"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_arguments_generation_cannot_use_are_refused(run, argv, name):
    outcome = run_main("generate", "--checkpoint", run, *argv)
    assert outcome.status == 2 and name in outcome.stderr and "Traceback" not in outcome.stderr
    assert len(outcome.stderr.strip().splitlines()) == 1, outcome.stderr


def test_a_prompt_that_is_not_utf8_is_refused(run):
    """A shell passes bytes: Python decodes argv's bytes that are not UTF-8 to surrogate escapes,
    which no tokenizer can encode."""
    outcome = run_main("generate", "--checkpoint", run, "--prompt", os.fsdecode(b"ab\xff\xfe"))
    assert_clean_refusal(outcome, "--prompt is not UTF-8 text (character 3")
    assert outcome.status == 2


def test_eval_refuses_zero_workers(run, tiny_dataset):
    assert_clean_refusal(run_main("eval", run, "--data", tiny_dataset, "--workers", "0"), "--workers")


def test_a_checkpoint_taken_to_read_outlives_its_runs_removal_of_it(run, tmp_path):
    """What export and generate read is a snapshot (hard links): the run's retention removing the
    checkpoint meanwhile (checkpoint.keep_last) left a reader with missing files."""
    import shutil

    from raylm.inference.load import checkpoint_removed, sound_checkpoint
    from raylm.train.checkpoint import format as checkpoint
    from raylm.train.checkpoint.policy import remove_checkpoint

    copy = str(tmp_path / "run")
    shutil.copytree(run, copy)
    newest = os.path.join(copy, "checkpoint_00000004")
    with sound_checkpoint(copy) as (uri, directory):
        assert uri == newest and directory != newest
        remove_checkpoint(uri, None)
        assert not os.path.exists(newest) and checkpoint_removed(uri)
        assert checkpoint.local_problem(directory) is None  # every file, to its checksum
    assert not any(name.startswith(".reading-") for name in os.listdir(copy))


@pytest.mark.slow
def test_export_and_generate_of_a_run_that_prunes_its_checkpoints_as_it_trains(tiny_dataset, tmp_path):
    """A real run saving every step and keeping one checkpoint, exported, sampled from and verified
    while it trains: before, 5 of 12 exports failed ("__0_0.distcp is missing, though the manifest
    lists it", "config.yaml: no such file", "no checkpoint of this run can be used")."""
    import glob
    import subprocess
    import sys
    import time

    from raylm.export.hf import export_hf
    from raylm.inference.load import load_for_inference
    from raylm.train.checkpoint.format import verify

    run_dir = str(tmp_path / "run")
    code = ("import sys\nfrom raylm.train.loop import train_local\nfrom tests.train.test_loop import tiny_config\n"
            "train_local(tiny_config(sys.argv[1], 'train.steps=100000', 'checkpoint.every_steps=1', "
            "'checkpoint.keep_last=1', 'train.eval_every=0', 'model.d_model=128'), sys.argv[2])")
    trainer = subprocess.Popen([sys.executable, "-c", code, tiny_dataset, run_dir], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(os.path.join(run_dir, "checkpoint_*", "checkpoint_manifest.json")) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
            assert trainer.poll() is None, trainer.stderr.read().decode()[-3000:]
        used = set()
        for i in range(8):
            summary = export_hf(run_dir, str(tmp_path / f"hf{i}"))
            used.add(summary["checkpoint"])
            load_for_inference(run_dir)
            lines = verify(run_dir)  # `raylm checkpoint verify`: a checkpoint removed meanwhile is no failure
            assert all(ok for ok, _ in lines), lines
        assert trainer.poll() is None and len(used) > 1  # the run went on saving and removing meanwhile
    finally:
        trainer.kill()
        trainer.wait()
    assert not any(name.startswith(".reading-") for name in os.listdir(run_dir))
