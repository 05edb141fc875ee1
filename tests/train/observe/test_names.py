"""One set of metric names and units in every tracker (train/*, val/*, perf/*, MFU in percent), and
steps trained again (a guard rollback, a resume) neither drawn twice in TensorBoard nor dropped by
W&B. metrics.jsonl keeps its own keys: raylm's readers and earlier runs use them."""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import pytest
import torch

from raylm.config import load_config
from raylm.parallel.world import World
from raylm.train.observe.metrics import MetricsLogger
from raylm.train.observe.names import tracker_name, tracker_scalars
from tests.support.wandb_log import history

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_every_key_has_its_group_and_mfu_is_a_percentage():
    row = {"step": 7, "time": 1.0, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "val_loss": 2.4, "val_bpb": 1.1,
           "tokens_per_s": 9000, "mfu": 0.25, "step_time": 0.2, "data_wait": 0.01, "guard_s": 0.002,
           "act_norm/final": 3.0, "hellaswag/acc": 0.3, "samples": [1, 2], "skipped_samples": 0}
    assert tracker_scalars(row) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "val/loss": 2.4, "val/bpb": 1.1,
        "perf/tokens_per_s": 9000.0, "perf/mfu_percent": 25.0, "perf/step_time_s": 0.2, "perf/data_wait_s": 0.01,
        "perf/guard_s": 0.002, "act_norm/final": 3.0, "eval/hellaswag/acc": 0.3, "train/skipped_samples": 0.0}
    assert tracker_name("checkpoint_s") == "perf/checkpoint_s" and tracker_name("param_norm/x") == "param_norm/x"


def _row(step: int, loss: float) -> dict:
    return {"step": step, "time": float(step), "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "step_time": 0.1,
            "tokens_per_s": 1000.0, "mfu": 0.5}


def _board(run_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    board.Reload()
    return [(e.step, round(e.value, 5)) for e in board.Scalars(tag)]  # what TensorBoard draws (float32), in order


def test_tensorboard_draws_the_steps_a_rollback_and_a_resume_train_again_once(tmp_path):
    cfg = load_config(None, ["train.log_every=100", "train.steps=10", "schedule.warmup_steps=1", "model.vocab_size=256"])
    logger = MetricsLogger(cfg, str(tmp_path), WORLD)
    for step, loss in [(1, 3.0), (2, 2.9), (3, 9.0), (4, 9.5), (3, 2.8), (4, 2.7), (5, 2.6)]:  # rolled back to 2
        logger.on_step_end(None, step, _row(step, loss))
    logger.close()
    assert _board(str(tmp_path), "train/loss") == [(1, 3.0), (2, 2.9), (3, 2.8), (4, 2.7), (5, 2.6)]
    assert _board(str(tmp_path), "perf/mfu_percent")[-1] == (5, 50.0)

    # A restart resumes from a checkpoint at step 4: step 5 is trained again, by a new process.
    resumed = MetricsLogger(cfg, str(tmp_path), WORLD)
    resumed.on_train_start(SimpleNamespace(state=SimpleNamespace(step=4), restored_world_size=1,
                                           restore_read_bytes=[], cfg=cfg, world=WORLD, global_batch=1, seq_len=8))
    resumed.on_step_end(None, 5, _row(5, 2.5))
    resumed.close()
    assert _board(str(tmp_path), "train/loss") == [(1, 3.0), (2, 2.9), (3, 2.8), (4, 2.7), (5, 2.5)]


def test_wandb_keeps_the_steps_a_rollback_trains_again(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["train.log_every=100", "train.steps=10", "schedule.warmup_steps=1", "train.tensorboard=false",
                             "train.trackers=[wandb]"])
    logger = MetricsLogger(cfg, str(tmp_path), WORLD)
    steps = [(1, 3.0), (2, 2.9), (3, 9.0), (2, 2.8), (3, 2.7)]
    for step, loss in steps:
        logger.on_step_end(None, step, _row(step, loss))
    logger.close()
    (log,) = glob.glob(os.path.join(str(tmp_path), "wandb", "offline-run-*", "run-*.wandb"))
    logged = [(h["train/step"], h["train/loss"]) for h in history(log) if "train/loss" in h]
    assert logged == steps  # W&B would have dropped the second 2 and 3 if logged at their own step
