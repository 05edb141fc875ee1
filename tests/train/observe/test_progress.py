"""The progress line: its throughput and MFU are smoothed alike, so they agree on every line."""

from __future__ import annotations

import re

import torch

from raylm.config import load_config
from raylm.parallel.world import World
from raylm.train.observe.metrics import MetricsLogger


def test_the_progress_lines_mfu_follows_its_smoothed_throughput(tmp_path, capsys):
    cfg = load_config(None, ["train.tensorboard=false", "train.log_every=1", "train.steps=6",
                             "schedule.warmup_steps=1"])
    logger = MetricsLogger(cfg, str(tmp_path), World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    flops_per_token, peak = 3e6, 1e11
    for step, tokens_per_s in enumerate([9_000, 18_000, 6_000, 12_000, 9_000, 20_000], start=1):
        logger.on_step_end(None, step, {"step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "time": 0.0,
                                        "step_time": 0.1, "tokens_per_s": tokens_per_s,
                                        "mfu": flops_per_token * tokens_per_s / peak})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert len(lines) == 6
    for line in lines:
        shown = re.search(r"\| ([\d,]+) tok/s \| mfu ([\d.]+)%", line)
        tokens_per_s, mfu = float(shown.group(1).replace(",", "")), float(shown.group(2)) / 100
        assert abs(mfu - flops_per_token * tokens_per_s / peak) < 1e-4, line


def test_a_gpu_model_without_a_known_peak_has_no_mfu_and_its_line_says_how_to_give_one(tmp_path, capsys):
    cfg = load_config(None, ["train.tensorboard=false", "train.log_every=1", "train.steps=2", "schedule.warmup_steps=1"])
    logger = MetricsLogger(cfg, str(tmp_path), World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    logger.on_step_end(None, 1, {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "time": 0.0,
                                 "step_time": 0.1, "tokens_per_s": 9_000})
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert "mfu n/a (train.peak_tflops)" in line
