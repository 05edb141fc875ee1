"""parallel.fault_tolerance=replica: its config, and a run on a real local Ray with a real torchft
lighthouse whose replica group loses its worker mid-run (raylm.train.replica, raylm.launch.replicas)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Iterator

import pytest

from cluster.chaos import TrainDriver
from cluster.local import process_tree
from raylm.config import ConfigError, load_config
from raylm.report import write_report
from raylm.train.hooks import Hook
from raylm.train.observe.records import read_jsonl
from raylm.train.replica import RENDEZVOUS_TIMEOUT, GroupLedger, quick_rendezvous_gloo, should_commit
from raylm.train.spec import check_config
from tests.support.order import assert_every_sample_once
from tests.support.sockets import listeners

REPLICAS = ["parallel.fault_tolerance=replica", "parallel.num_workers=2", "parallel.dp_replicate=2"]


def test_fault_tolerance_is_checkpoint_by_default_and_an_unknown_value_names_the_field():
    assert load_config(None, []).parallel.fault_tolerance == "checkpoint"
    with pytest.raises(ConfigError, match=r"parallel\.fault_tolerance: 'replicas' is not one of 'checkpoint' \| 'replica'"):
        load_config(None, ["parallel.fault_tolerance=replicas"])
    check_config(load_config(None, REPLICAS))  # each group one rank: the layout resolves


@pytest.mark.parametrize("extra, refused", [
    (["parallel.dp_replicate=1"], r"dp_replicate = parallel\.num_workers >= 2"),
    (["parallel.num_workers=4"], r"dp_replicate = parallel\.num_workers >= 2"),
    (["parallel.tp=2"], r"parallel\.tp must be 1"),
    (["parallel.min_workers=1"], r"does not support parallel\.min_workers"),
    (["checkpoint.async_save=true"], r"does not support checkpoint\.async_save"),
    (["train.trackers=[mlflow]"], r"does not support train\.trackers"),
    (["parallel.replica_timeout_s=0"], r"replica_timeout_s must be positive"),
])
def test_a_replica_layout_ray_train_cannot_run_is_refused_naming_the_field(extra, refused):
    with pytest.raises(ConfigError, match=refused):
        load_config(None, [*REPLICAS, *extra])


def test_a_quorum_member_dead_before_its_rendezvous_costs_the_rendezvous_timeout_not_the_collectives():
    """Real gloo process groups over a real store: at a new quorum's rendezvous a member that never
    comes (it asked for the quorum and died) is waited for the rendezvous timeout, not the
    collectives'; a peer late to a collective is still waited for, past the rendezvous timeout."""
    import torch
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    alone = quick_rendezvous_gloo(timedelta(seconds=30), timedelta(seconds=1))
    started = time.monotonic()
    with pytest.raises(Exception, match="timeout"):
        alone.configure(f"127.0.0.1:{store.port}/torchft/1/0", "lost", 0, 2)
    assert time.monotonic() - started < 10

    pair = [quick_rendezvous_gloo(timedelta(seconds=30), timedelta(seconds=1)) for _ in range(2)]
    sums = {}

    def member(rank: int) -> None:
        pair[rank].configure(f"127.0.0.1:{store.port}/torchft/2/0", f"g{rank}", rank, 2)
        time.sleep(3 * rank)  # rank 1 comes to the all-reduce 3 s after rank 0
        tensor = torch.ones(1)
        pair[rank].allreduce([tensor], torch.distributed.ReduceOp.SUM).wait()
        sums[rank] = tensor.item()

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sums == {0: 2.0, 1: 2.0}


def test_a_group_that_gives_up_a_step_on_an_error_frees_the_peers_waiting_for_it_in_the_collective():
    """Three torchft groups on a real lighthouse and real gloo groups: group 0's step fails before
    its all-reduce (as when it lost a peer), so the others wait in theirs for its part. Dropping its
    process group as it gives the step up ends their wait at once, not after the collectives'
    timeout; the next quorum is a new one, and every group commits on new process groups."""
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft._torchft import LighthouseServer

    collectives = timedelta(seconds=15)
    # Every quorum of all three: each step is the same step in every group.
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=3, join_timeout_ms=20_000)
    steps: dict[int, list] = {}

    def group(g: int) -> None:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        pg = quick_rendezvous_gloo(collectives, RENDEZVOUS_TIMEOUT)
        manager = Manager(pg=pg, min_replica_size=3, load_state_dict=lambda _: None, state_dict=dict,
                          replica_id=f"g{g}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                          use_async_quorum=False, lighthouse_addr=lighthouse.address(), hostname="127.0.0.1",
                          timeout=collectives, quorum_timeout=2 * collectives, init_sync=False)
        try:
            for step in range(4):
                started = time.monotonic()
                manager.start_quorum()
                if g == 0 and step == 1:
                    manager.report_error(RuntimeError("lost a peer"))  # its all-reduce is not made
                manager.allreduce(torch.ones(100_000)).wait()
                committed = should_commit(manager, pg)
                steps.setdefault(g, []).append((committed, manager._quorum_id, time.monotonic() - started))
        finally:
            manager.shutdown()

    threads = [threading.Thread(target=group, args=(g,)) for g in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        lighthouse.shutdown()
    assert sorted(steps) == [0, 1, 2]
    for g, taken in steps.items():
        assert [committed for committed, _, _ in taken] == [True, False, True, True], (g, taken)
        assert taken[2][1] != taken[1][1], (g, taken)  # a new quorum after the failed commit
        assert taken[1][2] < 5 and taken[2][2] < 5, (g, taken)  # not the collectives' 15 s


def test_the_ledger_counts_a_group_lost_and_healed_even_when_no_step_went_on_without_it():
    """A group missing from a committed step is lost, and healed when it is back; a group replaced
    and healed before the others committed a step without it (they waited for it at the quorum) was
    lost and healed at the step it came back in."""
    ledger = GroupLedger(last_commit_time=0.0)
    assert ledger.commit(1, 1.0, [0, 1, 2], [], 0) == []
    assert ledger.commit(2, 4.0, [0, 2], [], 1) == [
        {"event": "replica_lost", "group": 1, "step": 2, "seconds": 3.0, "retried": 1}]
    assert ledger.commit(3, 5.0, [0, 2], [], 0) == []
    assert ledger.commit(4, 11.0, [0, 1, 2], [1], 0) == [  # back, healed: lost once, not again
        {"event": "replica_healed", "group": 1, "step": 4, "seconds": 10.0}]
    assert ledger.commit(5, 43.0, [0, 1, 2], [1, 2], 1) == [
        {"event": "replica_lost", "group": 1, "step": 5, "seconds": 32.0, "retried": 1},
        {"event": "replica_lost", "group": 2, "step": 5, "seconds": 32.0, "retried": 1},
        {"event": "replica_healed", "group": 1, "step": 5, "seconds": 32.0},
        {"event": "replica_healed", "group": 2, "step": 5, "seconds": 32.0}]
    assert ledger.members == [0, 1, 2] and ledger.lost == {} and ledger.last_commit_time == 43.0
    # A replacement's first commit, from a peer's ledger: nothing before it to have lost.
    assert GroupLedger().commit(6, 44.0, [0, 1], [1], 0) == []


def test_a_whole_job_restart_of_replica_groups_resumes_the_exact_order_from_the_checkpoint(tiny_dataset, tmp_path,
                                                                                           capsys):
    """Without Ray: one replica group of two (its peer never came) on a real torchft lighthouse,
    in this process, stopped at step 6 and started again, as a whole-job restart does: it reads the
    checkpoint, torchft's step is the checkpoint's, and the steps go on at the data position saved."""
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    from raylm.train.env import LocalEnv
    from raylm.train.replica import ReplicaPlace, ReplicaTrainer
    from raylm.train.spec import resolve_run
    from tests.train.test_loop import tiny_config

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    place = ReplicaPlace(group=0, groups=2, joining=False, lighthouse=lighthouse.address(),
                         store=f"127.0.0.1:{store.port}", host="127.0.0.1", timeout_s=10)
    run_dir = str(tmp_path / "run")
    try:
        for stop in (6, 10):
            cfg = tiny_config(tiny_dataset, *REPLICAS, "train.steps=10", f"train.stop_at_step={stop}",
                              "checkpoint.every_steps=3", "train.eval_every=0", "train.audit_samples=true")
            ReplicaTrainer(resolve_run(cfg), LocalEnv(run_dir), (), place).train()
    finally:
        lighthouse.shutdown()
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    assert_every_sample_once(rows, global_batch=4)  # one group of two: half the global batch a step
    assert {r["replicas"] for r in rows.values()} == {1}
    (resumed,) = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == "resumed"]
    assert resumed["from_step"] == 6 and resumed["steps_lost"] == 0
    # Not "on 1 worker(s)", the group's own world, which the first resumes in replica mode said.
    assert "raylm: resumed at step 6 on 2 replica groups of 1 worker;" in capsys.readouterr().out



def test_an_operators_config_change_is_recorded_once_by_the_groups_of_a_restart(tiny_dataset, tmp_path):
    """Without Ray: a run's checkpoint, then a whole-job restart of both groups with a changed
    config. Each group reads the checkpoint as rank 0 of its own world; each recorded the change
    (a `config_changed` event per group); the first group records it for the run."""
    import dataclasses

    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    from raylm.train.env import LocalEnv
    from raylm.train.replica import ReplicaPlace, ReplicaTrainer
    from raylm.train.spec import resolve_run
    from tests.train.test_loop import tiny_config

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    first = ReplicaPlace(group=0, groups=2, joining=False, lighthouse=lighthouse.address(),
                         store=f"127.0.0.1:{stores[0].port}", host="127.0.0.1", timeout_s=10)
    run_dir = str(tmp_path / "run")
    base = (tiny_dataset, *REPLICAS, "train.steps=10", "checkpoint.every_steps=3", "train.eval_every=0")
    try:
        ReplicaTrainer(resolve_run(tiny_config(*base, "train.stop_at_step=3")), LocalEnv(run_dir), (), first).train()
        restarted = resolve_run(tiny_config(*base, "train.audit_samples=true"))
        for place in (first, dataclasses.replace(first, group=1, store=f"127.0.0.1:{stores[1].port}")):
            ReplicaTrainer(restarted, LocalEnv(run_dir), (), place).manager.shutdown(wait=False)
    finally:
        lighthouse.shutdown()
    changed = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == "config_changed"]
    assert [(e["step"], e["changes"]) for e in changed] == [(3, {"train.audit_samples": [False, True]})], changed


def test_the_rows_read_ahead_are_the_rows_of_the_step(tiny_dataset, tmp_path):
    """A split read by row groups (data.shard_cache_mb=0, as a split larger than the cache is)
    has each step's rows read during the step before; trained on them, a replica group's losses
    are those of the same run with the split held in memory, which reads them when asked."""
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    from raylm.train.env import LocalEnv
    from raylm.train.replica import ReplicaPlace, ReplicaTrainer
    from raylm.train.spec import resolve_run
    from tests.train.test_loop import tiny_config

    hits = []

    class Counted(ReplicaTrainer):
        def _rows(self, step, indices, *rest):
            hits.append(self.ahead is not None and self.ahead[0][:2] == (step, tuple(indices)))
            return super()._rows(step, indices, *rest)

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    losses = {}
    try:
        for cache_mb in (0, 1024):
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            place = ReplicaPlace(group=0, groups=2, joining=False, lighthouse=lighthouse.address(),
                                 store=f"127.0.0.1:{store.port}", host="127.0.0.1", timeout_s=10)
            cfg = tiny_config(tiny_dataset, *REPLICAS, "train.steps=8", "train.eval_every=0",
                              f"data.shard_cache_mb={cache_mb}", f"run.name=cache{cache_mb}")
            run_dir = str(tmp_path / f"cache{cache_mb}")
            Counted(resolve_run(cfg), LocalEnv(run_dir), (), place).train()
            losses[cache_mb] = [r["loss"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    finally:
        lighthouse.shutdown()
    assert hits[:8] == [False] + [True] * 7 and not any(hits[8:]), hits  # the first step has no step before it
    assert len(losses[0]) == 8 and losses[0] == losses[1024]


def test_a_replacement_group_with_no_peer_left_resumes_from_the_checkpoint_instead_of_step_0(tiny_dataset, tmp_path):
    """Without Ray: group 0 trains to step 6 (a checkpoint at 6) and is gone; group 1, started as a
    replacement into the running quorum, finds no peer to heal from. It resumes from the checkpoint,
    as a whole-job restart would, and trains steps 7-10; started again once the run is finished, it
    trains nothing. (The quick replica drill met it: the survivor finished the run while the
    replacement started, which then trained the run again from step 0 over its records.)"""
    import dataclasses

    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    from raylm.train.env import LocalEnv
    from raylm.train.replica import ReplicaPlace, ReplicaTrainer
    from raylm.train.spec import resolve_run
    from tests.train.test_loop import tiny_config

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    first = ReplicaPlace(group=0, groups=2, joining=False, lighthouse=lighthouse.address(),
                         store=f"127.0.0.1:{stores[0].port}", host="127.0.0.1", timeout_s=10)
    replacement = dataclasses.replace(first, group=1, joining=True, store=f"127.0.0.1:{stores[1].port}")
    run_dir = str(tmp_path / "run")
    try:
        for place, stop in ((first, 6), (replacement, 10), (replacement, 10)):
            cfg = tiny_config(tiny_dataset, *REPLICAS, "train.steps=10", f"train.stop_at_step={stop}",
                              "checkpoint.every_steps=3", "train.eval_every=0", "train.audit_samples=true")
            ReplicaTrainer(resolve_run(cfg), LocalEnv(run_dir), (), place).train()
    finally:
        lighthouse.shutdown()
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert_every_sample_once({r["step"]: r for r in rows}, global_batch=4)
    (resumed,) = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == "resumed"]
    assert resumed["from_step"] == 6 and resumed["steps_lost"] == 0


@contextlib.contextmanager
def _finished(groups: list, lighthouse) -> Iterator[None]:
    """Replica groups in their own processes, started in the block: each must end with exit 0;
    whatever happens, none outlives it, nor the lighthouse."""
    try:
        yield
        for process in groups:
            process.join(timeout=300)
            assert process.exitcode == 0, process.exitcode
    finally:
        for process in groups:
            if process.is_alive():
                process.kill()
        lighthouse.shutdown()


class _WaitForPeer(Hook):
    """Group 0, at the start of `step`: says so, and holds until the joining group (started then)
    is up (its manager heartbeating), which joins at the next step's quorum."""

    def __init__(self, step: int, signals: str):
        self.step, self.signals = step, signals

    def on_step_begin(self, run, step):
        if step == self.step:
            open(os.path.join(self.signals, "waiting"), "w").close()
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(self.signals, "joined")):
                assert time.time() < deadline, "the joining group did not start"
                time.sleep(0.05)


def _replica_group(group: int, lighthouse: str, dataset: str, run_dir: str, signals: str) -> None:
    """One replica group of two in its own process: group 0 from the start, group 1 joining the
    running quorum (healing from group 0). Both damage their weights alike at step 28; each saves
    its weights and run state at the end."""
    import torch
    import torch.distributed as dist

    from raylm.train.env import LocalEnv
    from raylm.train.replica import ReplicaPlace, ReplicaTrainer
    from raylm.train.spec import resolve_run
    from tests.train.resilience.test_guard import GUARD, Nudge
    from tests.train.test_loop import tiny_config

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    place = ReplicaPlace(group=group, groups=2, joining=group == 1, lighthouse=lighthouse,
                         store=f"127.0.0.1:{store.port}", host="127.0.0.1", timeout_s=60)
    cfg = tiny_config(dataset, *REPLICAS, *GUARD, "train.steps=40", "train.audit_samples=true", "guard.window=10",
                      "schedule.name=constant", "schedule.warmup_steps=0", "train.peak_tflops=1")
    hooks = (Nudge(28, 0.2), *([_WaitForPeer(25, signals)] if group == 0 else []))
    trainer = ReplicaTrainer(resolve_run(cfg), LocalEnv(run_dir), hooks, place)
    if group == 1:
        open(os.path.join(signals, "joined"), "w").close()
    trainer.train()
    torch.save({"model": trainer.model.model.state_dict(), "state": dict(vars(trainer.state))},
               os.path.join(signals, f"group{group}.pt"))


@pytest.mark.slow
def test_a_group_that_healed_rolls_back_with_its_peer_to_the_same_snapshot(tiny_dataset, tmp_path):
    """Without Ray: two replica groups in their own processes on a real torchft lighthouse. Group 1
    joins at step 26 and heals from group 0, whose guard took its snapshot at the check of step 20;
    at step 28 both groups' weights are damaged alike, and the guard rolls back. Both groups must
    go back to step 20, group 0's snapshot, which came with the heal (group 1 used to take its own
    at the heal, step 26, and the groups went on from different steps), and judge on the same rows
    (each used to evaluate only its share of the recent batches): the two end with the same
    weights and run state, and the run's record trained every sample once."""
    import multiprocessing

    import torch
    from torchft.coordination import LighthouseServer

    # A group that heartbeats is waited for at each quorum, up to the join timeout: long enough
    # for group 1 to ask for its first quorum once its manager runs.
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=30000)
    run_dir, signals = str(tmp_path / "run"), str(tmp_path)
    spawn = multiprocessing.get_context("spawn")
    groups = [spawn.Process(target=_replica_group, args=(g, lighthouse.address(), tiny_dataset, run_dir, signals))
              for g in (0, 1)]
    with _finished(groups, lighthouse):
        groups[0].start()
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(signals, "waiting")):  # group 0 at step 25, its snapshot of step 20
            assert time.time() < deadline and groups[0].is_alive(), "group 0 did not reach step 25"
            time.sleep(0.05)
        groups[1].start()
    (rollback,) = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == "rollback"]
    assert rollback["step"] == 28 and rollback["to_step"] == 20, rollback
    written = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    first = {}
    for row in written:  # the first pass over steps 21-28: the one rolled back
        first.setdefault(row["step"], row)
    assert first[26]["replicas"] == 1 and first[27]["replicas"] == 2  # group 1 joined after 26 steps
    # tokens/s counts the whole quorum's batch: MFU divides by the devices of the groups in the step
    # (one group of one worker read 105% in a run of 2 groups on 2 cores).
    per_device = {round(r["mfu"] * r["replicas"] / r["tokens_per_s"], 15) for r in written}
    assert len(per_device) == 1, per_device
    rows = {r["step"]: r for r in written}  # after the rollback, the steps taken again
    assert_every_sample_once(rows)
    ends = [torch.load(os.path.join(signals, f"group{g}.pt")) for g in (0, 1)]
    # The guard's history is written into the state for a checkpoint (group 0's final one) or a heal.
    history = {"losses", "norms", "healthy_losses", "canary_reference"}
    decided = [{**end["state"], "guard": {k: v for k, v in end["state"]["guard"].items() if k not in history}}
               for end in ends]
    assert decided[0] == decided[1] and decided[0]["step"] == 40 and decided[0]["rollbacks"] == [28]
    assert ends[0]["model"].keys() == ends[1]["model"].keys()
    assert all(torch.equal(ends[0]["model"][k], ends[1]["model"][k]) for k in ends[0]["model"]), \
        "the groups' weights differ"


def _saving_group(group: int, lighthouse: str, dataset: str, run_dir: str, signals: str) -> None:
    """One of 3 replica groups in its own process; the quorum's first group (0) takes 3 s to save
    its checkpoint of step 4, as a large model's synchronous save does."""
    import torch.distributed as dist

    from raylm.train.env import LocalEnv
    from raylm.train.replica import ReplicaPlace, ReplicaTrainer
    from raylm.train.spec import resolve_run

    class SlowSave(ReplicaTrainer):
        def _save(self, metrics):
            if self.world.rank == 0 and self.state.step == 4:
                time.sleep(3)
            super()._save(metrics)

    cfg = _three_groups(dataset)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    place = ReplicaPlace(group=group, groups=3, joining=False, lighthouse=lighthouse, store=f"127.0.0.1:{store.port}",
                         host="127.0.0.1", timeout_s=cfg.parallel.replica_timeout_s)
    trainer = SlowSave(resolve_run(cfg), LocalEnv(run_dir), (), place)
    open(os.path.join(signals, f"ready{group}"), "w").close()
    while not all(os.path.exists(os.path.join(signals, f"ready{g}")) for g in range(3)):
        time.sleep(0.05)  # every manager heartbeating: the first quorum waits for all three
    trainer.train()


def _three_groups(dataset: str):
    from tests.train.test_loop import tiny_config

    return tiny_config(dataset, "parallel.fault_tolerance=replica", "parallel.num_workers=3",
                       "parallel.dp_replicate=3", "train.global_batch_size=12", "train.steps=8",
                       "checkpoint.every_steps=4", "train.eval_every=0", "train.audit_samples=true")


@pytest.mark.slow
def test_the_groups_wait_for_the_checkpoint_save_of_the_first_instead_of_leaving_it_out(tiny_dataset, tmp_path):
    """Without Ray: 3 replica groups in their own processes on a real torchft lighthouse set up as
    the launcher sets it up. The quorum's first group saves the checkpoints, alone, while the others
    go to the next quorum. With the lighthouse's 1 s join timeout they went on without it at every
    save longer than that (3 groups on a 51M model: saves of 2.5-3.7 s, `replica_lost` at each,
    2-3 steps at 2 of 3 groups, a heal of the whole state): now they wait for it, as every rank waits
    for a synchronous save without replica groups."""
    import multiprocessing

    from torchft.coordination import LighthouseServer

    from raylm.launch.driver import _backend_config

    launch = _backend_config(_three_groups(tiny_dataset))
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=launch.join_timeout_ms,
                                  heartbeat_timeout_ms=launch.heartbeat_timeout_ms)
    run_dir, signals = str(tmp_path / "run"), str(tmp_path)
    spawn = multiprocessing.get_context("spawn")
    groups = [spawn.Process(target=_saving_group, args=(g, lighthouse.address(), tiny_dataset, run_dir, signals))
              for g in range(3)]
    with _finished(groups, lighthouse):
        for process in groups:
            process.start()
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    assert sorted(rows) == list(range(1, 9))
    assert rows[5]["time"] - rows[4]["time"] >= 3  # step 5, over all three, came after the save
    assert {r["replicas"] for r in rows.values()} == {3}, {s: r["replicas"] for s, r in rows.items()}
    events = [e["event"] for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))]
    assert "replica_lost" not in events and "replica_healed" not in events, events
    assert_every_sample_once(rows, global_batch=12)


def _replica_run(ray_session, tiny_dataset: str, tmp_path, groups: int, *extra: str) -> TrainDriver:
    """`groups` replica groups of one CPU worker on the session's Ray, training until stopped, a
    checkpoint every 10 steps."""
    # Ray folds alike lines of several workers into one: every group names its process.
    address = SimpleNamespace(address=ray_session.get_runtime_context().gcs_address,
                              driver_env=lambda: {"RAY_DEDUP_LOGS": "0"})
    return TrainDriver(address, tmp_path / "replicas", [
        f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", "run.name=replicas", "data.chunk_rows=8",
        "data.loader=local", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32",
        f"train.global_batch_size={4 * groups}", "train.micro_batch_size=4", "train.steps=100000",
        "train.eval_every=0", "train.audit_samples=true", "train.tensorboard=false", "schedule.warmup_steps=2",
        "checkpoint.every_steps=10", "run.max_failures=3", f"parallel.num_workers={groups}",
        f"parallel.dp_replicate={groups}", "parallel.fault_tolerance=replica", "parallel.cpus_per_worker=1", *extra])


def _lighthouses(ray_session) -> list[int]:
    """The torchft lighthouse actors' processes on the session's Ray (ray::Lighthouse.*)."""
    raylet = ray_session._private.worker._global_node.all_processes["raylet"][0].process.pid
    found = []
    for pid in process_tree(raylet):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::Lighthouse"):
                    found.append(pid)
        except OSError:
            continue
    return found


def _group_processes(log: str) -> dict[int, list[int]]:
    """Each replica group's worker processes, in the order they started (the driver's console)."""
    found: dict[int, list[int]] = {}
    for group, pid in re.findall(r"raylm: replica group (\d+) of \d+ in process (\d+)", log):
        found.setdefault(int(group), []).append(int(pid))
    return found


@pytest.mark.slow
def test_a_killed_replica_group_costs_one_step_and_heals_from_a_peer(ray_session, tiny_dataset, tmp_path):
    """3 replica groups of one CPU worker on the session's Ray: group 1's worker is SIGKILLed mid-run.
    The other groups finish the step without it and train on (no worker of theirs restarts); Ray
    Train starts group 1 alone, and it heals from a live peer, reading no checkpoint. Every step's
    samples are the next of the planned order, each trained once; the run is stopped (SIGTERM)
    once the groups have trained at full quorum again."""
    groups = 3
    driver = _replica_run(ray_session, tiny_dataset, tmp_path, groups)
    try:
        driver.wait_for("the groups trained 12 steps", lambda: driver.last_step() >= 12, timeout_s=120)
        started = _group_processes(driver.log.read_text(errors="replace"))
        assert sorted(started) == list(range(groups)) and all(len(p) == 1 for p in started.values()), started
        # torchft's lighthouse and managers, the groups' stores and gloo: on loopback (their default is every interface).
        servers = listeners([*(p for pids in started.values() for p in pids), *_lighthouses(ray_session)])
        assert servers and all(s.loopback for s in servers), servers
        assert any(s.process.startswith("ray::Lighthouse") for s in servers), servers
        os.kill(started[1][0], signal.SIGKILL)
        killed = time.time()
        driver.wait_for("group 1 healed", lambda: driver.events("replica_healed"), timeout_s=120)
        healed_at = driver.events("replica_healed")[0]["step"]
        driver.wait_for("3 steps at full quorum", lambda: driver.last_step() >= healed_at + 3, timeout_s=60)
        driver.proc.send_signal(signal.SIGTERM)
        assert driver.proc.wait(timeout=60) == 128 + signal.SIGTERM, driver.tail()
    finally:
        driver.stop()
    log = driver.log.read_text(errors="replace")
    after = _group_processes(log)
    assert after[0] == started[0] and after[2] == started[2], after  # the healthy groups' workers went on
    assert len(after[1]) == 2 and "joins the running quorum" in log, after
    (transfer,) = re.findall(r"raylm: replica group 1 healed from a peer after step \d+ \(the quorum and the transfer: "
                             r"([\d.]+) s\)", log)
    (lost,) = driver.events("replica_lost")
    (healed,) = driver.events("replica_healed")
    (failure,) = driver.events("failure")
    assert lost["group"] == healed["group"] == 1 and failure["replica_groups"] == [1] and failure["restart_from"] is None
    assert lost["retried"] <= 1  # steps trained again: the one in flight, at most
    assert not driver.events("resumed")  # no checkpoint was read
    rows = {r["step"]: r for r in driver.metrics()}
    assert_every_sample_once(rows)
    assert {rows[s]["replicas"] for s in range(lost["step"], healed["step"])} == {groups - 1}
    assert rows[healed["step"]]["replicas"] == groups and rows[lost["step"] - 1]["replicas"] == groups
    assert rows[lost["step"]]["global_batch"] == 4 * (groups - 1)
    # The wait for the quorum after the given-up step is replica_s's: it was data_wait's too, which
    # the report takes from the step's time (a goodput below 0 once the wait was 2 s).
    assert all(r["data_wait"] <= r["step_time"] for r in rows.values())
    summary = write_report([str(driver.run_dir)], str(tmp_path / "report"))["runs"]["replicas"]
    assert summary["replica groups lost"] == summary["replica groups healed"] == 1 and summary["restarts"] == 0
    assert 0 < summary["time lost to replica losses (s)"] and 0 < summary["goodput"] < 1
    print(f"next step {lost['time'] - killed:.1f} s after the kill ({lost['seconds']:.1f} s since the last); "
          f"healed {healed['seconds']:.1f} s after the last step with group 1 (quorum and transfer {transfer} s)")


@pytest.mark.slow
def test_a_lost_lighthouse_restarts_every_group_from_the_checkpoint_on_a_new_one(ray_session, tiny_dataset, tmp_path):
    """torchft's lighthouse actor SIGKILLed mid-run (2 replica groups on the session's Ray): every
    group loses its quorum, and the run goes on from the checkpoint, on a new lighthouse (each start
    asks for the lighthouse's address anew, not the dead actor's). When one poll finds both groups
    failed, Ray Train restarts them together from the checkpoint; when it finds one (its quorum timed out first),
    that one is replaced alone, finds no live peer on the new lighthouse and resumes from the
    checkpoint, and the other heals from it once its own quorum times out."""
    driver = _replica_run(ray_session, tiny_dataset, tmp_path, 2, "parallel.replica_timeout_s=10")
    try:
        driver.wait_for("the groups trained 12 steps", lambda: driver.last_step() >= 12, timeout_s=120)
        (lighthouse,) = _lighthouses(ray_session)
        os.kill(lighthouse, signal.SIGKILL)
        driver.wait_for("the run resumed", lambda: driver.events("resumed"), timeout_s=180)
        resumed_from = driver.events("resumed")[0]["from_step"]
        driver.wait_for("5 steps after the resume", lambda: driver.last_step() >= resumed_from + 5, timeout_s=120)
        assert [p for p in _lighthouses(ray_session) if p != lighthouse], "no new lighthouse"
        driver.proc.send_signal(signal.SIGTERM)
        assert driver.proc.wait(timeout=60) == 128 + signal.SIGTERM, driver.tail()
    finally:
        driver.stop()
    log = driver.log.read_text(errors="replace")
    assert "the torchft lighthouse was lost" in log
    failure = driver.events("failure")[0]
    alone = "found no live peer to heal from: resumes from the newest checkpoint" in log
    assert (failure["restart_from"] is not None) != alone and resumed_from >= 10, failure
    assert_every_sample_once({r["step"]: r for r in driver.metrics()})


@pytest.mark.slow
@pytest.mark.parametrize("second_lost", ["with_the_first", "while_the_first_is_replaced"])
def test_two_groups_lost_at_once_heal_while_the_third_trains_on(ray_session, tiny_dataset, tmp_path, second_lost):
    """Groups 1 and 2 of 3 lost together, as a node that held both is lost (the README's nodes of 2
    CPUs hold 2 groups of 1). Ray Train 2.60 replaces failing groups one at a time, and a
    replacement first clears the result queues of the groups it takes for live: a dead one failed
    the run (`ControllerError`). Both SIGKILLed at once, Ray's poll finds both failed; group 2
    silent first (SIGSTOP, a node cut off) and dead only once the controller is replacing group 1,
    its poll still says running, and the clear meets it dead (what a loaded machine's late poll did
    to the first case). Either way group 0 trains on alone and both heal from it, no checkpoint
    read, every sample once."""
    groups = 3
    driver = _replica_run(ray_session, tiny_dataset, tmp_path, groups)
    try:
        driver.wait_for("the groups trained 12 steps", lambda: driver.last_step() >= 12, timeout_s=120)
        started = _group_processes(driver.log.read_text(errors="replace"))
        if second_lost == "with_the_first":
            for group in (1, 2):
                os.kill(started[group][0], signal.SIGKILL)
        else:
            os.kill(started[2][0], signal.SIGSTOP)
            os.kill(started[1][0], signal.SIGKILL)
            driver.wait_for("the controller replacing group 1 alone",
                            lambda: "raylm: replica group(s) [1] failed" in driver.log.read_text(errors="replace"),
                            timeout_s=60)
            time.sleep(2)  # the replacement's clear of group 2's queue waits on the stopped process
            os.kill(started[2][0], signal.SIGKILL)
        driver.wait_for("groups 1 and 2 healed", lambda: len(driver.events("replica_healed")) == 2, timeout_s=180)
        healed_at = max(e["step"] for e in driver.events("replica_healed"))
        driver.wait_for("3 steps at full quorum", lambda: driver.last_step() >= healed_at + 3, timeout_s=60)
        driver.proc.send_signal(signal.SIGTERM)
        assert driver.proc.wait(timeout=60) == 128 + signal.SIGTERM, driver.tail()
    finally:
        driver.stop()
    log = driver.log.read_text(errors="replace")
    after = _group_processes(log)
    assert after[0] == started[0] and len(after[1]) == len(after[2]) == 2, after  # group 0's worker went on
    if second_lost == "while_the_first_is_replaced":  # (both at once can take this path too, when a poll is late)
        assert "raylm: replica group(s) [2] died while group 1 was being replaced" in log
    lost = driver.events("replica_lost")
    assert sorted(e["group"] for e in lost) == sorted(e["group"] for e in driver.events("replica_healed")) == [1, 2]
    assert not driver.events("resumed")  # no checkpoint was read
    rows = {r["step"]: r for r in driver.metrics()}
    assert_every_sample_once(rows)
    assert rows[max(rows)]["replicas"] == groups
    # Group 0 trains on alone until the replacements are back, unless the quorum after the kills
    # held a dead group (it had asked for the quorum before it died): group 0 then waits out the
    # process group's rendezvous for it, by when both replacements can be back.
    waited = RENDEZVOUS_TIMEOUT.total_seconds()
    assert min(r["replicas"] for r in rows.values()) == 1 or min(e["seconds"] for e in lost) >= waited, lost
