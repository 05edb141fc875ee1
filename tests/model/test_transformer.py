"""The plain-PyTorch Transformer: causality, shapes, init, meta build, pipeline splits, dropout."""

import copy
import dataclasses
import itertools
import math

import pytest
import torch

from raylm.config import ModelConfig
from raylm.model.sizes import ffn_hidden_size
from raylm.model.transformer import Transformer, apply_rope, rope_cache

torch.set_num_threads(1)

VOCAB = 97


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{"d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": VOCAB,
                          "max_seq_len": 16, "ffn_multiple": 16, **overrides})


def tokens(B: int = 2, T: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


VARIANTS = [
    dict(pos_embedding=pos, parallel_block=par, n_kv_heads=kv, norm=norm, mlp=mlp, bias=bias)
    for pos, par, kv, (norm, mlp, bias) in itertools.product(
        ["rope", "learned"], [False, True], [None, 2, 1],
        [("rmsnorm", "swiglu", False), ("layernorm", "gelu", True)])
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_causal_and_shapes(variant):
    model = build(tiny(**variant))
    x = tokens()
    logits = model(x)
    assert logits.shape == (2, 12, VOCAB)
    t = 5
    changed = x.clone()
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    after = model(changed)
    assert torch.equal(after[:, :t], logits[:, :t]), "a later token changed earlier logits"
    assert not torch.allclose(after[:, t:], logits[:, t:]), "the changed token had no effect"


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(tiny(vocab_size=None))
    with pytest.raises(ValueError, match="n_kv_heads"):
        Transformer(tiny(n_kv_heads=3))
    with pytest.raises(ValueError, match="model.mlp"):
        Transformer(tiny(mlp="tanh"))
    with pytest.raises(ValueError, match="max_seq_len"):
        build(tiny())(tokens(T=17))


def test_structure_matches_the_parallelism_contract():
    model = build(tiny(parallel_block=True, mlp="swiglu"))
    assert list(model.layers.keys()) == ["0", "1"]
    block = model.layers["0"]
    assert block.ffn_norm is None and model.pos_embeddings is None
    names = {n for n, _ in model.named_parameters()}
    for part in ["attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "attention_norm"]:
        assert f"layers.0.{part}.weight" in names
    assert "rope_cache" not in model.state_dict(), "the RoPE cache must not be checkpointed"
    assert model.layers["0"].attention.wk.weight.shape == (32, 32)
    gqa = build(tiny(n_kv_heads=1))
    assert gqa.layers["0"].attention.wk.weight.shape == (8, 32)  # one kv head of dim 8


def test_ffn_hidden_size():
    assert ffn_hidden_size(ModelConfig(d_model=4096, mlp="swiglu", ffn_multiple=256)) == 11008  # LLaMA-7B
    assert ffn_hidden_size(ModelConfig(d_model=768, mlp="gelu")) == 3072
    assert ffn_hidden_size(ModelConfig(d_model=768, mlp="swiglu", ffn_hidden=1000)) == 1000


def test_tied_embeddings_share_storage():
    model = build(tiny(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in build(tiny()).parameters())


def test_init_std_and_constants():
    cfg = tiny(d_model=256, n_layers=4, n_heads=4, bias=True, norm="layernorm", mlp="gelu", init_std=0.02)
    model = build(cfg)
    resid = 0.02 / math.sqrt(2 * 4)
    block = model.layers["3"]
    for weight, std in [(block.attention.wo.weight, resid), (block.feed_forward.w2.weight, resid),
                        (block.attention.wq.weight, 0.02), (block.feed_forward.w1.weight, 0.02),
                        (model.tok_embeddings.weight, 0.02), (model.output.weight, 0.02)]:
        assert weight.mean().abs() < 0.1 * std
        assert weight.std().item() == pytest.approx(std, rel=0.03)
    assert torch.equal(block.attention.wo.bias, torch.zeros(256))
    assert torch.equal(block.attention_norm.weight, torch.ones(256))
    assert torch.equal(block.attention_norm.bias, torch.zeros(256))


@pytest.mark.parametrize("variant", [dict(), dict(pos_embedding="learned", tie_embeddings=True, bias=True)])
def test_meta_build_then_init_equals_a_normal_build(variant):
    cfg = tiny(**variant)
    reference = build(cfg, seed=3)
    torch.manual_seed(3)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.init_weights()
    model.eval()
    assert model.state_dict().keys() == reference.state_dict().keys()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    if cfg.pos_embedding == "rope":
        assert torch.equal(model.rope_cache, reference.rope_cache)
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model(tokens()), reference(tokens()))


def test_init_weights_is_deterministic_given_the_seed():
    a, b = build(tiny(), seed=1), build(tiny(), seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build(tiny(), seed=2)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


@pytest.mark.parametrize("variant", [dict(), dict(pos_embedding="learned", tie_embeddings=True)])
def test_pipeline_split_runs_on_hidden_states(variant):
    cfg = tiny(n_layers=3, **variant)
    full = build(cfg)
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    del first.layers["2"]
    first.norm, first.output = None, None
    last.tok_embeddings, last.pos_embeddings = None, None
    del last.layers["0"], last.layers["1"]
    x = tokens()
    hidden = first(x)
    assert hidden.shape == (2, 12, 32)
    assert torch.equal(last(hidden), full(x))
    assert list(last.layers.keys()) == ["2"]


def test_stage_without_token_embeddings_must_drop_positions():
    model = build(tiny(pos_embedding="learned"))
    model.tok_embeddings = None
    with pytest.raises(ValueError, match="pos_embeddings"):
        model(torch.randn(2, 4, 32))


def test_dropout_only_in_training():
    cfg = tiny(dropout=0.2)
    model, no_dropout = build(cfg), build(dataclasses.replace(cfg, dropout=0.0))
    x = tokens()
    assert torch.equal(model(x), model(x))
    assert torch.equal(model(x), no_dropout(x))
    model.train()
    assert not torch.equal(model(x), model(x))
    no_dropout.train()
    assert torch.equal(no_dropout(x), no_dropout(x))


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build(tiny(n_kv_heads=2))
    mha = build(tiny())
    for name, param in mha.named_parameters():  # everything but wk, wv has the same shape...
        source = gqa.get_parameter(name)
        if param.shape == source.shape:
            param.data.copy_(source)
    for layer_mha, layer_gqa in zip(mha.layers.values(), gqa.layers.values()):
        for proj in ("wk", "wv"):  # ...and kv head j serves query heads 2j and 2j+1
            w = getattr(layer_gqa.attention, proj).weight.view(2, 8, 32)  # (Hkv, hd, d)
            getattr(layer_mha.attention, proj).weight.data.copy_(w.repeat_interleave(2, dim=0).reshape(32, 32))
    torch.testing.assert_close(mha(tokens()), gqa(tokens()))


def test_rope_encodes_relative_position():
    cache = rope_cache(32, 8, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m: int, n: int) -> torch.Tensor:
        return (apply_rope(q, cache[m:m + 1]) * apply_rope(k, cache[n:n + 1])).sum()

    torch.testing.assert_close(score(3, 1), score(20, 18))
    assert not torch.allclose(score(3, 1), score(3, 2))
    torch.testing.assert_close(apply_rope(q, cache[:1]), q)  # position 0 is the identity


def test_backward_reaches_every_parameter():
    model = build(tiny(pos_embedding="learned", bias=True, norm="layernorm", mlp="relu")).train()
    logits = model(tokens())
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens(seed=1).flatten()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
