"""Ray jobs on the local multi-node cluster: a head with its dashboard and job server on
127.0.0.1 and two worker nodes, token authentication on, entry points from jobs/ submitted as
the README shows (`ray job submit` and `raylm submit`) from the repository root.

The session's cluster (tests/support/clusters.py, shared with the other cluster modules) serves
the module, and one dataset that a jobs/prepare.py job makes on it. The
reference run (a `ray job submit` to SUCCEEDED) keeps its checkpoints and metrics on S3
(SeaweedFS), with credentials from the nodes' environment as on a real cluster; it is also what
the stopped-and-resubmitted run, on local storage, is compared with. Runs read with
`data.loader=local`: Ray Data's start-up would dominate these short jobs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest

from cluster.local import LocalCluster
from raylm.config import StorageConfig
from raylm.data import storage as store
from raylm.launch.submit import SubmitError, load_runtime_env, next_submission_id
from raylm.train.checkpoint.format import checkpoint_uris, latest_complete
from raylm.train.observe.records import read_jsonl
from tests.support.clusters import module_on_shared_cluster
from tests.support.fixtures import write_corpus

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
RAYLM = [sys.executable, "-m", "raylm.cli"]
# The stopped run is stopped at its first checkpoint: the 140 steps after it (8 s on 2 cores) leave
# the stop time to land before the run could end: its driver takes about 3 s to abort the workers.
STEPS, CHECKPOINT_EVERY = 150, 10
SAME_WORLD_RTOL = 1e-6  # the same world size repeats the same arithmetic: fp32 noise only


@pytest.fixture(scope="module")
def cluster(s3_server, request, shared_cluster) -> LocalCluster:
    # The session's cluster of the README's shape (tests/support/clusters.py), started after the
    # S3 server: the nodes inherit its AWS_* credentials from the environment, as a real
    # cluster's nodes get theirs from an instance role; no job carries a secret.
    # 2 CPUs a node: the two 1-CPU training workers, on one node or one on each, and the prepare
    # job's Ray Data tasks.
    yield from module_on_shared_cluster(request, shared_cluster)


@pytest.fixture(scope="module")
def jobs(cluster):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(cluster.dashboard_url)


def run(cluster: LocalCluster, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A command from the repository root with the driver environment the cluster script prints."""
    return subprocess.run(list(args), cwd=REPO, env={**os.environ, **cluster.driver_env()},
                          capture_output=True, text=True, timeout=timeout)


def ray_job_submit(cluster: LocalCluster, submission_id: str, *entrypoint: str, wait: bool = True):
    return run(cluster, RAY, "job", "submit", "--address", cluster.dashboard_url, "--runtime-env",
               "jobs/runtime_env.yaml", "--working-dir", ".", "--submission-id", submission_id,
               *(() if wait else ("--no-wait",)), "--", "python", *entrypoint)


def wait_for_status(jobs, job_id: str, timeout_s: float = 300) -> str:
    """The job's terminal status, polled from the job server (the truth; log following may end early)."""
    deadline = time.monotonic() + timeout_s
    while not (status := jobs.get_job_status(job_id)).is_terminal():
        if time.monotonic() > deadline:
            raise AssertionError(f"{job_id} still {status.value} after {timeout_s:.0f} s:\n"
                                 f"{jobs.get_job_logs(job_id)[-3000:]}")
        time.sleep(0.5)
    return status.value


def submit(jobs, job_id: str, *entrypoint: str) -> None:
    """Through the job API, which `ray job submit` calls, with the same runtime env."""
    jobs.submit_job(entrypoint=shlex.join(["python", *entrypoint]), submission_id=job_id,
                    runtime_env=load_runtime_env(REPO))


def one_file_corpus(directory: Path, documents: int) -> Path:
    """One text file, one document per line (for `--lines-as-documents`): one Ray Data read."""
    docs = write_corpus(directory / "docs", documents=documents, seed=3)
    text = directory / "corpus.txt"
    text.write_text("\n".join(" ".join(p.read_text().split()) for p in sorted(Path(docs).iterdir())))
    return text


@pytest.fixture(scope="module")
def dataset(cluster, jobs, tmp_path_factory) -> str:
    """Prepared on the cluster by jobs/prepare.py: its Ray Data pipeline joins the job's Ray."""
    root = tmp_path_factory.mktemp("jobs-data")
    submit(jobs, "raylm-prepare-1", "jobs/prepare.py", "--input", str(one_file_corpus(root, 150)),
           "--output", str(root / "prepared"), "--seq-len", "32", "--lines-as-documents")
    status, logs = wait_for_status(jobs, "raylm-prepare-1"), jobs.get_job_logs("raylm-prepare-1")
    assert status == "SUCCEEDED" and f"wrote {root / 'prepared'}/manifest.json" in logs, logs[-3000:]
    return str(root / "prepared")


def train_args(dataset: str, storage: str, name: str, *extra: str) -> list[str]:
    """The README's demo config, made tiny, with the absolute paths a job needs."""
    return ["configs/demo-cpu.yaml", f"data.path={dataset}", f"run.storage_path={storage}", f"run.name={name}",
            "data.chunk_rows=8", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
            "model.max_seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=4",
            f"train.steps={STEPS}", "train.eval_every=0", "train.tensorboard=false", "train.log_every=5",
            f"checkpoint.every_steps={CHECKPOINT_EVERY}", "schedule.warmup_steps=2", "parallel.num_workers=2",
            "data.loader=local", "run.health_check=false", "run.max_failures=0", *extra]


def rows_by_step(run_uri: str, storage_cfg: Optional[StorageConfig] = None) -> dict[int, dict]:
    rows = read_jsonl(store.join(run_uri, "metrics.jsonl"), storage_cfg)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, STEPS + 1)), f"metrics.jsonl steps: {steps}"
    return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def reference(cluster, jobs, dataset, s3_server) -> dict:
    """`ray job submit ... -- python jobs/pretrain.py CONFIG OVERRIDES`, followed to its end,
    with the run on S3 (and TensorBoard on, for the secret scan)."""
    bucket = f"s3://raylm-jobs-{uuid.uuid4().hex[:8]}"
    store.ensure_bucket(bucket, s3_server.storage)
    out = ray_job_submit(cluster, "raylm-reference-1", "jobs/pretrain.py", *train_args(
        dataset, bucket, "reference", f"storage.endpoint_url={s3_server.endpoint_url}", "train.tensorboard=true"))
    return {"out": out, "status": wait_for_status(jobs, "raylm-reference-1"), "run_uri": f"{bucket}/reference",
            "storage": s3_server.storage}


def test_ray_job_submit_trains_to_the_end_with_metrics_and_checkpoints_in_storage(reference, jobs, s3_server):
    out, run_uri, storage_cfg = reference["out"], reference["run_uri"], reference["storage"]
    assert (reference["status"], out.returncode) == ("SUCCEEDED", 0), out.stdout[-3000:] + out.stderr[-2000:]
    assert f"done: step {STEPS}" in out.stdout  # the driver's last line, followed by `ray job submit`
    rows = rows_by_step(run_uri, storage_cfg)
    assert rows[STEPS]["loss"] < rows[1]["loss"] - 1.0
    assert {store.join(run_uri, f"checkpoint_{s:08d}") for s in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY)
            } <= set(checkpoint_uris(run_uri, storage_cfg))
    assert latest_complete(run_uri, storage_cfg).endswith(f"checkpoint_{STEPS:08d}")
    assert store.exists(store.join(run_uri, "config.yaml"), storage_cfg)
    # The credentials came from the nodes: nothing the job server keeps or shows holds the secret.
    info = jobs.get_job_info("raylm-reference-1")
    shown = json.dumps([info.runtime_env, info.metadata, info.entrypoint]) + jobs.get_job_logs("raylm-reference-1")
    assert s3_server.env["AWS_SECRET_ACCESS_KEY"] not in shown


def test_no_secret_in_anything_the_s3_run_left_behind(reference, cluster, jobs, s3_server):
    """The reference run trained against S3 with keys from the nodes' environment. Neither key
    may appear in anything it left: every object under the run's prefix (config.yaml,
    metrics.jsonl, events.jsonl, checkpoints), its local mirror (metrics, TensorBoard), every
    file of the cluster's Ray temp dirs (session logs, the job's logs and working dir), the job
    as the job server reports it (runtime env, metadata, entrypoint, message, logs), and what
    `ray job submit` printed."""
    assert reference["status"] == "SUCCEEDED", reference["out"].stdout[-3000:]
    keys = {"secret key": s3_server.server.secret_key.encode(), "access key": s3_server.server.access_key.encode()}
    scanned: dict[str, int] = {}  # where -> bytes read
    leaks = []

    def scan(where: str, data: bytes) -> None:
        scanned[where] = len(data)
        leaks.extend((name, where) for name, key in keys.items() if key in data)

    bucket, prefix = reference["run_uri"][len("s3://"):].split("/", 1)
    client = s3_server.server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            scan(f"s3://{bucket}/{obj['Key']}", client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
    mirror = Path(tempfile.gettempdir()) / "raylm-runs" / bucket / prefix  # spec.local_run_dir
    for root in (mirror, Path(cluster.root)):
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                scan(str(path), path.read_bytes())
    info = jobs.get_job_info("raylm-reference-1")
    scan("job info", json.dumps([info.runtime_env, info.metadata, info.entrypoint, info.message]).encode())
    scan("job logs", jobs.get_job_logs("raylm-reference-1").encode())
    scan("ray job submit output", (reference["out"].stdout + reference["out"].stderr).encode())

    assert not leaks, leaks
    # Not vacuous: each kind of record was there to be read.
    names = "\n".join(scanned)
    for expected in ("/reference/config.yaml", "/reference/metrics.jsonl", ".distcp",
                     f"/reference/checkpoint_{STEPS:08d}/.metadata", "rng/rank_00001.pt", f"{mirror}/tensorboard/events.out.tfevents",
                     "job-driver-raylm-reference-1.log", "/logs/raylet.out"):
        assert expected in names, f"nothing scanned matches {expected}"
    assert sum(scanned.values()) > 1_000_000 and len(scanned) > 100, (len(scanned), sum(scanned.values()))


def test_stopped_job_resubmitted_resumes_with_the_losses_of_an_uninterrupted_run(
        cluster, jobs, dataset, reference, tmp_path):
    args = train_args(dataset, str(tmp_path), "stopped")
    run_dir = tmp_path / "stopped"
    first = run(cluster, *RAYLM, "submit", *args, "--no-wait")
    assert first.returncode == 0 and "raylm: submitted raylm-stopped-1" in first.stdout, first.stderr
    # A second job for the same run while the first is active would write the same directory:
    # `raylm submit` refuses it (SubmitError: exit 2, as the unreachable address below shows).
    with pytest.raises(SubmitError, match="run 'stopped' already has job raylm-stopped-1"):
        next_submission_id("stopped", jobs.list_jobs())

    deadline = time.monotonic() + 240
    while latest_complete(str(run_dir)) is None:
        assert jobs.get_job_status("raylm-stopped-1").value in ("PENDING", "RUNNING"), \
            jobs.get_job_logs("raylm-stopped-1")[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(0.1)
    assert jobs.stop_job("raylm-stopped-1")  # what `ray job stop` calls, without its start-up time
    assert wait_for_status(jobs, "raylm-stopped-1") == "STOPPED"
    stopped_at = read_jsonl(str(run_dir / "metrics.jsonl"))[-1]["step"]
    assert stopped_at < STEPS, "the job finished before it was stopped: nothing left to resume"
    # The driver took the stop's SIGTERM as Ctrl-C: its workers were aborted before it exited, so
    # none steps on after the job reads STOPPED, and the logs say where the run stands.
    logs = jobs.get_job_logs("raylm-stopped-1")
    said = rf"raylm: stopped by SIGTERM; the last checkpoint is {re.escape(str(run_dir))}/checkpoint_\d{{8}}: "
    assert re.search(said + "the same command resumes from it", logs), logs[-3000:]
    time.sleep(2)
    assert read_jsonl(str(run_dir / "metrics.jsonl"))[-1]["step"] == stopped_at

    # The same submission again: the next attempt's id, the same run directory.
    resumed = run(cluster, *RAYLM, "submit", *args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert "raylm: submitted raylm-stopped-2" in resumed.stdout
    assert "raylm: job raylm-stopped-2 SUCCEEDED" in resumed.stdout
    assert f"done: step {STEPS}" in resumed.stdout  # the job's logs were followed to the end
    (event,) = [e for e in read_jsonl(str(run_dir / "events.jsonl")) if e["event"] == "resumed"]
    assert event["from_step"] % CHECKPOINT_EVERY == 0 and CHECKPOINT_EVERY <= event["from_step"] <= stopped_at
    rows, expected = rows_by_step(str(run_dir)), rows_by_step(reference["run_uri"], reference["storage"])
    mismatched = [(s, rows[s]["loss"], expected[s]["loss"]) for s in rows
                  if rows[s]["loss"] != pytest.approx(expected[s]["loss"], rel=SAME_WORLD_RTOL)]
    assert not mismatched, f"(step, resumed, uninterrupted): {mismatched[:5]}"


def test_a_job_no_node_can_hold_says_so_and_a_stop_ends_it_with_its_line(cluster, jobs, dataset, tmp_path):
    """3 CPUs a worker on nodes of 2 (a user trial): the job waited without a word, and `ray job
    stop` killed its driver 30 s later (Ray Train's abort waited on a controller blocked in its
    attempts to start the workers), with no line of raylm's and the run's lease left behind."""
    run_dir = tmp_path / "unplaceable"
    submit(jobs, "raylm-unplaceable-1", "jobs/pretrain.py",
           *train_args(dataset, str(tmp_path), "unplaceable", "parallel.cpus_per_worker=3"))
    deadline = time.monotonic() + 180
    while "no node of this Ray cluster can hold one worker now: each needs 3 CPUs" not in \
            (logs := jobs.get_job_logs("raylm-unplaceable-1")):
        assert time.monotonic() < deadline and jobs.get_job_status("raylm-unplaceable-1").value in (
            "PENDING", "RUNNING"), logs[-3000:]
        time.sleep(0.5)
    # The run's console is kept from the moment its trainer is made, just before it trains (on a
    # busy machine that came after the warning by more than any fixed wait).
    deadline = time.monotonic() + 120
    while not (run_dir / "console.log").exists():
        assert time.monotonic() < deadline, jobs.get_job_logs("raylm-unplaceable-1")[-3000:]
        time.sleep(0.2)
    time.sleep(3)  # the controller in its first attempt to start the workers
    assert jobs.stop_job("raylm-unplaceable-1")
    assert wait_for_status(jobs, "raylm-unplaceable-1") == "STOPPED"
    logs = jobs.get_job_logs("raylm-unplaceable-1")
    assert f"raylm: stopped by SIGTERM before a checkpoint of {run_dir}: the same command starts it again" in logs, \
        logs[-3000:]
    assert not (run_dir / "run.lease").exists()


def test_bad_input_fails_the_job_before_any_worker_starts_with_the_message_in_its_logs(
        cluster, jobs, dataset, tmp_path):
    """All submitted at once (their start-ups overlap); the logs read as `ray job logs` reads them."""
    storage, missing = tmp_path / "runs", tmp_path / "missing"
    storage.mkdir()
    pretrain = ["jobs/pretrain.py", "configs/demo-cpu.yaml", f"data.path={dataset}"]
    failing = {  # submission id: (entry point and arguments, what the job's logs must say)
        "raylm-unknown-key-1": ([*pretrain, f"run.storage_path={storage}", "train.stepz=5"],
                                "raylm: error: unknown key train.stepz"),
        "raylm-no-dataset-1": ([*pretrain, f"run.storage_path={storage}", f"data.path={missing}"],
                               f"raylm: error: {missing} is not a prepared dataset"),
        "raylm-relative-1": (pretrain,  # the demo config's run.storage_path: runs
                             "raylm: error: run.storage_path='runs' is a relative path"),
        "raylm-prepare-missing-1": (["jobs/prepare.py", "--input", str(missing), "--output", str(storage / "data")],
                                    f"raylm: error: input {missing} does not exist"),
    }
    for job_id, (entrypoint, _) in failing.items():
        submit(jobs, job_id, *entrypoint)
    for job_id, (_, message) in failing.items():
        assert wait_for_status(jobs, job_id, timeout_s=180) == "FAILED"
        logs = jobs.get_job_logs(job_id)
        assert message in logs, f"{job_id}: {jobs.get_job_info(job_id).message}\n{logs[-3000:]}"
        # Failed on the driver: no traceback, no Ray Train workers, no Ray Data pipeline.
        assert not [w for w in ("Traceback", "training worker group", "Running Dataset") if w in logs], logs[-3000:]
    assert os.listdir(storage) == []  # no run directory, no dataset: nothing started


def test_raylm_submit_exits_with_the_status_of_a_job_that_failed_on_bad_input(cluster, jobs, tmp_path):
    """A user trial: the job's driver exited 2 (a missing dataset) and `raylm submit` exited 1, so
    a script could not tell bad input from a failure worth resubmitting."""
    missing = tmp_path / "missing"
    out = run(cluster, *RAYLM, "submit", *train_args(str(missing), str(tmp_path), "no-data"))
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-2000:]
    assert f"raylm: error: {missing} is not a prepared dataset" in out.stdout, out.stdout[-3000:]
    assert "raylm: error: job raylm-no-data-1 FAILED" in out.stderr, out.stderr
    assert jobs.get_job_info("raylm-no-data-1").driver_exit_code == 2


def test_raylm_submit_refuses_bad_input_before_submitting(cluster, jobs, dataset, tmp_path):
    unreachable = run(cluster, *RAYLM, "submit", *train_args(dataset, str(tmp_path), "nowhere"),
                      "--address", "http://127.0.0.1:9")
    assert unreachable.returncode == 2
    assert "raylm: error: cannot reach the Ray job server at http://127.0.0.1:9" in unreachable.stderr
    unknown = run(cluster, *RAYLM, "submit", *train_args(dataset, str(tmp_path), "misspelt", "optim.lrr=1"))
    assert unknown.returncode == 2 and "raylm: error: unknown key optim.lrr" in unknown.stderr, unknown.stderr
    assert "Traceback" not in unreachable.stderr + unknown.stderr
    submitted = [j.submission_id or "" for j in jobs.list_jobs()]
    assert not [i for i in submitted if i.startswith(("raylm-nowhere-", "raylm-misspelt-"))]
