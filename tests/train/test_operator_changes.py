"""Changing a run on resume, as OPT's team did mid-flight: what may change takes effect and is
recorded; what would change the meaning of the saved state is refused, every key named."""

from __future__ import annotations

import os

import pytest

from raylm.config import ConfigError
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from tests.train.test_loop import tiny_config

COMMON = ("train.eval_every=0", "train.tensorboard=false", "checkpoint.every_steps=4", "schedule.name=constant",
          "schedule.warmup_steps=0")


def test_a_new_lr_and_skip_range_take_effect_and_are_recorded(tiny_dataset, tmp_path):
    run = str(tmp_path / "run")
    train_local(tiny_config(tiny_dataset, "train.steps=4", *COMMON), run)
    train_local(tiny_config(tiny_dataset, "train.steps=8", *COMMON, "optim.lr=2e-3", "data.skip=[[32, 48]]",
                      "optim.grad_clip=0.5"), run)
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert rows[4]["lr"] == pytest.approx(1e-2) and rows[5]["lr"] == pytest.approx(2e-3)
    assert rows[4]["position"] == 32 and rows[5]["position"] == 56  # [32, 48) left out
    (event,) = [e for e in read_jsonl(os.path.join(run, "events.jsonl")) if e["event"] == "config_changed"]
    assert event["step"] == 4
    assert event["changes"] == {"data.skip": [[], [[32, 48]]], "optim.grad_clip": [1.0, 0.5],
                                "optim.lr": [1e-2, 2e-3], "train.steps": [4, 8]}
    assert read_jsonl(os.path.join(run, "config_history.jsonl")) == [event]


@pytest.mark.parametrize("change, keys", [
    (["model.n_layers=1"], ["model.n_layers: saved 2, now 1"]),
    (["model.n_heads=2"], ["model.n_heads: saved 4, now 2", "model.n_kv_heads: saved 4, now 2"]),
])
def test_a_changed_shape_is_refused_listing_every_key(tiny_dataset, tmp_path, change, keys):
    run = str(tmp_path / "run")
    train_local(tiny_config(tiny_dataset, "train.steps=4", *COMMON), run)
    with pytest.raises(ConfigError, match="cannot resume") as refused:
        train_local(tiny_config(tiny_dataset, "train.steps=8", *COMMON, *change), run)
    for key in keys:
        assert key in str(refused.value)
