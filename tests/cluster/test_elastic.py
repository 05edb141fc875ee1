"""Elastic runs on the README's cluster shape: `scripts/local-cluster start --nodes 2
--cpus-per-node 2` (a head with 0 CPUs, two 2-CPU nodes), the demo config with
`parallel.min_workers=1`, two 1-CPU workers reading through Ray Data.

Found by trying it as a new user would: a node lost while Ray had packed both workers on it,
Ray Train restarted both on the other node, whose 2 CPUs then left none for the Ray Data reader
actors (0.25 CPU each): the run made no step for 13 minutes. Here the run is driven, as `ray job
submit` would start it, for each placement of the two workers before the node loss:

- both on the node that is lost: both restart on the other node, filling it;
- both on the node that survives: the lost node held nothing of the run, which goes on.

Each time the run must keep making steps and finish, with what happened in events.jsonl. One
worker on each node (2 CPUs per worker, so each fills a node), which shrinks to one worker when
its node is lost and grows back when it returns, is tests/cluster/test_chaos.py's, on the same
cluster shape, with the losses and samples checked; a node starting on a machine loaded past its
cores, tests/cluster/test_local_cluster.py's.

Each case starts its run just after bringing back the node the previous case lost. Ray's
autoscaling coordinator, which sizes an elastic start, re-reads the nodes only every 20 s: a run
whose workers need both nodes began with one worker until `raylm train` asked it to re-read at
launch (test_chaos.py's lost-node test starts so).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.chaos import TrainDriver, train_workers
from cluster.local import LocalCluster
from tests.support.clusters import module_on_shared_cluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_EVERY = 60, 10


@pytest.fixture(scope="module")
def cluster(tiny_dataset_without_ray, request, shared_cluster) -> LocalCluster:
    # The session's cluster of the README's shape (tests/support/clusters.py), whole.
    yield from module_on_shared_cluster(request, shared_cluster)


def demo_args(dataset: str, storage: Path, name: str, *extra: str) -> list[str]:
    """The README's demo config on the tiny dataset, made small, elastic down to one worker."""
    return [str(REPO / "configs/demo-cpu.yaml"), f"data.path={dataset}", f"run.storage_path={storage}",
            f"run.name={name}", "data.chunk_rows=8", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
            "model.max_seq_len=32", f"train.steps={STEPS}", "train.eval_every=0", "train.tensorboard=false",
            f"checkpoint.every_steps={CHECKPOINT_EVERY}", "schedule.warmup_steps=2", "parallel.min_workers=1",
            "parallel.resize_check_s=2", "run.max_failures=3", "run.health_check=false", *extra]


def workers_per_node(cluster: LocalCluster) -> dict[int, int]:
    return {node: len(train_workers(cluster, node)) for node in (1, 2)}


@pytest.mark.parametrize("placement", ["both_on_lost_node", "both_on_surviving_node"])
def test_a_lost_node_leaves_the_run_making_steps(cluster, tiny_dataset_without_ray, tmp_path, placement):
    for node in (1, 2):  # the previous case lost a node: bring it back
        if not cluster.processes(node):
            cluster.start_node(node)
    driver = TrainDriver(cluster, tmp_path / "run", demo_args(tiny_dataset_without_ray, tmp_path, "run"))
    try:
        driver.wait_for("the first checkpoint", lambda: driver.last_step() > CHECKPOINT_EVERY, timeout_s=300)
        placed = workers_per_node(cluster)
        assert sorted(placed.values()) == [0, 2], placed  # Ray packed both on one node
        busy = 1 if placed[1] else 2
        lost = busy if placement == "both_on_lost_node" else 3 - busy
        survivor = 3 - lost
        lost_at = driver.last_step()
        cluster.kill_node(lost)
        driver.finish(timeout_s=300)  # a run that stops making steps never gets here
    finally:
        driver.stop()

    steps = [row["step"] for row in driver.metrics()]
    assert lost_at < STEPS and steps[-1] == STEPS, "the run finished before the node was lost"
    failures, resumed = driver.events("failure"), driver.events("resumed")
    print(f"{placement}: lost node {lost} at step {lost_at}; failures {[f['cause'] for f in failures]}; "
          f"resumed {resumed}")
    if placement == "both_on_surviving_node":
        assert not failures and not resumed, "losing a node that ran nothing of the run restarted it"
        assert sorted(set(steps)) == list(range(1, STEPS + 1))
        return
    assert failures, "the node loss was not recorded as a failure"
    (restart,) = resumed
    assert restart["world_size"] == 2  # both workers back, on the surviving node's 2 CPUs
    assert restart["from_step"] <= lost_at < STEPS
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    assert [s for s in steps if s > restart["from_step"]], "no step after the restart"
    assert survivor in cluster.alive_nodes()



# Ray Train renews a run's request to the autoscaling coordinator every 20 s, and the coordinator
# keeps it 180 s after the last renewal: a run killed with its driver holds its workers' resources
# for at least 160 s after the kill unless it is released.
DEAD_RUN_HOLDS_S = 180 - 20


def test_the_command_of_a_killed_elastic_run_resumes_it_without_waiting_for_the_dead_runs_reservation(
        cluster, tiny_dataset_without_ray, tmp_path):
    """A driver SIGKILLed (its head-node process lost) while its two workers fill the cluster, then
    the same command: the dead run's request to Ray's autoscaling coordinator, which reserves the
    whole cluster until it expires, is released, and the run resumes on both nodes at once."""
    for node in (1, 2):
        if not cluster.processes(node):
            cluster.start_node(node)
    args = demo_args(tiny_dataset_without_ray, tmp_path, "run", "parallel.cpus_per_worker=2")  # both nodes whole
    killed = TrainDriver(cluster, tmp_path / "run", args)
    try:
        killed.wait_for("the first checkpoint", lambda: killed.last_step() > CHECKPOINT_EVERY, timeout_s=300)
    finally:
        killed.stop()
    killed_at = time.time()
    again = TrainDriver(cluster, tmp_path / "run", args)
    try:
        again.finish(timeout_s=300)
    finally:
        again.stop()
    (resumed,) = again.events("resumed")
    assert resumed["from_step"] >= CHECKPOINT_EVERY and resumed["world_size"] == 2
    # After the resume: the killed driver's workers may have written a row or two as they died.
    first_step = min(row["time"] for row in again.metrics() if row["time"] > resumed["time"])
    assert first_step - killed_at < DEAD_RUN_HOLDS_S, \
        f"the run waited {first_step - killed_at:.0f} s after the kill for the dead run's reservation"
    assert sorted({row["step"] for row in again.metrics()}) == list(range(1, STEPS + 1))
