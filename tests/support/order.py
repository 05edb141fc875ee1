"""One-sample views of a sample order, for reading tests (production locates in bulk)."""

from __future__ import annotations

import numpy as np

from raylm.data.order import MIX_BLOCK, DatasetOrder, SampleOrder


def locate(order: DatasetOrder | SampleOrder, index: int) -> tuple[int, ...]:
    """(shard, row) of a dataset's sample, or (dataset, shard, row) of a global sample."""
    return tuple(int(a[0]) for a in order.locate_many(np.array([index])))


def epoch_samples(order: SampleOrder) -> int:
    """Samples in one pass over the first dataset (the whole dataset when there is one)."""
    return order.datasets[0].num_samples if len(order.datasets) == 1 else MIX_BLOCK


def assert_every_sample_once(rows: dict[int, dict], global_batch: int | None = None) -> None:
    """Steps 1..n (metrics rows with train.audit_samples, by step) trained on the planned order
    from its start, each sample once and in order (a global sample index is its place in that
    order; tests/data map it to rows), each step `global_batch` samples when given (a quorum of
    replica groups trains fewer while a group is down)."""
    assert sorted(rows) == list(range(1, len(rows) + 1)), "a step is missing"
    trained = [i for s in sorted(rows) for i in rows[s]["samples"]]
    assert trained == list(range(len(trained))), "a sample was lost, repeated or reordered"
    assert rows[len(rows)]["position"] == len(trained), "the data position is not the samples trained"
    if global_batch is not None:
        assert len(trained) == len(rows) * global_batch, "a step trained another batch size"
