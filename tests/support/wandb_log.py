"""Read back what W&B wrote offline: the run's transaction log (`run-ID.wandb`), a LevelDB-style
log of `wandb_internal_pb2.Record` protobufs after a 7-byte ":W&B" header. wandb has no reader
of its own in Python, and the tests must check what the real library recorded."""

from __future__ import annotations

import json

BLOCK = 32768
HEADER = 7  # the file's magic, and each chunk's checksum (4), length (2) and type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes) -> list[bytes]:
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
        else:
            break
    return records


def history(path: str) -> list[dict]:
    """Each `run.log` call's values, in order (keys as logged, plus W&B's own `_step`...)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in _records(open(path, "rb").read()):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
