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
