"""How often to checkpoint against how often the cluster fails (Young 1974, Daly 2006), and the
goodput that gives, with restarts alone or with torchft replica groups absorbing most failures:
for `raylm plan --failures-per-day` and the drill's projection to OPT's scale.

Model (Daly's first order): the run saves every `interval` seconds of training, each save
stalling it `save_s`; failures come at random, one every `mtbf` seconds on average.

With restarts alone (`parallel.fault_tolerance: checkpoint`) each failure costs a restart
(`restart_s`: detect, reschedule, start, read the checkpoint) and, on average, half an interval of
work trained again. With replica groups (`parallel.fault_tolerance: replica`) a share `absorbed`
of the failures (one host's GPU, memory or other part: a replica group lost) costs the whole
machine only the step in flight and the quorum without the lost group (`stall_s`), and the lost
group's share 1/groups of the machine while it starts again and heals from a peer (`heal_s`);
only the rest, whole-job failures, restart from the checkpoint. With f = absorbed (0 without
replica groups), a = stall_s + heal_s / groups:

    goodput  = interval / (interval + save_s)
               * (1 - ((1 - f) * (restart_s + (interval + save_s) / 2) + f * a) / mtbf)
    interval = sqrt(2 * save_s * mtbf / (1 - f))   (Young–Daly against the restarts' MTBF)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

CHECKPOINT_BYTES_PER_PARAM = 12
"""What a raylm checkpoint holds per parameter: fp32 weights and AdamW's two fp32 moments (DCP).
A group healing from a peer receives the same state."""

LLAMA3_ABSORBED = 321 / 419
"""The share of failures a replica group absorbs, from Llama 3 405B's 419 unexpected interruptions
in 54 days on 16,384 H100s (Dubey et al. 2024, table 5): 321 were one host's (its GPUs, their
HBM3, SRAM, system processor, thermal parts and silent corruption; its NIC, SSD, power supply,
chassis, IO board, CPU, memory; its unplanned maintenance); the software bugs, network switches
and cables, NCCL watchdog timeouts and dependencies (98) are counted as whole-job failures."""

QUORUM_S = 2.0
"""Seconds the other groups wait before the lighthouse forms a quorum without a lost group: its
heartbeat timeout (`raylm.launch.replicas.ReplicaTorchConfig.heartbeat_timeout_ms`)."""


@dataclass(frozen=True)
class ReplicaLoss:
    """What a failure that a replica group absorbs costs (parallel.fault_tolerance=replica)."""

    absorbed: float  # the share of failures that take out one replica group alone, in [0, 1)
    groups: int
    stall_s: float  # every group: the step in flight given up and the quorum formed without the lost one
    heal_s: float  # the lost group: from the failure to training again, healed from a live peer

    def __post_init__(self) -> None:
        if not 0 <= self.absorbed < 1:  # the driver, the lighthouse, every group at once: some always restart
            raise ValueError(f"absorbed must be in [0, 1), got {self.absorbed}")
        if self.groups < 2:
            raise ValueError(f"replica groups need at least 2 groups, got {self.groups}")

    @property
    def cost_s(self) -> float:
        """Seconds of the whole machine one absorbed failure costs."""
        return self.stall_s + self.heal_s / self.groups


@dataclass(frozen=True)
class Reliability:
    """A run's failure rate and the costs of a save and a restart, in seconds; with `replica`,
    the failures its replica groups absorb and what each costs."""

    failures_per_day: float
    save_s: float
    restart_s: float  # from the failure to training again, the checkpoint read included
    replica: Optional[ReplicaLoss] = None

    @property
    def mtbf_s(self) -> float:
        return 86400 / self.failures_per_day

    @property
    def absorbed(self) -> float:
        return self.replica.absorbed if self.replica else 0.0

    @property
    def restart_mtbf_s(self) -> float:
        """The mean time between the failures that restart the job from its checkpoint."""
        return self.mtbf_s / (1 - self.absorbed)


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_s * mtbf_s)


def best_interval_s(r: Reliability) -> float:
    """Young–Daly against the failures that restart: those a replica group absorbs read no checkpoint."""
    return young_daly_interval_s(r.save_s, r.restart_mtbf_s)


def goodput(interval_s: float, r: Reliability) -> float:
    cycle = interval_s + r.save_s
    f = r.absorbed
    lost = (1 - f) * (r.restart_s + cycle / 2) + (f * r.replica.cost_s if r.replica else 0.0)
    return interval_s / cycle * max(0.0, 1 - lost / r.mtbf_s)


@dataclass(frozen=True)
class ReplicaScale:
    """Replica groups at a projection's scale: `groups` of `gpus_per_group` GPUs, a training step of
    `step_s`; the lost group starts again in `heal_overhead_s` (the restart without the checkpoint
    read) and receives a peer's state, each of its GPUs its share at `peer_gbps_per_gpu` GB/s."""

    groups: int
    gpus_per_group: int
    step_s: float
    heal_overhead_s: float
    quorum_s: float = QUORUM_S
    absorbed: float = LLAMA3_ABSORBED
    peer_gbps_per_gpu: float = 25.0  # an HDR 200 Gb/s NIC per GPU, the planner's inter-node rate


@dataclass(frozen=True)
class ReplicaProjection:
    groups: int
    gpus_per_group: int
    absorbed: float
    stall_s: float  # the step given up and the quorum
    heal_s: float  # the start and the peer's transfer
    absorbed_cost_s: float  # whole-machine seconds per absorbed failure
    restart_mtbf_h: float  # between the whole-job failures, which restart
    interval_min: float
    goodput: float


@dataclass(frozen=True)
class Projection:
    checkpoint_tb: float
    save_s: float
    restart_s: float
    mtbf_h: float
    interval_min: float
    goodput: float
    replica: Optional[ReplicaProjection] = None  # the same run with replica groups, when asked


def project(params: int, nodes: int, gbps_per_node: float, failures_per_day: float,
            restart_overhead_s: float, replica: Optional[ReplicaScale] = None) -> Projection:
    """The best checkpoint interval and its goodput for a model of `params` parameters on `nodes`
    nodes, each writing and reading its share of the checkpoint at `gbps_per_node` GB/s, with
    `restart_overhead_s` to detect a failure and start again before the checkpoint is read; and,
    given `replica`, the same with those replica groups absorbing their share of the failures."""
    size = params * CHECKPOINT_BYTES_PER_PARAM
    transfer_s = size / (nodes * gbps_per_node * 1e9)
    r = Reliability(failures_per_day, save_s=transfer_s, restart_s=restart_overhead_s + transfer_s)
    interval = best_interval_s(r)
    with_replicas = None
    if replica is not None:
        loss = ReplicaLoss(replica.absorbed, replica.groups, stall_s=replica.step_s + replica.quorum_s,
                           heal_s=replica.heal_overhead_s + size / (replica.gpus_per_group * replica.peer_gbps_per_gpu * 1e9))
        rr = Reliability(failures_per_day, r.save_s, r.restart_s, loss)
        best = best_interval_s(rr)
        with_replicas = ReplicaProjection(replica.groups, replica.gpus_per_group, loss.absorbed, loss.stall_s,
                                          loss.heal_s, loss.cost_s, rr.restart_mtbf_s / 3600, best / 60,
                                          goodput(best, rr))
    return Projection(size / 1e12, r.save_s, r.restart_s, r.mtbf_s / 3600, interval / 60, goodput(interval, r),
                      with_replicas)


def describe(p: Projection, failures_per_day: float, nodes: int, gbps_per_node: float) -> str:
    lines = [f"# failures: {failures_per_day:g} a day (one every {p.mtbf_h:.1f} h); checkpoint {p.checkpoint_tb:.3f} TB "
             f"(fp32 weights and AdamW moments), written and read in {p.save_s:.0f} s at {gbps_per_node:g} GB/s "
             f"per node × {nodes} nodes; restart {p.restart_s:.0f} s with the read",
             f"# checkpoint every {p.interval_min:.0f} min (Young–Daly: sqrt(2 × save × MTBF)): expected goodput "
             f"{p.goodput:.1%} (saves stall training; each failure costs the restart and half an interval)"]
    if p.replica is not None:
        q = p.replica
        lines += [
            f"# with parallel.fault_tolerance=replica, {q.groups} replica groups of {q.gpus_per_group} GPUs: "
            f"{q.absorbed:.0%} of failures (one host's) cost a step and a heal, {q.absorbed_cost_s:.0f} s of the "
            f"whole machine each (the step given up and the quorum {q.stall_s:.0f} s, the group's start and "
            f"peer transfer {q.heal_s:.0f} s at 1/{q.groups} of it); the rest restart, one every {q.restart_mtbf_h:.1f} h",
            f"# replica: checkpoint every {q.interval_min:.0f} min (Young–Daly against the restarts' MTBF): "
            f"expected goodput {q.goodput:.1%} (checkpoint alone: {p.goodput:.1%})"]
    return "\n".join(lines)
