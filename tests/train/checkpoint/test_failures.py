"""The failure projection beside a plan (raylm.train.checkpoint.failures): the replica groups the
recommended layout splits into, and `raylm plan --failures-per-day` printing both modes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from raylm.config import ModelConfig
from raylm.config.presets import preset
from raylm.model.sizes import count_params
from raylm.train.checkpoint.failures import project_failures, replica_split
from raylm.parallel.planner.plan import Hardware, evaluate_layout, plan
from raylm.train.checkpoint.interval import LLAMA3_ABSORBED, QUORUM_S, ReplicaScale, project
from tests.support.cli import run_main

OPT_175B = ModelConfig(**preset("175b"), vocab_size=50272)
GB = 1e9


def test_opt_175b_on_1024_gpus_splits_into_the_most_replica_groups_that_hold_a_copy_each():
    tokens = 1024 * 2048
    best = plan(OPT_175B, 1024, 8, 80 * GB)[0]
    assert (best.layout.dp_replicate, best.layout.dp_shard, best.layout.tp) == (1, 128, 8)
    split = replica_split(OPT_175B, best, 8, 80 * GB, 2048, tokens, "mixed", 1)
    assert (split.layout.dp_replicate, split.layout.dp_shard, split.layout.tp) == (4, 32, 8)
    # 8 groups of 16 shards hold a copy each in more than the 72 GB a GPU has to give (80 GB less 10%).
    eight = evaluate_layout(OPT_175B, replace(best.layout, dp_replicate=8, dp_shard=16), "mixed", 2048, 1, 1024, 8,
                            72 * GB, Hardware(), True)
    assert not eight.feasible and eight.memory.total > 72 * GB and split.memory.total <= 72 * GB

    p, row = project_failures(OPT_175B, 1024, 8, 80 * GB, failures_per_day=0.6, restart_overhead_s=60.0,
                              storage_gbps_per_node=1.0)
    assert row.layout == split.layout
    assert p == project(count_params(OPT_175B), 128, 1.0, 0.6, 60.0,
                        ReplicaScale(4, 256, split.step_s, heal_overhead_s=60.0))
    q = p.replica
    assert q.absorbed == LLAMA3_ABSORBED and q.stall_s == pytest.approx(split.step_s + QUORUM_S)
    assert q.interval_min > p.interval_min and q.goodput > p.goodput


def test_plan_prints_the_projection_with_restarts_and_with_replica_groups():
    p, _ = project_failures(OPT_175B, 1024, 8, 80 * GB, failures_per_day=0.6, restart_overhead_s=60.0,
                            storage_gbps_per_node=1.0)
    outcome = run_main("plan", "--model", "175b", "--gpus", "1024", "--failures-per-day", "0.6")
    assert outcome.status == 0
    assert f"checkpoint every {p.interval_min:.0f} min (Young–Daly" in outcome.stdout
    assert "4 replica groups of 256 GPUs" in outcome.stdout
    assert (f"replica: checkpoint every {p.replica.interval_min:.0f} min (Young–Daly against the restarts' MTBF): "
            f"expected goodput {p.replica.goodput:.1%} (checkpoint alone: {p.goodput:.1%})") in outcome.stdout
    # One GPU has no data-parallel ranks to split: said, not left out.
    outcome = run_main("plan", "--model", "125m", "--gpus", "1", "--failures-per-day", "1")
    assert outcome.status == 0 and "no split of the recommended layout's data-parallel ranks" in outcome.stdout
