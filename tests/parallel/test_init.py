"""Start-up at scale: the model is built on the meta device, parallelised, then each rank
materialises and initialises only its own shards.

Invariants: the initial weights (gathered whole) equal those of `Transformer(cfg, seed)` built
plainly, bit for bit, at every layout; and a rank's peak memory during start-up follows its
shard, not the whole model.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from raylm.config import Config, ModelConfig, ParallelConfig, TrainConfig
from raylm.model.sizes import count_params
from raylm.model.transformer import ParamInit, Transformer
from raylm.parallel.world import World
from raylm.parallel.layout import resolve_layout
from raylm.train.step import build_model
from tests.support.distributed import run_distributed
from tests.support.memory import startup_peak

SEED = 11
# ~100M parameters, 417 MiB in fp32, FSDP over 4 ranks: a whole copy stands far above a quarter.
BIG = ModelConfig(d_model=1024, n_layers=6, n_heads=8, vocab_size=16384, max_seq_len=64)
MEMORY_RANKS = 4
MODELS = {
    # A vocabulary of 66 rows splits unevenly over 4 FSDP ranks (17, 17, 16, 16).
    "llama": dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=66, max_seq_len=32),
    "gpt": dict(d_model=32, n_layers=2, n_heads=4, vocab_size=66, max_seq_len=32, norm="layernorm",
                pos_embedding="learned", mlp="gelu", bias=True, tie_embeddings=True),
}
TP_SP = dict(tp=2, sequence_parallel=True, loss_parallel=True)
# name -> (world size, model, ParallelConfig fields)
LAYOUTS: dict[str, tuple[int, str, dict]] = {
    "ddp": (2, "llama", dict(sharding="none")),
    "fsdp2": (2, "llama", dict(sharding="full")),
    "tp2": (2, "llama", TP_SP),
    "tp2_gpt_tied": (2, "gpt", TP_SP),
    "pp2": (2, "llama", dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)),
    "fsdp4_uneven": (4, "llama", dict(sharding="full")),
    "fsdp4_gpt_tied": (4, "gpt", dict(sharding="gradients")),
    "fsdp4_cpu_offload": (4, "llama", dict(sharding="full", cpu_offload=True)),
    "hsdp_2x2": (4, "llama", dict(sharding="full", dp_replicate=2)),
    "tp2_fsdp2": (4, "llama", dict(sharding="full", **TP_SP)),
    "pp2_fsdp2": (4, "llama", dict(sharding="full", pp=2)),
    "pp2_tp2": (4, "llama", dict(pp=2, tp=2)),
}


def make_config(model: str, **parallel) -> Config:
    return Config(model=ModelConfig(**MODELS[model]), train=TrainConfig(seed=SEED, micro_batch_size=2),
                  parallel=dataclasses.replace(ParallelConfig(), **parallel))


def gathered_weights(cfg: Config) -> dict[str, np.ndarray]:
    """The parameters this rank holds, each gathered whole (collectives: every rank calls it);
    numpy arrays, which pickle by value (a tensor would be handed over in shared memory that
    its process takes with it on exit)."""
    world = World.current()
    model = build_model(lambda: Transformer(cfg.model), cfg, world,
                        resolve_layout(cfg.parallel, cfg.model, world.world_size, cfg.train.seq_len))
    out = {}
    for name, param in model.model.named_parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = whole.detach().cpu().numpy()
    tied = cfg.model.tie_embeddings and hasattr(model.model, "output")
    out["tied"] = np.array(tied and model.model.output.weight is model.model.tok_embeddings.weight)
    return out


def _rank_work(names: list[str], measure_memory: bool) -> dict:
    """One spawned group's work (start-up dominates these tests): the start-up memory first,
    on a process that has built nothing yet, then each layout's gathered weights."""
    memory = startup_peak(BIG, "full") if measure_memory else None
    return {"memory": memory,
            "weights": {name: gathered_weights(make_config(LAYOUTS[name][1], **LAYOUTS[name][2])) for name in names}}


@functools.lru_cache(maxsize=None)
def results(world_size: int) -> list[dict]:
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == world_size]
    return run_distributed(_rank_work, world_size, names, world_size == MEMORY_RANKS)


def reference(model: str) -> dict[str, torch.Tensor]:
    return dict(Transformer(ModelConfig(**MODELS[model]), seed=SEED).named_parameters())


def test_single_process_build_equals_a_plain_build():
    cfg = make_config("gpt")
    got = gathered_weights(cfg)
    assert bool(got.pop("tied"))
    ref = reference("gpt")
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.equal(torch.from_numpy(got[name]), value), name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_starts_from_the_weights_of_a_plain_build(name: str) -> None:
    world_size, model, parallel = LAYOUTS[name]
    ref = reference(model)
    seen: set[str] = set()
    for rank, got in enumerate(r["weights"][name] for r in results(world_size)):
        got = dict(got)  # the group's results are cached: leave them whole
        tied = bool(got.pop("tied"))
        if MODELS[model].get("tie_embeddings"):
            assert tied, f"rank {rank}: the head is no longer the embedding after materialisation"
        for key, value in got.items():
            assert torch.equal(torch.from_numpy(value), ref[key].detach()), f"rank {rank}: {key}"
        seen |= got.keys()
    assert seen == ref.keys(), "every parameter is held by some rank"


def test_a_shard_draws_the_rows_of_the_whole_tensor():
    init = ParamInit("normal", "layers.0.feed_forward.w1.weight", std=0.02)
    shape = (3000, 700)  # 1497 rows per random block: a shard spans block edges
    whole = init.draw(shape, seed=5)
    for rows in (torch.arange(1400, 1600), torch.tensor([0, 2999, 1497, 5])):
        assert torch.equal(init.draw(shape, seed=5, rows=rows), whole[rows])
    assert not torch.equal(init.draw(shape, seed=6), whole)


# ----------------------------------------------------------------------------- start-up memory

@pytest.mark.slow
def test_startup_memory_follows_the_shard_not_the_model():
    full_mib = count_params(BIG) * 4 / 2**20
    for rank, result in enumerate(results(MEMORY_RANKS)):
        got = result["memory"]
        assert got["held_mib"] == pytest.approx(full_mib / MEMORY_RANKS, rel=0.01)
        # The measure sees the shards it allocated, and little more: the rows of one parameter in
        # flight, never a whole copy of the model (which building it whole first would take).
        assert 0.9 * got["held_mib"] < got["peak_mib"] < 0.5 * full_mib, f"rank {rank}: {got}, model {full_mib:.0f} MiB"
