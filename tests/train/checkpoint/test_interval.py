"""Young–Daly with and without replica groups (raylm.train.checkpoint.interval), against figures
computed by hand."""

from __future__ import annotations

import pytest

from raylm.train.checkpoint.interval import (LLAMA3_ABSORBED, Reliability, ReplicaLoss, ReplicaScale, best_interval_s,
                                             goodput, project)


def test_replica_groups_lengthen_the_interval_and_absorb_their_share_of_failures():
    # A failure every 40 h (0.6 a day), 20 s saves, a 2 min restart; 3 failures in 4 absorbed by one of
    # 4 groups, each costing a 10 s stall of all and a 60 s heal of a quarter: 10 + 60 / 4 = 25 s.
    loss = ReplicaLoss(absorbed=0.75, groups=4, stall_s=10.0, heal_s=60.0)
    assert loss.cost_s == 25.0
    alone = Reliability(failures_per_day=0.6, save_s=20.0, restart_s=120.0)
    replica = Reliability(failures_per_day=0.6, save_s=20.0, restart_s=120.0, replica=loss)
    assert alone.mtbf_s == 144000 and replica.restart_mtbf_s == 576000
    # sqrt(2 × 20 × 144,000) = 2,400 s; against the restarts alone, sqrt(2 × 20 × 576,000) = 4,800 s.
    assert best_interval_s(alone) == pytest.approx(2400) and best_interval_s(replica) == pytest.approx(4800)
    # 2400/2420 × (1 - (120 + 2420/2) / 144000)
    assert goodput(2400, alone) == pytest.approx(0.982576, abs=1e-6)
    # 4800/4820 × (1 - (0.25 × (120 + 4820/2) + 0.75 × 25) / 144000) = 4800/4820 × (1 - 651.25/144000)
    assert goodput(4800, replica) == pytest.approx(0.991347, abs=1e-6)
    assert goodput(4800, replica) > max(goodput(2400, replica), goodput(9600, replica))
    # No failure absorbed: the replica term is the restarts' formula.
    none = Reliability(0.6, 20.0, 120.0, ReplicaLoss(absorbed=0.0, groups=4, stall_s=10.0, heal_s=60.0))
    assert goodput(2400, none) == goodput(2400, alone) and best_interval_s(none) == best_interval_s(alone)


def test_some_failures_always_restart_and_a_replica_needs_a_peer():
    with pytest.raises(ValueError, match="absorbed must be in"):
        ReplicaLoss(absorbed=1.0, groups=4, stall_s=1.0, heal_s=1.0)
    with pytest.raises(ValueError, match="at least 2 groups"):
        ReplicaLoss(absorbed=0.5, groups=1, stall_s=1.0, heal_s=1.0)
    # Llama 3 405B's 419 unexpected interruptions: 321 one host's.
    assert LLAMA3_ABSORBED == pytest.approx(0.766, abs=1e-3)


def test_project_prices_a_heal_as_a_start_and_a_peers_transfer():
    # 1e9 parameters: 12 GB of checkpoint over 2 nodes at 1 GB/s each, 6 s; restart 30 + 6 s; a
    # failure every 10,000 s. Replica: 2 groups of 8 GPUs, a 4 s step, the quorum 2 s; the heal a 20 s
    # start and 12 GB over 8 GPUs at 1.5 GB/s each, 1 s. Half the failures absorbed, 6 + 21/2 = 16.5 s each.
    p = project(10**9, nodes=2, gbps_per_node=1.0, failures_per_day=8.64, restart_overhead_s=30.0,
                replica=ReplicaScale(groups=2, gpus_per_group=8, step_s=4.0, heal_overhead_s=20.0, quorum_s=2.0,
                                     absorbed=0.5, peer_gbps_per_gpu=1.5))
    assert (p.checkpoint_tb, p.save_s, p.restart_s, p.mtbf_h) == pytest.approx((0.012, 6.0, 36.0, 10000 / 3600))
    assert p.interval_min == pytest.approx(120000 ** 0.5 / 60)  # sqrt(2 × 6 × 10,000)
    q = p.replica
    assert (q.stall_s, q.heal_s, q.absorbed_cost_s, q.restart_mtbf_h) == pytest.approx((6.0, 21.0, 16.5, 20000 / 3600))
    interval = 240000 ** 0.5  # sqrt(2 × 6 × 20,000) = 489.9 s
    assert q.interval_min == pytest.approx(interval / 60)
    cycle = interval + 6
    assert q.goodput == pytest.approx(interval / cycle * (1 - (0.5 * (36 + cycle / 2) + 0.5 * 16.5) / 10000))
    assert q.goodput == pytest.approx(0.97306, abs=1e-5) and p.goodput == pytest.approx(0.96212, abs=1e-5)
