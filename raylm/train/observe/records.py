"""A run's JSON-lines records: the file names, and how they are read, appended and rewritten.

A kill can cut a line short, and a later append must not glue its line onto the torn one. So
readers drop a line that is not one JSON object (a torn last line above all) and say which, by
file and line; appends start on a line of their own, and one that a full disk refuses leaves the
file as it was; rewrites replace the file whole.
No torch here: the driver and Ray Train's controller read and append them without importing
the training code.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from typing import Callable, Optional

from raylm.config import StorageConfig
from raylm.data import storage

METRICS_FILE = "metrics.jsonl"  # one row per step, written by rank 0 into the run directory
EVENTS_FILE = "events.jsonl"  # failures, restarts, resizes, skipped checkpoints
PROFILE_DIR = "profile"  # train.profile's traces and memory snapshots, a file per rank
TENSORBOARD_DIR = "tensorboard"  # TensorBoard's event files, written by rank 0


def read_records(uri: str, storage_cfg: Optional[StorageConfig] = None,
                 problem: Optional[Callable[[dict], Optional[str]]] = None) -> tuple[list[dict], list[str]]:
    """The rows of a JSON-lines file (local or s3://; none if it is absent), and a description of
    each line dropped because it is not one JSON object: a last line without its newline (a write
    cut short, or still being written), or a garbled one. A reader that computes with the rows'
    fields (`raylm report`) passes `problem`, which says what is wrong with a row it cannot use
    (None: nothing): that row is dropped and named too."""
    try:
        text = storage.read_bytes(uri, storage_cfg).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return [], []
    lines = text.split("\n")
    rows, dropped = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if number == len(lines):  # no newline after it: a write cut short, or one in progress
            dropped.append(f"{uri} line {number}: torn (no end of line), {len(line)} bytes")
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            dropped.append(f"{uri} line {number}: not JSON ({e})")
            continue
        if not isinstance(row, dict):
            dropped.append(f"{uri} line {number}: a JSON {type(row).__name__}, not an object")
            continue
        reason = problem(row) if problem else None
        if reason:
            dropped.append(f"{uri} line {number}: {reason}")
            continue
        rows.append(row)
    return rows, dropped


def read_jsonl(uri: str, storage_cfg: Optional[StorageConfig] = None) -> list[dict]:
    """The rows of a JSON-lines file, for readers that only show them (`read_records` says what
    was dropped)."""
    return read_records(uri, storage_cfg)[0]


def merged_lines(*texts: bytes) -> bytes:
    """Every distinct complete line of `texts`, in the order of their rows' `time` (a line
    without one keeps its place after the line before it): two copies of one run's events, each
    holding lines the other lacks, as one."""
    seen: set[bytes] = set()
    keyed: list[tuple[float, int, bytes]] = []
    when = float("-inf")
    for text in texts:
        for line in text.split(b"\n")[:-1]:  # a last piece without its newline is torn: dropped
            if not line.strip() or line in seen:
                continue
            seen.add(line)
            with contextlib.suppress(ValueError, TypeError, KeyError):
                when = float(json.loads(line)["time"])
            keyed.append((when, len(keyed), line))
    return b"".join(line + b"\n" for _, _, line in sorted(keyed))


# Lines a full disk refused, per file, in order: written before the next line to that file.
_unwritten: dict[str, list[bytes]] = {}


def append_line(path: str, row: dict) -> None:
    """Append one row to a local JSON-lines record.

    A full disk must not stop training (checkpoints have their own policy): the row is kept, with
    one warning, and written with the next row that fits, in order; the file keeps no part of it.
    """
    _unwritten.setdefault(path, []).append(json.dumps(row).encode() + b"\n")
    write_unwritten(path)


def write_unwritten(path: str) -> bool:
    """Write the rows of `path` that a full disk refused, if there is space now (the end of a
    run tries once more); returns whether none is left."""
    pending = _unwritten.get(path)
    if not pending:
        return True
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _append_whole(path, b"".join(pending))
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if len(pending) == 1:
            print(f"WARNING: {path}: the disk is full ({e.strerror}); its rows are kept in memory and "
                  "written once there is space", flush=True)
        return False
    pending.clear()
    return True


def _append_whole(path: str, lines: bytes) -> None:
    """Append `lines` to `path` whole, or leave the file as it was: a full disk takes the bytes
    that fit in the file's last block and refuses the rest, and the part line left behind stopped
    every JSON-lines reader but raylm's (jq, pandas) in the middle of the file. A file that ends
    torn (a kill mid-write) is left so; the lines start on a line of their own."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        if end and os.pread(fd, 1, end - 1) != b"\n":
            lines = b"\n" + lines
        written = memoryview(lines)
        try:
            while written:
                written = written[os.write(fd, written):]
        except BaseException:  # a Ctrl-C mid-write too: no part line left behind
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def append_event(path: str, event: dict) -> None:
    """One line of a local JSON-lines record (events.jsonl): failures, recoveries, resizes."""
    append_line(path, event)


def rewrite_records(path: str, rows: list[dict]) -> None:
    """Replace the local JSON-lines file at `path` with `rows`, whole: a reader or a crash sees
    the old file or the new one."""
    storage.write_bytes(path, "".join(json.dumps(row) + "\n" for row in rows).encode())




class RecordsUpload:
    """Rank 0's local records of a run on S3 (metrics.jsonl, events.jsonl, TensorBoard's event
    files, as far as they are on disk) copied into the run: with each checkpoint and when training
    ends. Each copy sends what a file gained since the last one: S3 makes the new object from the
    old one, copied by the server, and the tail (`storage.append_object`), so a checkpoint costs
    the records' growth, not their size. A file sent whole: the first time in this process, after
    it was rewritten (a resume drops the rows of the steps trained again: a new file), while it is
    smaller than S3's least part, or when the object changed on S3 (the driver adds its events)."""

    def __init__(self, run_dir: str, run_uri: str, storage_cfg: Optional[StorageConfig]):
        self.run_dir, self.run_uri, self.storage_cfg = run_dir, run_uri, storage_cfg
        self.sent: dict[str, tuple[int, int, str]] = {}  # name -> (inode, bytes sent, the object's ETag)
        self.bytes_sent = 0  # what travelled, tails and whole files

    def names(self) -> list[str]:
        board = os.path.join(self.run_dir, TENSORBOARD_DIR)
        boards = sorted(f"{TENSORBOARD_DIR}/{n}" for n in os.listdir(board)) if os.path.isdir(board) else []
        return [n for n in (METRICS_FILE, EVENTS_FILE) if os.path.exists(os.path.join(self.run_dir, n))] + boards

    def upload(self) -> None:
        for name in self.names():
            with open(os.path.join(self.run_dir, name), "rb") as f:
                stat = os.fstat(f.fileno())
                inode, size = stat.st_ino, stat.st_size
                inode_sent, size_sent, tag = self.sent.get(name, (None, 0, ""))
                uri = storage.join(self.run_uri, name)
                if inode == inode_sent and size == size_sent:
                    continue
                if inode == inode_sent and storage.S3_LEAST_PART <= size_sent < size:
                    f.seek(size_sent)
                    tail = f.read(size - size_sent)
                    try:
                        self.sent[name] = (inode, size, storage.append_object(uri, tag, tail, self.storage_cfg))
                        self.bytes_sent += len(tail)
                        continue
                    except storage.ConditionFailedError:
                        f.seek(0)
                whole = f.read(size)
            self.sent[name] = (inode, size, storage.put_object(uri, whole, self.storage_cfg))
            self.bytes_sent += len(whole)
