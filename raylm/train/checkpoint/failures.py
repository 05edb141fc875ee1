"""The failure projection beside a plan: the Young–Daly checkpoint interval and the expected
goodput of the recommended layout with restarts alone, and with its data-parallel ranks as torchft
replica groups (`parallel.fault_tolerance: replica`). The formula is
`raylm.train.checkpoint.interval`'s; this module finds what it needs at the plan's scale: the
replica groups and the step they would give up.

The replica groups: the recommended layout's data-parallel ranks split into as many groups as
still fit (dp_replicate groups, each sharding its own copy of the model state over dp_shard ranks,
as torchft's HSDP does; each group's tp and pp as recommended). More groups make a lost one cheaper
(1/groups of the machine while it heals); each group must hold a whole copy, so the per-GPU memory
bounds them. The step time is the planner's proxy for that split.

raylm itself runs replica groups of one worker each today (Ray Train 2.60's replica groups): the
projection is what the same recovery gives at a cluster's scale.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from raylm.config import ModelConfig
from raylm.model.sizes import count_params
from raylm.parallel.planner.plan import Hardware, PlanRow, divisors, evaluate_layout, plan
from raylm.train.checkpoint.interval import QUORUM_S, Projection, ReplicaScale, project


def replica_split(model_cfg: ModelConfig, best: PlanRow, gpus_per_node: int, gpu_memory_bytes: float,
                  seq_len: int, global_batch_tokens: int, precision: str, micro_batch_size: int,
                  headroom: float = 0.10, hardware: Hardware = Hardware()) -> Optional[PlanRow]:
    """`best` with its data-parallel ranks as the most replica groups (at least 2) that fit, or None."""
    dp = best.layout.dp_replicate * best.layout.dp_shard
    for groups in sorted((g for g in divisors(dp) if g >= 2), reverse=True):
        layout = replace(best.layout, dp_replicate=groups, dp_shard=dp // groups)
        row = evaluate_layout(model_cfg, layout, precision, seq_len, micro_batch_size, global_batch_tokens // seq_len,
                              gpus_per_node, gpu_memory_bytes * (1 - headroom), hardware, True)
        if row.feasible:
            return row
    return None


def project_failures(model_cfg: ModelConfig, gpus: int, gpus_per_node: int, gpu_memory_bytes: float,
                     failures_per_day: float, restart_overhead_s: float, storage_gbps_per_node: float,
                     seq_len: Optional[int] = None, global_batch_tokens: Optional[int] = None,
                     precision: str = "mixed", micro_batch_size: int = 1, activation_checkpointing: str = "none",
                     heal_overhead_s: Optional[float] = None, quorum_s: float = QUORUM_S,
                     ) -> tuple[Projection, Optional[PlanRow]]:
    """The projection of the plan's recommended layout, with its replica split where one fits (and
    that split's row). A lost group starts again in `heal_overhead_s` (default: the restart's
    `restart_overhead_s`, without the checkpoint read) and the others wait `quorum_s` and a step."""
    seq_len = seq_len or model_cfg.max_seq_len
    tokens = global_batch_tokens or gpus * micro_batch_size * seq_len
    rows = plan(model_cfg, gpus, gpus_per_node, gpu_memory_bytes, seq_len, tokens, precision, micro_batch_size,
                activation_checkpointing)
    split = None
    if rows and rows[0].feasible:
        split = replica_split(model_cfg, rows[0], gpus_per_node, gpu_memory_bytes, seq_len, tokens, precision,
                              micro_batch_size)
    scale = None
    if split is not None:
        groups = split.layout.dp_replicate
        scale = ReplicaScale(groups, gpus // groups, split.step_s,
                             restart_overhead_s if heal_overhead_s is None else heal_overhead_s, quorum_s)
    nodes = -(-gpus // gpus_per_node)
    return project(count_params(model_cfg), nodes, storage_gbps_per_node, failures_per_day, restart_overhead_s,
                   scale), split
