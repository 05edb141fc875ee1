"""Cross-layout resume: a checkpoint saved under one layout resumes under another (and in a
single process) with the losses of an uninterrupted single-process run.

Three steps under the saving layout, a DCP checkpoint through `raylm.train.checkpoint.format`, then
two more steps under the resuming layout; the reference is `tests.parallel.test_layouts`'s
single-process run of the same five steps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from raylm.model.transformer import Transformer
from raylm.parallel.world import World
from raylm.train.step import cross_entropy
from raylm.train.checkpoint import format as checkpoint
from tests.support.distributed import run_distributed
from tests.parallel.test_layouts import (MICRO_BATCH, RTOL, STEPS, TP_SP, build, global_batch, make_config, reference,
                                         run_steps)

SAVED_AT = 3
TOKENIZER = "test-tokenizer"
# name -> (saving layout, resuming layout), on 4 ranks; the model is "llama" throughout.
PAIRS = {
    # two pipeline chunks per rank, FSDP-sharded -> TP with sequence parallel, FSDP-sharded
    "pp2_interleaved_fsdp2_to_tp2_fsdp2": (
        dict(sharding="full", pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
        dict(sharding="full", **TP_SP)),
    # HSDP with ZeRO-1 -> a 1F1B pipeline with TP and no data parallelism
    "hsdp_zero1_to_pp2_tp2": (dict(sharding="optimizer", dp_replicate=2), dict(pp=2, **TP_SP)),
}


def _save(directory: str, model, optimizer) -> None:
    train_state = {"step": SAVED_AT, "position": 0, "tokens_seen": 0, "tokenizer_sha256": TOKENIZER}
    checkpoint.save(directory, model, optimizer, World.current(), train_state, files={})
    dist.barrier()


def _save_and_resume(run_dir: str) -> dict:
    out = {}
    for name, (saver, resumer) in PAIRS.items():
        directory = os.path.join(run_dir, name)
        cfg = make_config("llama", **saver)
        model, optimizer = build(cfg)
        run_steps(model, optimizer, cfg, range(SAVED_AT))
        _save(directory, model, optimizer)
        cfg = make_config("llama", **resumer)
        model, optimizer = build(cfg)
        state = checkpoint.load(directory, model, optimizer, World.current(), TOKENIZER)
        assert state["step"] == SAVED_AT
        out[name] = run_steps(model, optimizer, cfg, range(SAVED_AT, STEPS))[0]
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    run_dir = str(tmp_path_factory.mktemp("parallel_resume"))
    return run_dir, run_distributed(_save_and_resume, 4, run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PAIRS))
def test_resume_under_another_layout(saved: tuple[str, list[dict]], name: str) -> None:
    _, per_rank = saved
    expected = reference("llama")["losses"][SAVED_AT:STEPS]
    for rank, got in enumerate(per_rank):
        assert got[name] == pytest.approx(expected, rel=RTOL), f"rank {rank}"


@pytest.mark.slow
def test_resume_in_a_single_process(saved: tuple[str, list[dict]]) -> None:
    """The pipeline x FSDP checkpoint (4 ranks, 2 chunks each) resumes in one process."""
    run_dir, _ = saved
    cfg = make_config("llama")
    model, optimizer = build(cfg)
    checkpoint.load(os.path.join(run_dir, "pp2_interleaved_fsdp2_to_tp2_fsdp2"), model, optimizer,
                    World.current(), TOKENIZER)
    losses, _ = run_steps(model, optimizer, cfg, range(SAVED_AT, STEPS))
    assert losses == pytest.approx(reference("llama")["losses"][SAVED_AT:STEPS], rel=RTOL)


@pytest.mark.slow
def test_export_weights_to_a_plain_model(saved: tuple[str, list[dict]]) -> None:
    """`load_model_weights` gives a plain Transformer the weights a single process would have."""
    run_dir, _ = saved
    cfg = make_config("llama")
    model, optimizer = build(cfg)
    run_steps(model, optimizer, cfg, range(SAVED_AT))
    exported = Transformer(cfg.model)
    checkpoint.load_model_weights(os.path.join(run_dir, "hsdp_zero1_to_pp2_tp2"), exported)
    expected = model.model.state_dict()
    assert exported.state_dict().keys() == expected.keys()
    for key, value in exported.state_dict().items():
        # Adam's normalised steps turn reduction-order noise in tiny gradients into ~1e-6 absolute
        # differences on weights of ~0.1: compare at that scale, and the model's loss tightly.
        torch.testing.assert_close(value, expected[key], rtol=RTOL, atol=1e-5, msg=key)
    tokens = global_batch(STEPS)
    with torch.no_grad():
        loss = cross_entropy(exported(tokens[:, :-1]), tokens[:, 1:])
    assert float(loss) == pytest.approx(float(model.eval_loss(tokens, MICRO_BATCH)), rel=RTOL)
