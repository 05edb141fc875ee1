"""How often to checkpoint against how often the cluster fails (Young 1974, Daly 2006), and the
goodput that gives: for `raylm plan --failures-per-day` and the drill's projection to OPT's scale.

Model (Daly's first order): the run saves every `interval` seconds of training, each save
stalling it `save_s`; failures come at random, one every `mtbf` seconds on average; each costs a
restart (`restart_s`: detect, reschedule, start, read the checkpoint) and, on average, half an
interval of work trained again. Then

    goodput  = interval / (interval + save_s) * (1 - (restart_s + (interval + save_s) / 2) / mtbf)
    interval = sqrt(2 * save_s * mtbf)      (Young–Daly: the interval that maximises it)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHECKPOINT_BYTES_PER_PARAM = 12
"""What a raylm checkpoint holds per parameter: fp32 weights and AdamW's two fp32 moments (DCP)."""


@dataclass(frozen=True)
class Reliability:
    """A run's failure rate and the costs of a save and a restart, in seconds."""

    failures_per_day: float
    save_s: float
    restart_s: float  # from the failure to training again, the checkpoint read included

    @property
    def mtbf_s(self) -> float:
        return 86400 / self.failures_per_day


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_s * mtbf_s)


def goodput(interval_s: float, r: Reliability) -> float:
    cycle = interval_s + r.save_s
    return interval_s / cycle * max(0.0, 1 - (r.restart_s + cycle / 2) / r.mtbf_s)


@dataclass(frozen=True)
class Projection:
    checkpoint_tb: float
    save_s: float
    restart_s: float
    mtbf_h: float
    interval_min: float
    goodput: float


def project(params: int, nodes: int, gbps_per_node: float, failures_per_day: float,
            restart_overhead_s: float) -> Projection:
    """The best checkpoint interval and its goodput for a model of `params` parameters on `nodes`
    nodes, each writing and reading its share of the checkpoint at `gbps_per_node` GB/s, with
    `restart_overhead_s` to detect a failure and start again before the checkpoint is read."""
    size = params * CHECKPOINT_BYTES_PER_PARAM
    transfer_s = size / (nodes * gbps_per_node * 1e9)
    r = Reliability(failures_per_day, save_s=transfer_s, restart_s=restart_overhead_s + transfer_s)
    interval = young_daly_interval_s(r.save_s, r.mtbf_s)
    return Projection(size / 1e12, r.save_s, r.restart_s, r.mtbf_s / 3600, interval / 60, goodput(interval, r))


def describe(p: Projection, failures_per_day: float, nodes: int, gbps_per_node: float) -> str:
    return (f"# failures: {failures_per_day:g} a day (one every {p.mtbf_h:.1f} h); checkpoint {p.checkpoint_tb:.3f} TB "
            f"(fp32 weights and AdamW moments), written and read in {p.save_s:.0f} s at {gbps_per_node:g} GB/s "
            f"per node × {nodes} nodes; restart {p.restart_s:.0f} s with the read\n"
            f"# checkpoint every {p.interval_min:.0f} min (Young–Daly: sqrt(2 × save × MTBF)): expected goodput "
            f"{p.goodput:.1%} (saves stall training; each failure costs the restart and half an interval)")
