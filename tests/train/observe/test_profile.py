"""Profiles on demand (`train.profile`): a real in-process run writes a Chrome trace of the
chosen steps that holds their operators and the loop's spans, records where it is, and
`raylm report` links it; without the setting the loop builds no profiler hook and nothing is
written."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from raylm.config import ConfigError, ProfileConfig
from raylm.config.describe import describe_fields
from raylm.model.transformer import Transformer
from raylm.parallel.layout import resolve_layout
from raylm.parallel.world import World
from raylm.report import write_report
from raylm.train.hooks import Run
from raylm.train.loop import train_local
from raylm.train.observe.profile import ProfileHook
from raylm.train.observe.records import read_jsonl
from raylm.train.optim import build_optimizer
from raylm.train.state import TrainState
from raylm.train.step import build_model
from tests.parallel.test_layouts import GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, global_batch, make_config
from tests.train.test_loop import tiny_config


def _names(trace: dict) -> set[str]:
    return {event.get("name", "") for event in trace["traceEvents"]}


def test_profiled_steps_write_a_trace_that_the_report_links(tiny_dataset, tmp_path):
    run = tmp_path / "run"
    train_local(tiny_config(tiny_dataset, "train.steps=6", "checkpoint.every_steps=0", "train.eval_every=0",
                            "train.profile.start_step=3", "train.profile.steps=2"), str(run))
    assert os.listdir(run / "profile") == ["rank_00000.trace.json"]
    with open(run / "profile" / "rank_00000.trace.json") as f:
        names = _names(json.load(f))
    assert {"step 3", "step 4", "forward", "backward"} <= names
    assert names & {"aten::mm", "aten::addmm"}
    assert "step 2" not in names and "step 5" not in names  # only the chosen steps
    assert any(name.startswith("autograd::engine::evaluate_function: MmBackward") for name in names)
    (event,) = [e for e in read_jsonl(str(run / "events.jsonl")) if e["event"] == "profile"]
    assert (event["step"], event["last_step"], event["files"]) == (3, 4, ["profile/rank_00000.trace.json"])

    write_report([str(run)])
    text = (run / "report" / "report.html").read_text()
    assert '<a href="../profile/rank_00000.trace.json">rank_00000.trace.json</a>' in text
    assert "ui.perfetto.dev" in text and "pytorch.org/memory_viz" in text


def test_a_profile_that_outlasts_the_run_is_written_at_its_end(tiny_dataset, tmp_path):
    train_local(tiny_config(tiny_dataset, "train.steps=3", "checkpoint.every_steps=0", "train.eval_every=0",
                            "train.profile.start_step=3", "train.profile.steps=5"), str(tmp_path))
    with open(tmp_path / "profile" / "rank_00000.trace.json") as f:
        assert "step 3" in _names(json.load(f))


def test_no_profile_unless_asked(tiny_dataset, tmp_path, monkeypatch):
    monkeypatch.setattr("raylm.train.loop.ProfileHook", None)  # the loop must not even build the hook
    train_local(tiny_config(tiny_dataset, "train.steps=2", "checkpoint.every_steps=0", "train.eval_every=0"),
                str(tmp_path))
    assert not (tmp_path / "profile").exists()
    assert not [e for e in read_jsonl(str(tmp_path / "events.jsonl")) if e["event"] == "profile"]
    write_report([str(tmp_path)])
    assert "<h2>Profiles</h2>" not in (tmp_path / "report" / "report.html").read_text()


def test_help_config_describes_the_profile_keys():
    text = describe_fields()
    assert "  profile: ProfileConfig | null = None" in text
    assert "    start_step: int = 10\n        The first profiled step" in text


@pytest.mark.parametrize("setting", ["train.profile.start_step=0", "train.profile.steps=0",
                                     "train.profile.start_step=11"])
def test_profile_range_is_checked(setting):
    with pytest.raises(ConfigError, match=r"train.profile: start_step must be in \[1, train.steps=10\]"):
        tiny_config("unused", "train.steps=10", setting)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_memory_profile_of_one_step(device, tmp_path):
    """The hook alone around one step, with no dataset (a GPU machine has no Ray): allocations in
    the trace; on CUDA its kernels too, and the allocator's snapshot beside it."""
    cfg = make_config("llama")
    world = World.current(torch.device(device))
    model = build_model(lambda: Transformer(cfg.model), cfg, world,
                        resolve_layout(cfg.parallel, cfg.model, 1, cfg.train.seq_len))
    run = Run(cfg, world, model, build_optimizer(model.parts, cfg.optim), TrainState(), SEQ_LEN, GLOBAL_BATCH,
              flops_per_token=1.0, peak_flops=1.0)
    hook = ProfileHook(ProfileConfig(start_step=1, steps=1, memory=True), str(tmp_path), str(tmp_path))
    hook.on_step_begin(run, 0)
    model.forward_backward(global_batch(0).to(world.device), MICRO_BATCH)
    hook.on_step_end(run, 0, {})
    with open(tmp_path / "profile" / "rank_00000.trace.json") as f:
        events = json.load(f)["traceEvents"]
    assert {"step 1", "forward", "backward", "[memory]"} <= {e.get("name") for e in events}
    if device == "cpu":
        assert os.listdir(tmp_path / "profile") == ["rank_00000.trace.json"]
        return
    assert "kernel" in {e.get("cat") for e in events}
    with open(tmp_path / "profile" / "rank_00000.memory.pickle", "rb") as f:
        assert pickle.load(f)["segments"]  # what pytorch.org/memory_viz draws
