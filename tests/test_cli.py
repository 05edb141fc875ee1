"""How `raylm` ends when a command fails: the user's error as one line and its exit status, not
the layers that carried it back (a Ray task's remote traceback, torch.distributed.checkpoint's
wrapper, which holds even a Ctrl-C met while a checkpoint was read or written)."""

from __future__ import annotations

import sys

import pytest
import ray.exceptions
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

import raylm.cli
from raylm.config import ConfigError
from tests.support.cli import assert_clean_refusal, run_main


def raised(error: BaseException) -> BaseException:
    """`error` with the traceback of having been raised (what the wrappers record)."""
    try:
        raise error
    except BaseException as e:
        return e


def in_checkpoint_io(error: BaseException) -> CheckpointException:
    return CheckpointException("load", {0: _wrap_exception(raised(error))})


def in_ray_task(error: Exception) -> Exception:
    return ray.exceptions.RayTaskError("_write_shard", "Traceback (most recent call last): ...", error).as_instanceof_cause()


@pytest.mark.parametrize("wrap", [in_checkpoint_io, in_ray_task, lambda e: in_ray_task(in_checkpoint_io(e))])
def test_the_error_inside_the_wrappers_decides_the_message_and_the_status(monkeypatch, wrap):
    def command(args):
        raise wrap(ConfigError("model.d_model must be positive"))

    monkeypatch.setattr(raylm.cli, "cmd_plan", command)
    outcome = run_main("plan", "--model", "1.3b", "--gpus", "8")
    assert_clean_refusal(outcome, "model.d_model")
    assert outcome.status == 2 and outcome.stderr == "raylm: error: model.d_model must be positive\n"


def test_a_ctrl_c_met_inside_a_checkpoint_read_is_an_interrupt(monkeypatch):
    def command(args):
        raise in_checkpoint_io(KeyboardInterrupt())

    monkeypatch.setattr(raylm.cli, "cmd_plan", command)
    outcome = run_main("plan", "--model", "1.3b", "--gpus", "8")
    assert outcome.status == 130 and outcome.stderr == "raylm: interrupted\n"


def test_an_unexpected_error_keeps_its_traceback(monkeypatch):
    def command(args):
        raise in_checkpoint_io(ZeroDivisionError("a bug"))

    monkeypatch.setattr(raylm.cli, "cmd_plan", command)
    with pytest.raises(CheckpointException):
        run_main("plan", "--model", "1.3b", "--gpus", "8")


@pytest.mark.parametrize("argv, wanted", [
    (["generate", "--checkpoint", "{file}", "--prompt", "a"], "a checkpoint directory, or a run directory"),
    (["eval", "{file}", "--data", "{dir}"], "a checkpoint directory, or a run directory"),
    (["export", "{file}", "--output", "{dir}/out"], "a checkpoint directory, or a run directory"),
    (["checkpoint", "verify", "{file}"], "a checkpoint directory, or a run directory"),
    (["import", "{file}", "--output", "{dir}/out"], "the Hugging Face model directory that holds config.json"),
    (["report", "{file}", "--output", "{dir}/report"], "the run directory that holds metrics.jsonl"),
    (["eval", "{dir}", "--tasks", "t", "--include-path", "{file}"], "a file, not a directory (give the directory"),
])
def test_a_file_given_for_a_directory_is_named_as_a_file(tmp_path, argv, wanted):
    """A user trial: a run's config.yaml (or metrics.jsonl, or a model's config.json) given where
    its directory belongs was "[Errno 20] Cannot list directory", "no config.json" beside the
    config.json given, or "no such directory"."""
    given = tmp_path / "config.json"
    given.write_text("{}\n")
    outcome = run_main(*(a.format(file=given, dir=tmp_path) for a in argv))
    assert_clean_refusal(outcome, str(given))
    assert outcome.status == 2 and "[Errno" not in outcome.stderr, outcome.stderr
    assert f"{given}" in outcome.stderr and wanted in outcome.stderr, outcome.stderr


def test_version_names_raylm_and_the_libraries_that_decide_a_run():
    """`raylm --version` was "the following arguments are required: command", exit 2."""
    from importlib.metadata import version

    outcome = run_main("--version")
    assert outcome.status == 0, outcome.stderr
    assert outcome.stdout == (f"raylm {version('raylm')} (ray {version('ray')}, torch {version('torch')}, "
                              f"Python {'.'.join(map(str, sys.version_info[:3]))})\n")
