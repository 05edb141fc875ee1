"""Selective activation checkpointing (`parallel.activation_checkpointing: selective`): the losses
and gradient norms of a run without checkpointing, bit for bit in one process and within the layout
tests' tolerance under FSDP2, tensor/sequence parallelism and a pipeline on 2 gloo ranks; a
backward that recomputes no matmul, where full checkpointing recomputes every one; and the
pipeline schedules that cannot checkpoint refused before any process group exists.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from raylm.config import ConfigError, ModelConfig, ParallelConfig
from raylm.parallel.layout import resolve_layout
from tests.parallel.test_layouts import (MICRO_BATCH, RTOL, TP_SP, build, global_batch, make_config, reference,
                                         train_steps)
from tests.support.distributed import run_distributed


@pytest.mark.parametrize("model", ["llama", "gpt", "palm"])
def test_selective_matches_no_checkpointing_in_one_process(model: str) -> None:
    got = train_steps(make_config(model, activation_checkpointing="selective"))
    ref = reference(model)
    assert (got["losses"], got["norms"]) == (ref["losses"], ref["norms"])


def _backward_flops(mode: str) -> int:
    model, _ = build(make_config("llama", activation_checkpointing=mode))
    tokens = global_batch(0)[:MICRO_BATCH]
    (part,) = model.parts
    logits = part(tokens[:, :-1])  # (B, T, vocab)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_selective_recomputes_no_matmul() -> None:
    # Backward's matmuls and attention alone under none; full adds a second forward of every block.
    none, selective, full = (_backward_flops(mode) for mode in ("none", "selective", "full"))
    assert selective == none < full


def _two_rank_layouts() -> dict:
    layouts = {
        "zero3": ("llama", dict(sharding="full")),
        "zero3_selective": ("llama", dict(sharding="full", activation_checkpointing="selective")),
        "tp2_sp_selective": ("llama", dict(TP_SP, activation_checkpointing="selective")),
        "tp2_sp_gpt_selective": ("gpt", dict(TP_SP, activation_checkpointing="selective")),  # biases: addmm
        "pp2_1f1b_selective": ("llama", dict(pp=2, pp_schedule="1f1b", activation_checkpointing="selective")),
        # A recompute of the first block once sliced its sequence-parallel input twice.
        "tp2_sp_full": ("llama", dict(TP_SP, activation_checkpointing="full")),
    }
    return {name: (model, train_steps(make_config(model, **fields))) for name, (model, fields) in layouts.items()}


@pytest.mark.slow
def test_selective_under_fsdp2_tensor_and_pipeline_parallel_on_two_ranks() -> None:
    for rank, results in enumerate(run_distributed(_two_rank_layouts, 2)):
        for name, (model, got) in results.items():
            ref = reference(model)
            assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {rank} {name} losses"
            assert got["norms"] == pytest.approx(ref["norms"], rel=RTOL), f"rank {rank} {name} grad norms"
        # The same layout with and without it: the same arithmetic, so the same bits.
        assert results["zero3_selective"][1]["losses"] == results["zero3"][1]["losses"], f"rank {rank}"


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_split_backward_schedules_refuse_checkpointing(mode: str) -> None:
    parallel = ParallelConfig(pp=2, pp_schedule="zbv_zero_bubble", pp_virtual_stages=2, activation_checkpointing=mode)
    with pytest.raises(ConfigError, match=f"cannot be recomputed twice: set parallel.activation_checkpointing=none "
                                          f"\\(got {mode}\\)"):
        resolve_layout(parallel, ModelConfig(n_layers=4, vocab_size=64), 2)
