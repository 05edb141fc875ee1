"""`model.attention: document`: a packed document gets the logits it would get alone, the key is
checked, a run trains with it, and pipeline and tensor parallel layouts give a single process's losses."""

import dataclasses
import json

import pytest
import torch

from raylm.config import Config, ConfigError, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, load_config
from raylm.config.describe import describe_fields
from raylm.model.transformer import Transformer, document_ids
from raylm.parallel.layout import resolve_layout
from raylm.parallel.world import World
from raylm.train.optim import build_optimizer
from raylm.train.step import build_model
from tests.support.distributed import run_distributed

torch.set_num_threads(1)

VOCAB, EOT = 97, 96


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{"d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": VOCAB,
                          "max_seq_len": 32, "ffn_multiple": 16, **overrides})


def documents(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Documents of these many tokens, each ended by EOT but the last (cut off by the row's end)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, EOT, (n,), generator=g) for n in lengths]
    return [torch.cat([d, torch.tensor([EOT])]) for d in docs[:-1]] + docs[-1:]


def test_document_ids_count_the_ends_before_each_token():
    row = torch.tensor([[5, 6, EOT, 7, EOT, EOT, 8, 9]])
    assert document_ids(row, EOT).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]


VARIANTS = {
    "llama_gqa": dict(n_kv_heads=2),
    "gpt2_learned_positions": dict(pos_embedding="learned", norm="layernorm", mlp="gelu", bias=True,
                                   tie_embeddings=True),
    "palm_parallel_block": dict(parallel_block=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_documents_get_the_logits_they_get_alone(variant):
    torch.manual_seed(0)
    model = Transformer(tiny(**VARIANTS[variant])).eval()
    # Two rows with different boundaries: a one-token document, one of a single EOT, one cut off.
    rows = [documents([4, 1, 6, 0, 5], seed=1), documents([9, 3, 2, 3], seed=2)]
    packed = torch.stack([torch.cat(docs) for docs in rows])  # (2, 20)
    with torch.no_grad():
        logits = model(packed, document_ids=document_ids(packed, EOT))
        causal = model(packed)
        for r, docs in enumerate(rows):
            start = 0
            for doc in docs:
                alone = model(doc[None])[0]
                torch.testing.assert_close(logits[r, start:start + len(doc)], alone, rtol=0, atol=2e-6)
                start += len(doc)
    # Without document ids every token after the first document reads the ones before it.
    first = len(rows[0][0])
    assert torch.equal(causal[0, :first], logits[0, :first])
    assert (causal[0, first:] - logits[0, first:]).abs().max() > 1e-2


def test_the_key_is_checked_and_described():
    assert load_config(None, ["model.attention=document"]).model.attention == "document"
    assert load_config(None, []).model.attention == "causal"
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, ["model.attention=sliding"])
    with pytest.raises(ConfigError, match="model.attention"):
        Transformer(tiny(attention="sliding"))
    assert "  attention: 'causal' | 'document' = 'causal'" in describe_fields().splitlines()


def test_document_attention_needs_the_end_of_text_id():
    cfg = Config(model=tiny(attention="document"), train=TrainConfig(seq_len=16))
    world = World.current()
    with pytest.raises(ConfigError, match="model.attention=document.*eot_id"):
        build_model(lambda: Transformer(cfg.model), cfg, world, resolve_layout(cfg.parallel, cfg.model, 1, 16))


# Pipeline stages after the first never see the tokens: they get the document ids as keyword
# arguments. Five steps of each layout against one process, as tests/parallel/test_layouts.py.
STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 4, 8, 2, 16
LAYOUTS = {
    "pp2_1f1b": dict(pp=2, pp_schedule="1f1b"),
    "pp2_interleaved_1f1b": dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True, loss_parallel=True),
}


def layout_config(attention: str, **parallel) -> Config:
    model = tiny(n_layers=4, n_kv_heads=2, vocab_size=98, attention=attention)  # tp=2 splits the vocabulary
    return Config(model=model, optim=OptimConfig(lr=3e-3, grad_clip=0.5),
                  train=TrainConfig(seed=7, micro_batch_size=MICRO_BATCH, seq_len=SEQ_LEN),
                  parallel=dataclasses.replace(ParallelConfig(), **parallel))


def global_batch(step: int) -> torch.Tensor:
    """Random rows with an EOT at about every fifth token."""
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(0, EOT, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    return torch.where(torch.rand(rows.shape, generator=g) < 0.2, EOT, rows)


def layout_losses(cfg: Config) -> list[float]:
    """Training losses of STEPS steps, then an evaluation loss (every rank sees every row: dp is 1)."""
    world = World.current()
    model = build_model(lambda: Transformer(cfg.model), cfg, world,
                        resolve_layout(cfg.parallel, cfg.model, world.world_size, SEQ_LEN), eot_id=EOT)
    assert model.dp_size == 1
    optimizer = build_optimizer(model.parts, cfg.optim)
    losses = []
    for step in range(STEPS):
        losses.append(float(model.forward_backward(global_batch(step), MICRO_BATCH)))
        model.clip_grad_norm(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.train(False)
    losses.append(float(model.eval_loss(global_batch(STEPS), MICRO_BATCH)))
    return losses


def _all_layouts() -> dict[str, list[float]]:
    return {name: layout_losses(layout_config("document", **parallel)) for name, parallel in LAYOUTS.items()}


@pytest.mark.slow
def test_parallel_layouts_give_one_process_losses():
    reference = layout_losses(layout_config("document"))
    assert reference != pytest.approx(layout_losses(layout_config("causal")), rel=1e-3), \
        "the document mask changed nothing"
    for rank, per_layout in enumerate(run_distributed(_all_layouts, 2)):
        for name, losses in per_layout.items():
            assert losses == pytest.approx(reference, rel=1e-5), f"{name}, rank {rank}"


def test_a_run_trains_with_document_attention(tiny_dataset, tmp_path):
    from raylm.train.loop import train_local

    cfg = load_config(None, [
        f"data.path={tiny_dataset}", "data.loader=local", "data.chunk_rows=8", "model.attention=document",
        "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.steps=16", "train.eval_every=16",
        "train.eval_batches=2", "train.tensorboard=false", "optim.lr=1e-2", "schedule.warmup_steps=2",
        "schedule.min_lr=1e-3", "checkpoint.every_steps=0"])
    final = train_local(cfg, str(tmp_path))
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.5
    assert final["val_loss"] < rows[0]["loss"] - 1.5
    with open(tmp_path / "checkpoint_00000016" / "config.yaml") as f:
        assert "attention: document" in f.read()
