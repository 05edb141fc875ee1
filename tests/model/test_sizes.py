"""Named sizes and the closed-form parameter and FLOP counts, checked against built models."""

import dataclasses
import itertools

import pytest
import torch
import torch.nn as nn

from raylm.config import ConfigError, ModelConfig, config_from_dict
from raylm.train.spec import check_config
from raylm.config.presets import MODEL_SIZES, preset
from raylm.model.sizes import count_params, flops_per_token
from raylm.model.transformer import Transformer

torch.set_num_threads(1)

GRID = [
    ModelConfig(d_model=24, n_layers=2, n_heads=4, n_kv_heads=kv, vocab_size=37, max_seq_len=8,
                ffn_multiple=16, norm=norm, mlp=mlp, pos_embedding=pos, tie_embeddings=tie,
                bias=bias, parallel_block=parallel)
    for norm, mlp, pos, tie, bias, kv, parallel in itertools.product(
        ["rmsnorm", "layernorm"], ["swiglu", "gelu", "relu"], ["rope", "learned"],
        [False, True], [False, True], [None, 2, 1], [False, True])
]


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def on_meta(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu", "relu"])
def test_count_params_equals_the_built_model(mlp):
    for cfg in (c for c in GRID if c.mlp == mlp):
        model = on_meta(cfg)
        assert count_params(cfg) == numel(model), cfg
        embeddings = model.tok_embeddings.weight.numel()
        embeddings += model.pos_embeddings.weight.numel() if model.pos_embeddings is not None else 0
        embeddings += 0 if cfg.tie_embeddings else model.output.weight.numel()
        assert count_params(cfg, exclude_embeddings=True) == numel(model) - embeddings, cfg


def test_explicit_ffn_hidden_is_counted():
    cfg = dataclasses.replace(GRID[0], ffn_hidden=40)
    assert count_params(cfg) == numel(on_meta(cfg))


def test_gpt2_small_has_nanogpts_124_439_808_parameters():
    gpt2 = ModelConfig(d_model=768, n_layers=12, n_heads=12, vocab_size=50257, max_seq_len=1024,
                       pos_embedding="learned", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)
    assert count_params(gpt2) == 124_439_808
    assert count_params(ModelConfig(**preset("gpt2"), vocab_size=50257)) == 124_439_808


def test_llama_1b_matches_llama_3_2_1b():
    assert count_params(ModelConfig(**preset("llama-1b"), vocab_size=128256)) == 1_235_814_400


@pytest.mark.parametrize("name,nominal,tolerance", [
    ("125m", 125e6, 0.01), ("350m", 350e6, 0.03), ("1.3b", 1.3e9, 0.02), ("2.7b", 2.7e9, 0.02),
    ("6.7b", 6.7e9, 0.01), ("13b", 13e9, 0.02), ("30b", 30e9, 0.01), ("66b", 66e9, 0.01),
    ("175b", 175e9, 0.01),
])
def test_opt_sizes_match_their_names(name, nominal, tolerance):
    cfg = ModelConfig(**preset(name), vocab_size=50272)  # OPT's vocabulary
    assert count_params(cfg) == pytest.approx(nominal, rel=tolerance)


@pytest.mark.parametrize("name", list(MODEL_SIZES))
def test_every_size_builds_and_is_counted_exactly(name):
    full = config_from_dict({"model": {"size": name}})
    check_config(full)  # every named size passes the model's shape rules
    cfg = full.model
    cfg = dataclasses.replace(cfg, vocab_size=1000)
    model = on_meta(cfg)
    assert count_params(cfg) == numel(model)
    assert flops_per_token(cfg, cfg.max_seq_len) == independent_flops(model, cfg.max_seq_len)


def test_unknown_size_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="valid sizes: tiny, mini"):
        preset("huge")


@pytest.mark.parametrize("key, value", [("init_std", -1.0), ("init_std", 0.0), ("rope_theta", -5.0), ("norm_eps", -1.0),
                                        ("n_kv_heads", -2), ("n_kv_heads", 0), ("ffn_hidden", -1), ("ffn_multiple", 0),
                                        ("vocab_multiple", 0), ("dropout", 1.5)])
def test_a_model_value_no_rank_could_train_with_is_refused_naming_its_key(key, value):
    # Each reached the workers, which failed on every rank and each of Ray's restarts (init_std -1:
    # "normal expects std >= 0.0"), divided by it, or trained on NaNs (rope_theta -5).
    with pytest.raises(ConfigError, match=rf"^model\.{key} must be"):
        check_config(config_from_dict({"model": {key: value}}))


def test_values_a_model_trains_with_pass():
    # Zero where a model trains with it, as checkpoints of earlier versions were: an RMSNorm without
    # epsilon, an attention-only model; rope_theta unused without RoPE; null optionals.
    check_config(config_from_dict({"model": {"norm_eps": 0.0, "ffn_hidden": 0}}))
    check_config(config_from_dict({"model": {"pos_embedding": "learned", "rope_theta": -5.0}}))
    check_config(config_from_dict({"model": {"n_kv_heads": None, "ffn_hidden": None}}))


def test_size_values_are_defaults_under_explicit_keys():
    cfg = config_from_dict({"model": {"size": "tiny", "n_layers": 3}}).model
    assert (cfg.d_model, cfg.n_layers) == (64, 3)


def test_count_needs_a_vocab_unless_excluding_embeddings():
    cfg = ModelConfig(**preset("mini"))
    with pytest.raises(ValueError, match="vocab_size"):
        count_params(cfg)
    assert count_params(cfg, exclude_embeddings=True) > 0


def independent_flops(model: Transformer, seq_len: int) -> float:
    """6 FLOPs per weight-matrix entry that multiplies activations, plus attention scores."""
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    cfg = model.cfg
    return 6.0 * matmul + 12.0 * cfg.n_layers * cfg.d_model * seq_len


def test_flops_per_token_counts_every_linear_once_tied_head_included():
    for cfg in GRID[::7]:
        assert flops_per_token(cfg, 8) == independent_flops(on_meta(cfg), 8), cfg


def test_flops_per_token_agrees_with_nanogpt_estimate_mfu():
    # nanoGPT: N = get_num_params() = 123,653,376 for GPT-2 small (biases and norms included,
    # position embeddings not); flops_per_token = 6N + 12 L H Q T.
    cfg = ModelConfig(**preset("gpt2"), vocab_size=50257)
    nanogpt = 6 * 123_653_376 + 12 * 12 * 12 * 64 * 1024
    assert flops_per_token(cfg, 1024) == pytest.approx(nanogpt, rel=1e-3)


def test_flops_per_token_agrees_with_gpt3_training_compute():
    # GPT-3 paper, table D.1: 175B trained on 300B tokens took 3.14e23 FLOPs (6N per token,
    # attention scores left out).
    cfg = ModelConfig(**preset("175b"), vocab_size=50257)
    attention = 12 * cfg.n_layers * cfg.d_model * 2048
    assert (flops_per_token(cfg, 2048) - attention) * 300e9 == pytest.approx(3.14e23, rel=0.01)
