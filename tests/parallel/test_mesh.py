"""The parallel degrees and their rules, the pipeline split, stage placement and bubble, and the
names a rank's parts expose to checkpoints: all in one process, no process group."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from raylm.config import ConfigError, ModelConfig, ParallelConfig, config_from_dict
from raylm.model.transformer import Transformer
from raylm.parallel.layout import ParallelDims, resolve_layout
from raylm.parallel.pipeline import (PIPELINE_SCHEDULES, balanced_split, even_split, layer_split, simulated_bubble, stage_ids,
                                     stage_module)
from raylm.train.spec import check_config
from raylm.train.step import merged_view

MODEL = ModelConfig(d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)


def parallel(**fields) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(), **fields)


def test_dp_shard_is_inferred_from_the_world_size() -> None:
    dims = ParallelDims.of(parallel(dp_replicate=2, tp=2, pp=2), 16)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 2, 2, 2, 4)


@pytest.mark.parametrize("fields, world_size, message", [
    (dict(tp=3), 6, "parallel.tp=3 does not divide model n_heads=4"),
    (dict(tp=4), 8, "parallel.tp=4 does not divide model n_kv_heads=2"),
    (dict(dp_shard=3), 4, "multiply to 3, but the world size (parallel.num_workers) is 4"),
    (dict(tp=2, pp=2), 6, "world size 6 is not divisible by dp_replicate=1 x tp=2 x pp=2 = 4"),
    (dict(dp_shard=0), 2, "parallel.dp_shard must be >= 1 or -1"),
    (dict(cpu_offload=True), 2, "cpu_offload needs FSDP2"),
    (dict(one_rank_fsdp=True), 1, "one_rank_fsdp needs FSDP2: set parallel.sharding"),
    (dict(sequence_parallel=True), 2, "need parallel.tp > 1"),
    (dict(pp=2, pp_schedule="interleaved_1f1b"), 2, "set pp_virtual_stages >= 2"),
    (dict(pp=2, pp_schedule="1f1b", pp_virtual_stages=2), 2, "set pp_virtual_stages=1"),
    (dict(pp=2, pp_schedule="zbv_zero_bubble", pp_virtual_stages=3), 2, "exactly 2 stages per rank"),
    (dict(pp=2, pp_layer_split=[3, 4]), 2, "sum to model.n_layers=8"),
    (dict(pp=2, pp_schedule="dualpipev", pp_virtual_stages=2, sharding="full"), 2, "use sharding=gradients"),
    (dict(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=4), 4, "16 pipeline stages"),
])
def test_invalid_layouts_say_why(fields: dict, world_size: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_layout(parallel(**fields), MODEL, world_size)


def test_tied_embeddings_cannot_be_pipelined() -> None:
    with pytest.raises(ConfigError, match="untie them or set parallel.pp=1"):
        resolve_layout(parallel(pp=2), dataclasses.replace(MODEL, tie_embeddings=True), 2)


def test_config_validation_checks_the_layout_against_num_workers() -> None:
    with pytest.raises(ConfigError, match="parallel.tp=3 does not divide"):
        check_config(config_from_dict({"parallel": {"num_workers": 3, "tp": 3}}))
    check_config(config_from_dict({"parallel": {"num_workers": 8, "dp_replicate": 2, "tp": 2, "sharding": "full"}}))


def test_balanced_split_minimises_the_costliest_stage() -> None:
    # Embedding and head as heavy as 2.5 layers: the end stages take fewer layers.
    assert balanced_split([10] * 8, 4, first_extra=25, last_extra=25) == [1, 3, 3, 1]
    assert balanced_split([10] * 8, 2) == [4, 4]
    assert balanced_split([1, 1, 1, 9], 2) == [3, 1]
    assert even_split(10, 4) == [2, 3, 3, 2] and even_split(4, 4) == [1, 1, 1, 1]


def test_layer_split_by_params_layers_or_explicit_list() -> None:
    model = Transformer(dataclasses.replace(MODEL, vocab_size=2048))  # embedding and head ~ 4 layers each
    by_params = layer_split(model, parallel(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2))
    assert [len(g) for g in by_params] == [1, 3, 3, 1]
    by_layers = layer_split(model, parallel(pp=4, pp_balance="layers"))
    assert by_layers == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert [len(g) for g in layer_split(model, parallel(pp=2, pp_layer_split=[5, 3]))] == [5, 3]


def test_stages_per_rank_loop_or_v() -> None:
    looped = parallel(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=3)
    assert [stage_ids(r, looped) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    v = parallel(pp=2, pp_schedule="zbv_zero_bubble", pp_virtual_stages=2)
    assert [stage_ids(r, v) for r in range(2)] == [[0, 3], [1, 2]]


def test_stage_parts_keep_the_plain_model_names() -> None:
    model = Transformer(MODEL)
    p = parallel(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    groups = layer_split(model, p)
    parts = [stage_module(model, groups[s], first=s == 0, last=s == 3) for s in range(4)]
    rank0 = set(dict(merged_view([parts[0], parts[2]]).named_parameters()))
    rank1 = set(dict(merged_view([parts[1], parts[3]]).named_parameters()))
    assert rank0.isdisjoint(rank1)
    assert rank0 | rank1 == set(dict(model.named_parameters()))
    assert "tok_embeddings.weight" in rank0 and "output.weight" in rank1


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_bubble_of_each_schedule(pp: int, m: int) -> None:
    def bubble(name: str, v: int) -> float:
        ops = get_schedule_ops(PIPELINE_SCHEDULES[name], pp, m, num_stages_per_rank=v)
        return simulated_bubble(dict(enumerate(ops)), pp * v)

    assert bubble("gpipe", 1) == pytest.approx((pp - 1) / (m + pp - 1))
    for v in (2, 4):  # interleaving v chunks divides the bubble by about v
        assert bubble("interleaved_1f1b", v) == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert bubble("zbv_zero_bubble", 2) < bubble("interleaved_1f1b", 2)
    assert bubble("interleaved_zero_bubble", 2) < bubble("interleaved_1f1b", 2)
