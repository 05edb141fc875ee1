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
