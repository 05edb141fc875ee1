"""Prepare to S3, train from S3 with the run on S3, resume from S3 (real SeaweedFS, real Ray)."""

import json
import os
import shutil
import tempfile

import pytest

from raylm.config import StorageConfig, load_config
from raylm.data import storage
from raylm.data.manifest import DatasetError
from raylm.data.storage import StorageError
from raylm.data.prepare import prepare_dataset
from raylm.launch.driver import launch
from raylm.train.checkpoint import format as checkpoint
from raylm.train.observe.records import read_jsonl
from raylm.train.spec import local_run_dir
from tests.support.fixtures import write_corpus
from tests.support.order import locate

pytestmark = pytest.mark.slow


def s3_config(s3_server, data, runs, *extra):
    return load_config(None, [
        f"data.path={data}", f"run.storage_path={runs}", f"storage.endpoint_url={s3_server.endpoint_url}",
        "data.chunk_rows=8", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0", "optim.lr=1e-2",
        "schedule.warmup_steps=1", "schedule.min_lr=1e-3", "parallel.num_workers=2", "run.max_failures=0",
        "train.tensorboard=false", *extra])


@pytest.fixture(scope="module")
def s3_dataset(ray_session, s3_server, tmp_path_factory):
    corpus = write_corpus(tmp_path_factory.mktemp("s3corpus"), documents=40)
    bucket = "s3://raylm-train-data"
    storage.ensure_bucket(bucket, s3_server.storage)
    for name in storage.list_files(corpus):  # the inputs themselves live on S3 too
        with open(f"{corpus}/{name}", "rb") as f:
            storage.write_bytes(f"{bucket}/text/{name}", f.read(), s3_server.storage)
    prepare_dataset([f"{bucket}/text"], f"{bucket}/prepared", tokenizer="byte", seq_len=32,
                    storage=s3_server.storage, shard_rows=100)
    return f"{bucket}/prepared"


def test_train_from_s3_with_run_on_s3_then_resume(s3_server, s3_bucket, s3_dataset):
    runs = f"{s3_bucket}/runs"
    # A local mirror left by an earlier run at this URI, gone from S3 since: its records were
    # uploaded with this run's.
    mirror = local_run_dir(s3_config(s3_server, s3_dataset, runs, "run.name=r"))
    os.makedirs(mirror, exist_ok=True)
    with open(os.path.join(mirror, "events.jsonl"), "w") as f:
        f.write('{"event": "failure", "time": 1.0, "cause": {"0": "of a run deleted from S3"}}\n')
    launch(s3_config(s3_server, s3_dataset, runs, "run.name=r", "train.steps=6", "checkpoint.every_steps=3",
                     "train.stop_at_step=3"))
    events = f"{runs}/r/events.jsonl"  # none: nothing happened to this run that makes an event
    assert not storage.exists(events, s3_server.storage) or \
        "deleted from S3" not in storage.read_bytes(events, s3_server.storage).decode()
    run = f"{runs}/r"
    assert checkpoint.latest_complete(run, s3_server.storage) == f"{run}/checkpoint_00000003"
    # Resumed where rank 0 has no local mirror of the run's records (another node): its upload
    # replaced the run's metrics on S3 with the steps since the restart.
    shutil.rmtree(local_run_dir(s3_config(s3_server, s3_dataset, runs, "run.name=r")))
    # Resumed with a checkpoint each step, two kept: SeaweedFS lists a deleted checkpoint's empty
    # directories on, and the next prune's delete of it failed the run (at step 6 here).
    launch(s3_config(s3_server, s3_dataset, runs, "run.name=r", "train.steps=6", "checkpoint.every_steps=1",
                     "checkpoint.keep_last=2", "train.tensorboard=true"))
    rows = [json.loads(line) for line in storage.read_bytes(f"{run}/metrics.jsonl", s3_server.storage).splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # TensorBoard's files are in the run on S3 as rank 0 closed them, not only in its node's /tmp.
    board = os.path.join(local_run_dir(s3_config(s3_server, s3_dataset, runs, "run.name=r")), "tensorboard")
    assert os.listdir(board) and storage.list_files(f"{run}/tensorboard", s3_server.storage) == sorted(os.listdir(board))
    for name in os.listdir(board):
        with open(os.path.join(board, name), "rb") as f:
            assert storage.read_bytes(f"{run}/tensorboard/{name}", s3_server.storage) == f.read()
    assert checkpoint.latest_complete(run, s3_server.storage) == f"{run}/checkpoint_00000006"
    assert [n for n in storage.list_dir(run, s3_server.storage) if checkpoint.is_checkpoint_name(n)] == \
        ["checkpoint_00000005", "checkpoint_00000006"]
    saved = storage.read_bytes(f"{run}/config.yaml", s3_server.storage).decode()
    assert s3_server.server.secret_key not in saved and s3_server.server.access_key not in saved


def test_the_drivers_records_reach_s3_when_rank_0_runs_on_another_node(s3_server, s3_bucket, s3_dataset,
                                                                       tmp_path, monkeypatch):
    """The driver writes why a run restarted or ended into its local mirror; only rank 0's is
    uploaded. Here the driver's mirror is not rank 0's, as on a cluster whose rank 0 is on another
    node: the failure that ended the run was missing from S3, and the driver's closing line (the
    last metrics) read its own empty mirror."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "driver-node"))  # the workers keep theirs
    runs = f"{s3_bucket}/runs-{tmp_path.name}"
    # One worker: only rank 0's mirror is uploaded however many there are, and one starts in half the CPU.
    base = ("run.name=apart", "train.steps=8", "checkpoint.every_steps=1", "guard.enabled=false",
            "schedule.name=constant", "schedule.warmup_steps=0", "parallel.num_workers=1")
    assert launch(s3_config(s3_server, s3_dataset, runs, *base, "train.stop_at_step=2"))["step"] == 2
    assert not os.path.exists(os.path.join(local_run_dir(s3_config(s3_server, s3_dataset, runs, *base)),
                                           "metrics.jsonl"))  # rank 0's mirror is elsewhere indeed
    with pytest.raises(Exception, match="is not finite; the weights were not updated"):
        launch(s3_config(s3_server, s3_dataset, runs, *base, "optim.lr=1e38"))  # no run survives it
    events = read_jsonl(f"{runs}/apart/events.jsonl", s3_server.storage)
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == 1 and failures[0]["deterministic"] is True, events
    assert [e["from_step"] for e in events if e["event"] == "resumed"] == [2], events  # rank 0's kept
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)


def test_corrupted_shard_on_s3_is_refused_by_name(s3_server, s3_bucket, tmp_path):
    data = f"{s3_bucket}/prepared"
    corpus = write_corpus(tmp_path / "text", documents=20)
    # A val split for the guard's canary (10% of 20 documents drew none): only the shard is wrong.
    prepare_dataset([corpus], data, tokenizer="byte", seq_len=32, val_fraction=0.3, storage=s3_server.storage,
                    shard_rows=50)
    shard = f"{data}/train-00001.parquet"
    raw = bytearray(storage.read_bytes(shard, s3_server.storage))
    raw[len(raw) // 2] ^= 0xFF
    storage.write_bytes(shard, bytes(raw), s3_server.storage)
    with pytest.raises(DatasetError, match="train-00001.parquet"):
        launch(s3_config(s3_server, data, f"{s3_bucket}/runs", "train.steps=2"))


def test_missing_bucket_is_a_clear_error_naming_the_uri(s3_server, tmp_path):
    with pytest.raises(StorageError, match="s3://no-such-bucket-raylm/data.*bucket 'no-such-bucket-raylm' does not exist"):
        launch(s3_config(s3_server, "s3://no-such-bucket-raylm/data", str(tmp_path), "train.steps=2"))


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_stream_from_s3_covers_the_epoch_once_at_any_world_size(s3_server, s3_dataset, engine):
    from raylm.config import DataConfig
    from raylm.data.stream import Datasets, TokenStream

    data = DataConfig(path=s3_dataset, chunk_rows=8)
    datasets = Datasets.load(data, s3_server.storage)
    source, manifests = datasets.open_split("train", data, s3_server.storage), datasets.manifests
    rows = manifests[0].splits["train"].rows
    steps = rows // 6
    per_size = {}
    for dp_size in (1, 2, 3):
        streams = [list(TokenStream(source, 6, r, dp_size, [], engine).batches(0, 0, steps)) for r in range(dp_size)]
        per_size[dp_size] = [[g for b in step for g in b.indices] for step in zip(*streams)]
    assert per_size[1] == per_size[2] == per_size[3]
    located = [locate(source.order, g) for step in per_size[1] for g in step]
    assert len(located) == len(set(located)) == steps * 6


def test_a_storage_outage_mid_run_is_outlasted_by_a_restart(ray_session, s3_server, tiny_dataset, tmp_path):
    """The S3 server stops for 10 s while the run checkpoints to it, then comes back. A checkpoint
    that cannot reach storage ended the run for good (exit 2, as a full disk does, naming the
    lease); it is a failure a restart can cure: the workers restart from the last checkpoint and
    the run trains to its end, each step once."""
    import threading
    import time

    from cluster.seaweedfs import SeaweedFS
    from raylm.ports import free_ports
    from raylm.train.observe.records import read_jsonl

    # Its own server, with the session's keys (the local Ray's workers have them) and a fixed
    # port and directory, so that the restarted server is the same endpoint with the same objects.
    server = SeaweedFS(data_dir=str(tmp_path / "s3"), s3_port=free_ports(1)[0],
                       access_key=s3_server.server.access_key, secret_key=s3_server.server.secret_key).start()
    # A run that fails during the outage must not leave the server to be started again after the
    # test stopped it (a weed process outlived a failed run of this test).
    test_over = threading.Event()

    def outage() -> None:
        deadline = time.monotonic() + 300
        while not test_over.is_set() and time.monotonic() < deadline and \
                checkpoint.latest_complete(run, storage_cfg) is None:
            time.sleep(0.2)
        if not test_over.is_set():
            server._kill()
            if not test_over.wait(10):
                server.start()

    stopper = threading.Thread(target=outage, daemon=True)
    try:
        endpoint = f"storage.endpoint_url={server.endpoint_url}"
        storage_cfg = StorageConfig(endpoint_url=server.endpoint_url)
        storage.ensure_bucket("s3://outage", storage_cfg)
        run, steps = f"s3://outage/runs/{tmp_path.name}", 150  # a name no other run's local mirror has
        stopper.start()
        metrics = launch(load_config(None, [
            f"data.path={tiny_dataset}", "run.storage_path=s3://outage/runs", f"run.name={tmp_path.name}", endpoint,
            "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0", f"train.steps={steps}",
            "checkpoint.every_steps=5", "parallel.num_workers=1", "run.max_failures=3", "train.tensorboard=false"]))
        stopper.join(timeout=60)
        assert metrics["step"] == steps
        events = read_jsonl(f"{run}/events.jsonl", storage_cfg)
        failures = [e for e in events if e["event"] == "failure"]
        assert failures and not any(e.get("deterministic") for e in failures)
        assert "CheckpointStorageUnreachable" in failures[0]["cause"]["0"], failures[0]
        # A restart while storage is still out fails again before it resumes: at most one resume a failure.
        resumed = [e for e in events if e["event"] == "resumed"]
        assert 1 <= len(resumed) <= len(failures) and {e["world_size"] for e in resumed} == {1}
        assert [r["step"] for r in read_jsonl(f"{run}/metrics.jsonl", storage_cfg)] == list(range(1, steps + 1))
    finally:
        test_over.set()
        if stopper.is_alive():
            stopper.join(timeout=60)
        server.stop()
