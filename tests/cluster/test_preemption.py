"""A spot reclaim on the README's cluster shape (`scripts/local-cluster start --nodes 2
--cpus-per-node 2`): the demo config's two 1-CPU workers, which Ray packs on one node, get that
node's preemption notice as a cloud gives it, a drain with a deadline (`ray drain-node
--reason=DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds`, how Ray's own tests simulate
one), and the node is killed at the deadline.

The run must save at the step boundary where it sees the notice, before the deadline, record
it, restart from that checkpoint on the other node without counting a failure (run.max_failures=0:
one failure would end it), train every step exactly once, and `raylm report` must show it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.chaos import TrainDriver, train_workers
from cluster.local import LocalCluster
from raylm.report import write_report
from raylm.train.checkpoint import format as checkpoint
from tests.support.clusters import module_on_shared_cluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 200
DEADLINE_S = 30


@pytest.fixture(scope="module")
def cluster(tiny_dataset_without_ray, request, shared_cluster) -> LocalCluster:
    # The session's cluster of the README's shape (tests/support/clusters.py), whole: the node
    # this module's test drains and kills is started again for whoever uses the cluster next.
    yield from module_on_shared_cluster(request, shared_cluster)


def test_a_preempted_node_costs_no_step(cluster, tiny_dataset_without_ray, tmp_path, monkeypatch):
    # The watcher asks the GCS for drained nodes every 5 s by default: seconds of a short test.
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
    args = [str(REPO / "configs/demo-cpu.yaml"), f"data.path={tiny_dataset_without_ray}",
            f"run.storage_path={tmp_path}", "run.name=run", "data.chunk_rows=8", "model.d_model=64",
            "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32", f"train.steps={STEPS}", "train.eval_every=0",
            "train.tensorboard=false",
            # Only the preemption's save and the last: the restart can resume from nothing else.
            f"checkpoint.every_steps={STEPS}", "schedule.warmup_steps=2", "run.max_failures=0",
            "run.health_check=false"]
    driver = TrainDriver(cluster, tmp_path / "run", args)
    try:
        driver.wait_for("step 5", lambda: driver.last_step() >= 5, timeout_s=300)
        placed = {node: len(train_workers(cluster, node)) for node in (1, 2)}
        assert sorted(placed.values()) == [0, 2], placed  # Ray packed both workers on one node
        busy = 1 if placed[1] else 2
        notice_at = driver.last_step()
        node_id = cluster.drain_node(busy, DEADLINE_S)
        deadline = time.time() + DEADLINE_S
        driver.wait_for("the preempted event", lambda: driver.events("preempted"), timeout_s=DEADLINE_S)
        time.sleep(max(0.0, deadline - time.time()))
        cluster.kill_node(busy)  # the cloud takes the node at the deadline
        driver.finish(timeout_s=300)
    finally:
        driver.stop()

    (preempted,) = driver.events("preempted")
    (resumed,) = driver.events("resumed")
    print(f"notice at step {notice_at}: {preempted}; {resumed}")
    assert preempted["nodes"] == [node_id] and sorted(preempted["ranks"]) == [0, 1]
    assert abs(preempted["deadline"] - deadline) < 5
    saved = preempted["step"]
    assert preempted["saved"] and notice_at <= saved < STEPS
    assert preempted["time"] < deadline, "the checkpoint was not saved before the node went"
    assert preempted["restart_from"].rstrip("/").endswith(checkpoint.dir_name(saved))
    assert resumed["from_step"] == saved and resumed["steps_lost"] == 0 and resumed["world_size"] == 2
    assert not driver.events("failure"), "the preemption was counted as a failure"
    steps = [row["step"] for row in driver.metrics()]
    assert steps == list(range(1, STEPS + 1)), "a step was lost or trained twice"
    assert "raylm: worker failure" not in driver.log.read_text(errors="replace")

    written = write_report([str(driver.run_dir)], str(tmp_path / "report"))
    summary = written["runs"]["run"]
    assert summary["preemptions"] == 1 and summary["failures"] == 0 and summary["restarts"] == 1
    assert summary["time lost to failures (s)"] > 0  # the restart's gap, which is a preemption's too
    page = (tmp_path / "report" / "report.html").read_text()
    assert "preempted" in page and node_id in page
