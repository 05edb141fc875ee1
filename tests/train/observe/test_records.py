"""The run's JSON-lines records survive a line cut short by a kill or a full disk: readers drop it
and say so, appends start a line of their own, an append a full disk refuses leaves the file as it
was and is written once there is space, and a run whose metrics.jsonl ends torn resumes."""

from __future__ import annotations

import json
import os

import pytest

from cluster.chaos import fill_filesystem
from raylm.train.loop import train_local
from raylm.train.observe.records import (append_event, append_line, read_jsonl, read_records, rewrite_records,
                                         write_unwritten)
from tests.support.filesystems import tmpfs
from tests.train.test_loop import tiny_config


def test_a_torn_last_line_and_a_garbled_one_are_dropped_by_name(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n{"step": 2}\nnot json at all\n{"step": 3}\n{"step": 4, "lo')
    rows, dropped = read_records(str(path))
    assert rows == [{"step": 1}, {"step": 2}, {"step": 3}]
    assert [d.split(": ", 1)[0] for d in dropped] == [f"{path} line 2", f"{path} line 4", f"{path} line 6"]
    assert "torn" in dropped[-1]
    assert read_jsonl(str(tmp_path / "absent.jsonl")) == []


def test_an_append_after_a_torn_line_starts_a_line_of_its_own(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n{"event": "tor')
    append_event(str(path), {"event": "b"})
    append_event(str(path), {"event": "c"})
    rows, dropped = read_records(str(path))
    assert [r["event"] for r in rows] == ["a", "b", "c"] and len(dropped) == 1


def test_a_rewrite_replaces_the_file_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    rewrite_records(str(path), [{"step": 1}, {"step": 2}])
    assert read_records(str(path)) == ([{"step": 1}, {"step": 2}], [])
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


def test_a_run_whose_metrics_end_torn_resumes_and_records_the_dropped_line(tiny_dataset, tmp_path):
    common = ("train.steps=6", "checkpoint.every_steps=3", "train.eval_every=0")
    run = str(tmp_path / "run")
    train_local(tiny_config(tiny_dataset, *common, "train.stop_at_step=3"), run)
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as f:  # a kill mid-write of step 4's row
        f.write('{"step": 4, "loss": 2.')
    final = train_local(tiny_config(tiny_dataset, *common), run)
    assert final["step"] == 6
    assert [r["step"] for r in read_jsonl(str(metrics))] == [1, 2, 3, 4, 5, 6]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    (dropped,) = [e for e in events if e["event"] == "record_dropped"]
    assert "metrics.jsonl line 4: torn" in dropped["line"]


@pytest.fixture
def full_filesystem(tmp_path):
    yield from tmpfs(tmp_path, "256k")


def test_an_append_a_full_disk_refuses_leaves_no_part_line_and_is_written_once_there_is_space(full_filesystem):
    """The quick drill's events.jsonl held the part of an event that a full disk had let through,
    in the middle of the file, the whole event on the next line: jq and pandas stop at such a
    line. The disk here is a real one, full to its last byte; what a record's last block still
    holds is all an append can take, and a row longer than that is cut there."""
    before = {}
    for name, append in (("metrics.jsonl", append_line), ("events.jsonl", append_event)):
        append(str(full_filesystem / name), {"step": 1})
        before[name] = (full_filesystem / name).read_bytes()
    stray = full_filesystem / "stray"
    fill_filesystem(stray)
    long_row = {"step": 2, "note": "x" * 8192}  # more than the rest of a 4 KiB block
    for name, append in (("metrics.jsonl", append_line), ("events.jsonl", append_event)):
        append(str(full_filesystem / name), long_row)
        assert (full_filesystem / name).read_bytes() == before[name]  # as it was
    os.remove(stray)
    for name in ("metrics.jsonl", "events.jsonl"):
        assert write_unwritten(str(full_filesystem / name))
        # Every line one JSON object, as a plain JSON-lines reader requires.
        lines = (full_filesystem / name).read_text().splitlines()
        assert [json.loads(line) for line in lines] == [{"step": 1}, long_row]


def test_a_run_on_s3_sends_its_records_growth_not_their_size(s3_server, s3_bucket, tmp_path):
    """Each checkpoint of a run on S3 re-uploaded its whole metrics.jsonl: at OPT's 330k steps,
    hundreds of MB a save. Past S3's least part a copy sends the tail; the object is the file."""
    from raylm.data import storage
    from raylm.train.observe.records import RecordsUpload

    cfg, run = s3_server.storage, f"{s3_bucket}/runs/r"
    records = RecordsUpload(str(tmp_path), run, cfg)
    metrics, board = tmp_path / "metrics.jsonl", tmp_path / "tensorboard"
    board.mkdir()
    (board / "events.out.tfevents.1").write_bytes(b"\x00tb")
    rows = [{"step": step, "loss": 1.0 / step, "pad": "x" * 200} for step in range(1, 25_001)]
    for row in rows:
        append_line(str(metrics), row)

    def same_on_s3() -> None:
        for name in ("metrics.jsonl", "tensorboard/events.out.tfevents.1"):
            assert storage.read_bytes(f"{run}/{name}", cfg) == (tmp_path / name).read_bytes()

    records.upload()
    size = metrics.stat().st_size
    assert size > storage.S3_LEAST_PART and records.bytes_sent == size + 3
    same_on_s3()
    for step in range(25_001, 25_011):
        append_line(str(metrics), {"step": step})
    records.upload()
    assert records.bytes_sent == size + 3 + (metrics.stat().st_size - size)  # the ten rows, nothing more
    same_on_s3()
    records.upload()  # nothing new: nothing sent
    assert records.bytes_sent == metrics.stat().st_size + 3
    # The object changed on S3 under it: the whole file replaces it, never a tail on another's bytes.
    storage.write_bytes(f"{run}/metrics.jsonl", b'{"step": 0}\n' * (storage.S3_LEAST_PART // 12 + 1), cfg)
    append_line(str(metrics), {"step": 25_011})
    sent = records.bytes_sent
    records.upload()
    assert records.bytes_sent == sent + metrics.stat().st_size
    same_on_s3()
    # A resume drops the rows of the steps trained again: a new file, sent whole.
    rewrite_records(str(metrics), rows[:24_000])
    records.upload()
    same_on_s3()
