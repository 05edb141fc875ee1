"""The global sample order: pure, world-size independent, resumable, skippable, mixable."""

import collections

import pytest

from raylm.data.order import MIX_BLOCK, DatasetOrder, SampleOrder, batch_indices, chunking_warning, rank_slice
from tests.support.order import epoch_samples, locate


def make_order(rows=(100, 37, 64), seed=0, chunk_rows=16, weights=None, datasets=1):
    orders = [DatasetOrder([f"d{d}/s{i}" for i in range(len(rows))], list(rows), seed, chunk_rows, salt=d)
              for d in range(datasets)]
    return SampleOrder(orders, weights or [1.0] * datasets, seed)


def consume(order, position, steps, global_batch, dp_size, skip=()):
    """What each rank of a dp_size world reads, step by step."""
    per_step = []
    for _ in range(steps):
        indices, position = batch_indices(position, global_batch, list(skip))
        per_step.append([[locate(order, g) for g in rank_slice(indices, r, dp_size)] for r in range(dp_size)])
    return per_step, position


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_epoch_covers_every_row_exactly_once(dp_size):
    order = make_order()
    n = epoch_samples(order)
    per_step, _ = consume(order, 0, n // 6, 6, dp_size)  # 201 rows -> 33 steps of 6, 3 left over
    seen = [row for step in per_step for rank in step for row in rank]
    assert len(seen) == len(set(seen))
    rest = [locate(order, g) for g in range(len(seen), n)]
    assert set(seen) | set(rest) == {(0, s, r) for s, rows in enumerate((100, 37, 64)) for r in range(rows)}


def test_global_batches_identical_at_any_world_size():
    order = make_order()
    batches = {}
    for dp_size in (1, 2, 3):
        per_step, _ = consume(order, 0, 10, 6, dp_size)
        batches[dp_size] = [[row for rank in step for row in rank] for step in per_step]
    assert batches[1] == batches[2] == batches[3]


def test_resume_at_another_world_size_continues_the_sequence():
    order = make_order()
    full, _ = consume(order, 0, 12, 6, 1)
    first, position = consume(order, 0, 5, 6, 2)
    rest, _ = consume(order, position, 7, 6, 3)
    flat = lambda steps: [row for step in steps for rank in step for row in rank]  # noqa: E731
    assert flat(first) + flat(rest) == flat(full)


def test_epochs_reshuffle_by_seed_and_order_is_pure():
    order = make_order()
    n = epoch_samples(order)
    epoch0 = [locate(order, g) for g in range(n)]
    epoch1 = [locate(order, g) for g in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    assert [locate(make_order(), g) for g in range(n)] == epoch0
    assert [locate(make_order(seed=1), g) for g in range(n)] != epoch0


def test_skip_ranges_are_never_fed():
    indices, position = batch_indices(0, 10, [[3, 6], [8, 9]])
    assert indices == [0, 1, 2, 6, 7, 9, 10, 11, 12, 13]
    assert position == 14
    assert batch_indices(4, 2, [[0, 5], [5, 7]])[0] == [7, 8]


def test_overlapping_and_touching_skip_ranges_are_one_jump():
    assert batch_indices(0, 4, [[5, 9], [1, 3], [2, 5], [9, 9], [10, 11]])[0] == [0, 9, 11, 12]


@pytest.mark.parametrize("datasets, weights, shuffle", [(1, None, True), (1, None, False), (2, [0.7, 0.3], True)])
def test_positions_of_rows_are_where_the_order_puts_them(datasets, weights, shuffle):
    """The inverse of the order: each row's positions in a span of several epochs, found without a
    scan, are exactly the positions the order maps to that row."""
    order = make_order(weights=weights, datasets=datasets)
    for dataset in order.datasets:
        dataset.shuffle = shuffle
    last = datasets - 1
    rows = [*((d, 0, 5) for d in range(datasets)), (last, 0, 99), (last, 1, 0), (last, 2, 63)]
    lo, hi = 150, 150 + 3 * 2 * 201 + 17  # partial epochs at both ends
    owners, shards, rows_at = order.locate_many(range(lo, hi))
    where = collections.defaultdict(list)
    for g, key in zip(range(lo, hi), zip(owners.tolist(), shards.tolist(), rows_at.tolist())):
        where[key].append(g)
    want = sorted(g for row in rows for g in where[row])
    assert order.positions_of(rows, lo, hi).tolist() == want and want


def test_mixture_proportions_and_determinism():
    order = make_order(rows=(500, 500), weights=[0.7, 0.3], datasets=2)
    counts = collections.Counter(locate(order, g)[0] for g in range(5 * MIX_BLOCK))
    assert counts[0] == 3500 and counts[1] == 1500
    window = collections.Counter(locate(order, g)[0] for g in range(1234, 1234 + 500))
    assert abs(window[0] / 500 - 0.7) < 0.08
    again = make_order(rows=(500, 500), weights=[0.7, 0.3], datasets=2)
    assert [locate(again, g) for g in range(3000)] == [locate(order, g) for g in range(3000)]
    # Within a component, every row is used once before any repeats.
    rows0 = [locate(order, g) for g in range(2000) if locate(order, g)[0] == 0][:1000]
    assert len(set(rows0)) == 1000


def test_uneven_split_is_a_clear_error():
    with pytest.raises(ValueError, match="does not split evenly over 4"):
        rank_slice(list(range(6)), 0, 4)


def test_a_batch_of_fewer_rows_than_a_chunk_is_warned_of_with_the_steps_it_spends_on_one_passage():
    order = make_order(rows=(256,), chunk_rows=64)
    per_step, _ = consume(order, 0, 8, 16, 1)
    passages = [{row // 64 for _, _, row in step[0]} for step in per_step]
    assert all(len(p) == 1 for p in passages) and passages[0] == passages[3] != passages[4]  # 4 steps, one passage
    assert chunking_warning(64, 16, "a global batch") == (
        "data.chunk_rows=64 is more than a global batch (16 rows): 4 steps in a row train on one passage of "
        "consecutive rows, which costs loss; set data.chunk_rows to at most 16 (1 draws every row on its own)")
    assert chunking_warning(16, 16, "a global batch") is None and chunking_warning(1, 4, "a global batch") is None
