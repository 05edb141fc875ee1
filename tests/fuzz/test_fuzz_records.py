"""Fuzzed run records: metrics.jsonl and events.jsonl torn, bit-flipped, replaced by random bytes
or appended to, and garbled leases. Readers keep every intact row and name what they drop; an
append after damage starts a line of its own; a garbled lease is taken over, never a traceback."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raylm.data import storage
from raylm.train.lease import LEASE_FILE, RunLease
from raylm.train.observe.records import append_event, read_records
from tests.fuzz.conftest import examples, time_limit
from tests.fuzz.strategies import BYTE_MUTATIONS, byte_mutation

pytestmark = pytest.mark.timeout(time_limit(120))

ROWS = [{"step": step, "loss": 3.0 - 0.1 * step, "lr": 1e-3, "time": 1.7e9 + step} for step in range(1, 21)]
ORIGINAL = "".join(json.dumps(row) + "\n" for row in ROWS).encode()


@examples(60)
@given(st.data())
def test_a_damaged_record_keeps_its_intact_rows_and_names_the_rest(tmp_path_factory, data):
    how = data.draw(st.sampled_from(BYTE_MUTATIONS))
    damaged = byte_mutation(data.draw, ORIGINAL, how, max_random=4096)
    path = tmp_path_factory.mktemp("record") / "metrics.jsonl"
    path.write_bytes(damaged)
    rows, dropped = read_records(str(path))
    lines = damaged.decode("utf-8", errors="replace").split("\n")
    assert len(rows) + len(dropped) == sum(1 for line in lines if line.strip())
    # Every original row whose whole line survived (between two line ends) is kept, in order.
    intact = [row for row in ROWS if f"\n{json.dumps(row)}\n".encode() in b"\n" + damaged]
    assert [row for row in rows if row in intact] == intact
    assert all(str(path) in line for line in dropped)
    append_event(str(path), {"event": "after"})
    again, _ = read_records(str(path))
    # A last line that lacked only its line end is a whole row once the append ends it.
    assert again[-1] == {"event": "after"} and again[:len(rows)] == rows and len(again) - len(rows) in (1, 2)


@examples(30)
@given(st.data())
def test_a_garbled_lease_is_taken_over(tmp_path_factory, data):
    run = tmp_path_factory.mktemp("lease-run")
    record = json.dumps({"owner": "raylm train", "host": "elsewhere", "pid": 7, "heartbeat": 0}).encode()
    how = data.draw(st.sampled_from(BYTE_MUTATIONS))
    storage.write_bytes(str(run / LEASE_FILE), byte_mutation(data.draw, record, how, max_random=512))
    with RunLease(str(run), None, timeout_s=60, events_dir=str(run)):
        assert json.loads((run / LEASE_FILE).read_bytes())["token"]
    assert not (run / LEASE_FILE).exists()
