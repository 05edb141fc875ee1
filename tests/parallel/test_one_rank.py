"""One rank, the layout of one GPU: no FSDP2 wrapper unless asked (parallel.one_rank_fsdp or
cpu_offload), parallel.param_dtype as autocast over fp32 weights there, the same rule in a single
process and in a one-rank process group, and an elastic run that shrinks to one worker and grows
back resumes its sharded checkpoint."""

from __future__ import annotations

import dataclasses
import os

import pytest
from torch.distributed.tensor import DTensor

from raylm.config import ConfigError, ParallelConfig
from raylm.parallel.layout import MixedPrecision, ParallelDims
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from tests.parallel.test_layouts import BF16_LOSS_RTOL, STEPS, build, make_config, reference, run_steps
from tests.support.distributed import run_distributed
from tests.train.test_loop import tiny_config


def dims(world_size: int, **parallel) -> ParallelDims:
    return ParallelDims.of(dataclasses.replace(ParallelConfig(), **parallel), world_size)


def test_one_rank_has_no_wrapper_unless_asked() -> None:
    for sharding in ("optimizer", "gradients", "full"):
        alone = dims(1, sharding=sharding)
        assert (alone.fsdp, alone.replicate, alone.amp) == (False, False, True)
        assert dims(2, sharding=sharding).fsdp
        assert dims(1, sharding=sharding, one_rank_fsdp=True).fsdp
        assert dims(1, sharding=sharding, cpu_offload=True).fsdp  # offloading needs FSDP2
    assert dims(2, sharding="none").replicate and not dims(2, sharding="none").amp
    # Beside TP, FSDP2 keeps wrapping on a one-rank dp_shard group, as before.
    assert dims(2, sharding="full", tp=2).fsdp and not dims(2, sharding="full", tp=2).amp


@pytest.mark.parametrize("world_size, precision, parallel, expected", [
    (1, "fp32", dict(sharding="full", param_dtype="bf16"), "autocast bf16"),
    (1, "fp32", dict(sharding="none", param_dtype="fp16"), "autocast fp16"),
    (1, "fp32", dict(sharding="full", param_dtype="bf16", one_rank_fsdp=True), "fsdp2 bf16"),
    (1, "bf16", dict(sharding="full"), "autocast bf16"),
    (1, "fp32", dict(sharding="full"), "none"),
    (2, "fp32", dict(sharding="full", param_dtype="bf16"), "fsdp2 bf16"),
    (2, "fp32", dict(sharding="none", param_dtype="bf16"), "fsdp2 bf16"),  # replicate casts too
    (2, "bf16", dict(sharding="full", param_dtype="bf16"), "fsdp2 bf16 + autocast bf16"),
    (2, "fp32", dict(sharding="full", param_dtype="bf16", tp=2), "fsdp2 bf16"),
    (2, "float8", dict(sharding="full", param_dtype="bf16"), "fsdp2 bf16"),
    (2, "float8", dict(sharding="full"), "autocast bf16"),
    (1, "float8", dict(sharding="full", param_dtype="bf16"), "autocast bf16"),
])
def test_mixed_precision_is_read_from_the_resolved_layout(world_size, precision, parallel, expected) -> None:
    layout = dims(world_size, **parallel)
    assert str(MixedPrecision.of(precision, dataclasses.replace(ParallelConfig(), **parallel), layout)) == expected


def _one_rank(precision: str = "fp32", **parallel) -> dict:
    """test_layouts' steps of its llama on this process's only rank, and what the layout built."""
    cfg = make_config("llama", **parallel)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    model, optimizer = build(cfg)
    losses, norms = run_steps(model, optimizer, cfg, range(STEPS))
    return {"losses": losses, "norms": norms, "layout": model.layout,
            "wrapped": any(isinstance(p, DTensor) for p in model.model.parameters())}


def test_param_dtype_on_one_rank_is_autocast_over_fp32_weights() -> None:
    """In a single process, sharding=full and param_dtype=bf16 (a multi-GPU config) train as
    train.precision=bf16 does, to the bit: plain fp32 parameters, the forward under bf16 autocast."""
    got = _one_rank(sharding="full", param_dtype="bf16")
    assert not got["wrapped"]
    assert (got["layout"]["data_parallel"], got["layout"]["mixed_precision"]) == ("none", "autocast bf16")
    autocast = _one_rank("bf16", sharding="full")
    assert (got["losses"], got["norms"]) == (autocast["losses"], autocast["norms"])
    assert got["losses"] == pytest.approx(reference("llama")["losses"][:STEPS], rel=BF16_LOSS_RTOL)


def test_one_rank_fsdp_needs_a_process_group() -> None:
    with pytest.raises(ConfigError, match="one_rank_fsdp .* needs a torch.distributed process group"):
        build(make_config("llama", sharding="full", one_rank_fsdp=True))


def _in_a_one_rank_group() -> dict:
    return {"default": _one_rank(sharding="full", param_dtype="bf16"),
            "asked": _one_rank(sharding="full", param_dtype="bf16", one_rank_fsdp=True)}


@pytest.mark.slow
def test_a_one_rank_process_group_follows_the_same_rule() -> None:
    (got,) = run_distributed(_in_a_one_rank_group, 1)
    alone = _one_rank(sharding="full", param_dtype="bf16")
    assert not got["default"]["wrapped"] and got["default"]["layout"] == alone["layout"]
    assert (got["default"]["losses"], got["default"]["norms"]) == (alone["losses"], alone["norms"])
    asked = got["asked"]
    assert asked["wrapped"]
    assert (asked["layout"]["data_parallel"], asked["layout"]["mixed_precision"]) == ("ZeRO-3", "fsdp2 bf16")
    assert asked["losses"] == pytest.approx(reference("llama")["losses"][:STEPS], rel=BF16_LOSS_RTOL)


def _train_ranks(dataset: str, run_dir: str, *extra: str) -> None:
    train_local(tiny_config(dataset, *extra), run_dir)


def _losses(run_dir: str) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}


@pytest.mark.slow
def test_a_sharded_run_shrinks_to_one_plain_rank_and_grows_back(tiny_dataset, tmp_path) -> None:
    """An elastic run of sharding=full: 2 ranks save FSDP2 shards, one process resumes them into plain
    tensors (no wrapper on one rank), and 2 ranks resume that checkpoint into shards again."""
    common = ("train.steps=9", "checkpoint.every_steps=3", "train.eval_every=0", "parallel.sharding=full")
    straight, resized = str(tmp_path / "straight"), str(tmp_path / "resized")
    run_distributed(_train_ranks, 2, tiny_dataset, straight, *common)
    run_distributed(_train_ranks, 2, tiny_dataset, resized, *common, "train.stop_at_step=3")
    train_local(tiny_config(tiny_dataset, *common, "train.stop_at_step=6"), resized)  # one rank: plain tensors
    run_distributed(_train_ranks, 2, tiny_dataset, resized, *common)
    want, got = _losses(straight), _losses(resized)
    assert sorted(got) == list(range(1, 10))
    for step in range(1, 10):
        # another world size reduces in another order: close, not bitwise (as test_batch_rampup's resize)
        assert got[step] == pytest.approx(want[step], rel=1e-6 if step <= 3 else 5e-3), step
