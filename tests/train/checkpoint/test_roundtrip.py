"""A checkpoint round-trips bit for bit: every tensor of the model and optimizer state, and
the RNG, in one process and on two FSDP ranks (the same layout saves and loads)."""

import os

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from raylm.parallel.world import World
from raylm.train.checkpoint import format as checkpoint
from tests.support.checkpoints import TOKENIZER_SHA, build, save_checkpoint, tiny_config, train_steps
from tests.support.distributed import run_distributed


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _flat_state(model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model.model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {**{f"model.{k}": v for k, v in model_sd.items()}, **{f"optim.{k}": v for k, v in optim_sd.items()}}


def _differences(saved: dict, loaded: dict) -> list[str]:
    """Keys whose values are not identical (tensors: this rank's shard, torch.equal)."""
    if saved.keys() != loaded.keys():
        return [f"keys differ: {sorted(saved.keys() ^ loaded.keys())[:5]}"]
    bad = []
    for key, value in saved.items():
        other = loaded[key]
        if torch.is_tensor(value):
            same = (type(value) is type(other) and value.dtype == other.dtype
                    and torch.equal(_local(value), _local(other)))
        else:
            same = value == other
        if not same:
            bad.append(key)
    return bad


def _round_trip(run_dir: str, *overrides: str) -> tuple[int, list[str], bool]:
    """Train, save, then load into a fresh model and optimizer of the same layout; returns the
    number of entries compared, those that differ, and whether the RNG came back."""
    cfg = tiny_config(*overrides)
    model, optimizer = build(cfg)
    train_steps(model, optimizer, range(3))
    torch.manual_seed(1234)  # the RNG state the checkpoint must bring back
    rng = torch.get_rng_state()
    directory = save_checkpoint(run_dir, cfg, 3, model, optimizer)
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in _flat_state(model, optimizer).items()}

    fresh_model, fresh_optimizer = build(cfg)  # other weights (seeded at build), no optimizer state
    torch.manual_seed(99)
    assert _differences(saved, _flat_state(fresh_model, fresh_optimizer))  # the comparison can fail
    state = checkpoint.load(directory, fresh_model, fresh_optimizer, World.current(), TOKENIZER_SHA)
    assert state["step"] == 3
    return len(saved), _differences(saved, _flat_state(fresh_model, fresh_optimizer)), torch.equal(torch.get_rng_state(), rng)


def test_round_trip_is_bit_exact_in_one_process(tmp_path):
    compared, differing, rng_restored = _round_trip(str(tmp_path))
    assert compared > 20 and differing == [] and rng_restored


def _fsdp_round_trip(run_dir: str) -> tuple[int, list[str], bool, list[str]]:
    compared, differing, rng_restored = _round_trip(run_dir, "parallel.num_workers=2", "parallel.sharding=full")
    model, optimizer = build(tiny_config("parallel.num_workers=2", "parallel.sharding=full"))
    sharded = [k for k, v in _flat_state(model, optimizer).items() if isinstance(v, DTensor)]
    return compared, differing, rng_restored, sharded


@pytest.mark.slow
def test_round_trip_is_bit_exact_on_two_fsdp_ranks(tmp_path):
    results = run_distributed(_fsdp_round_trip, 2, str(tmp_path))
    for rank, (compared, differing, rng_restored, sharded) in enumerate(results):
        assert sharded, f"rank {rank}: nothing was sharded; the test would not exercise FSDP"
        assert compared > 20 and differing == [] and rng_restored, (rank, differing)
    assert sorted(os.listdir(tmp_path / "checkpoint_00000003")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "checkpoint_manifest.json", "config.yaml", "rng",
        "tokenizer.json", "train_state.json"]
