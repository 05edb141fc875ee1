"""The token stream over real prepared shards: exact coverage, world-size independence, resume."""

import collections
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from raylm.config import DataConfig
from raylm.data.manifest import DatasetError, load_manifest
from raylm.data.stream import Datasets, TokenStream
from raylm.errors import DeterministicError
from tests.support.order import locate


def all_rows(dataset: str) -> list[tuple]:
    manifest = load_manifest(dataset)
    rows = []
    for uri in manifest.shard_uris(dataset, "train"):
        table = pq.read_table(uri)
        rows += [tuple(r) for r in table.column("tokens").to_pylist()]
    return rows


def rank_streams(dataset, dp_size, position, first, last, global_batch=6, engine="local", skip=(), cache_mb=1024):
    data = DataConfig(path=dataset, chunk_rows=8, shard_cache_mb=cache_mb)
    source = Datasets.load(data, None).open_split("train", data, None)
    return [list(TokenStream(source, global_batch, r, dp_size, list(skip), engine).batches(position, first, last))
            for r in range(dp_size)]


def global_rows(streams) -> list[list[tuple]]:
    """Per step, the rows of the whole global batch (ranks concatenated in rank order)."""
    return [[tuple(row) for batch in step for row in batch.tokens] for step in zip(*streams)]


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_epoch_consumes_every_sample_exactly_once(tiny_dataset, dp_size):
    rows = all_rows(tiny_dataset)
    steps = len(rows) // 6
    consumed = [row for step in global_rows(rank_streams(tiny_dataset, dp_size, 0, 0, steps)) for row in step]
    assert len(consumed) == steps * 6
    remaining = len(rows) - len(consumed)
    assert remaining < 6
    # Multisets: nothing repeated, and all but the last partial batch's rows consumed.
    missing = collections.Counter(rows) - collections.Counter(consumed)
    assert sum(missing.values()) == remaining
    assert not collections.Counter(consumed) - collections.Counter(rows)


def test_identical_global_batches_at_world_sizes_1_2_3(tiny_dataset):
    by_size = {n: global_rows(rank_streams(tiny_dataset, n, 0, 0, 12)) for n in (1, 2, 3)}
    assert by_size[1] == by_size[2] == by_size[3]
    indices = [[g for b in step for g in b.indices] for step in zip(*rank_streams(tiny_dataset, 3, 0, 0, 4))]
    assert indices[0] == list(range(6)) and indices[1] == list(range(6, 12))


def test_resume_mid_epoch_at_another_world_size(tiny_dataset):
    full = global_rows(rank_streams(tiny_dataset, 1, 0, 0, 20))
    first = rank_streams(tiny_dataset, 2, 0, 0, 9)
    position = first[0][-1].next_position
    rest = rank_streams(tiny_dataset, 3, position, 9, 20)
    assert global_rows(first) + global_rows(rest) == full


def test_skipped_range_never_appears(tiny_dataset):
    streams = rank_streams(tiny_dataset, 2, 0, 0, 5, skip=[[4, 10]])
    seen = [g for step in zip(*streams) for b in step for g in b.indices]
    assert seen == [g for g in range(36) if not 4 <= g < 10]


def test_ray_data_engine_yields_the_same_batches(tiny_dataset):
    local = rank_streams(tiny_dataset, 2, 12, 2, 10, engine="local")
    ray_ = rank_streams(tiny_dataset, 2, 12, 2, 10, engine="ray")
    for a, b in zip(local, ray_):
        assert [x.step for x in a] == [x.step for x in b] == list(range(2, 10))
        assert all(np.array_equal(x.tokens, y.tokens) and x.indices == y.indices for x, y in zip(a, b))


def test_mixture_of_real_datasets_keeps_its_proportions(tiny_dataset, tmp_path):
    from raylm.config import MixtureComponent
    from raylm.data.prepare import prepare_dataset
    from tests.support.fixtures import write_corpus

    other = str(tmp_path / "other")
    prepare_dataset([write_corpus(tmp_path / "text", documents=60, seed=7)], other, tokenizer="byte", seq_len=32)
    data = DataConfig(mixture=[MixtureComponent(tiny_dataset, 0.7), MixtureComponent(other, 0.3)], chunk_rows=8)
    source = Datasets.load(data, None).open_split("train", data, None)
    stream = TokenStream(source, 10, 0, 1, [], "local")
    owners = [locate(source.order, g)[0] for b in stream.batches(0, 0, 100) for g in b.indices]
    assert len(owners) == 1000 and abs(owners.count(0) / 1000 - 0.7) < 0.01
    # Each row's tokens are those of the row its owner's shard holds at the located position.
    batch = next(TokenStream(source, 10, 0, 1, [], "local").batches(0, 0, 1))
    for g, tokens in zip(batch.indices, batch.tokens):
        d, shard, row = locate(source.order, g)
        expected = pq.read_table(source.shard_uris[d][shard]).column("tokens")[row].as_py()
        assert list(tokens) == expected
    assert {locate(source.order, g)[0] for g in batch.indices} == {0, 1}


def test_row_group_reads_give_the_same_batches_as_whole_shards(tiny_dataset, monkeypatch):
    from raylm.data import stream

    whole = rank_streams(tiny_dataset, 2, 0, 0, 6)
    monkeypatch.setattr(stream, "_shards", stream.OrderedDict())
    by_groups = rank_streams(tiny_dataset, 2, 0, 0, 6, cache_mb=0)  # no cache: read row groups
    assert not stream._shards
    for a, b in zip(whole, by_groups):
        assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))


def test_a_shard_cut_short_since_its_manifest_is_an_error_no_restart_cures(tiny_dataset, tmp_path):
    """With data.verify off, a shard that holds fewer rows than its manifest lists raised an
    IndexError, and Ray restarted the run into it run.max_failures times."""
    copy = str(shutil.copytree(tiny_dataset, tmp_path / "copy"))
    shard = load_manifest(copy).shard_uris(copy, "train")[0]
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows // 2), shard)
    with pytest.raises(DatasetError, match=rf"^{shard}: rows \d+\.\.\d+ asked for, but the shard holds "
                                           rf"{table.num_rows // 2}: it was replaced or cut short") as raised:
        rank_streams(copy, 1, 0, 0, table.num_rows // 6 + 1)
    assert isinstance(raised.value, DeterministicError)
