"""The shape of `Transformer(cfg)` without building it: the rules a ModelConfig must satisfy, the
MLP width, and closed-form parameter and FLOP counts (see raylm.config.presets for named sizes).
No torch here: the driver checks a run's config before any process imports it."""

from __future__ import annotations

import math

from raylm.config import ConfigError, ModelConfig


def ffn_hidden_size(cfg: ModelConfig) -> int:
    """MLP width: `ffn_hidden` if set; else 4*d (gelu, relu) or LLaMA's SwiGLU width.

    SwiGLU has three matrices instead of two, so LLaMA shrinks the width to 2/3 * 4d to keep the
    parameter count, then rounds up to `ffn_multiple` for fast matmuls: d=4096 gives 11008.
    """
    if cfg.ffn_hidden is not None:
        return cfg.ffn_hidden
    if cfg.mlp != "swiglu":
        return 4 * cfg.d_model
    hidden = 8 * cfg.d_model // 3  # int(2 * 4d / 3), as in LLaMA
    return cfg.ffn_multiple * math.ceil(hidden / cfg.ffn_multiple)


def check_model_config(cfg: ModelConfig, need_vocab: bool = True) -> None:
    """Errors for a ModelConfig no Transformer can be built from (naming the field). Config
    loading runs it too, before the dataset has supplied the vocabulary (`need_vocab=False`)."""
    if need_vocab and (not isinstance(cfg.vocab_size, int) or cfg.vocab_size <= 0):
        raise ConfigError(f"model.vocab_size must be a positive int to build a model, got {cfg.vocab_size!r} "
                          "(None is filled in from the prepared dataset)")
    choices = {"norm": ("rmsnorm", "layernorm"), "pos_embedding": ("rope", "learned"),
               "mlp": ("swiglu", "gelu", "relu"), "attention": ("causal", "document"),
               "parametrization": ("standard", "mup")}
    for name, valid in choices.items():
        if getattr(cfg, name) not in valid:
            raise ConfigError(f"model.{name} must be one of {valid}, got {getattr(cfg, name)!r}")
    # Each of these reached the workers, where torch failed on every rank, and each of Ray's
    # restarts failed the same way (a negative init_std), or trained on NaNs (a negative rope_theta).
    # Zero stays allowed where a model trains with it: norm_eps, and ffn_hidden (attention only).
    positive = ("d_model", "n_layers", "n_heads", "max_seq_len", "vocab_multiple", "ffn_multiple", "n_kv_heads",
                "init_std", "mup_output_multiplier", *(("rope_theta",) if cfg.pos_embedding == "rope" else ()))
    for name in positive + ("ffn_hidden", "norm_eps"):
        value = getattr(cfg, name)
        if value is not None and not (value > 0 if name in positive else value >= 0):
            rule = "positive" if name in positive else "at least 0"
            raise ConfigError(f"model.{name} must be {rule}, got {value}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"model.d_model ({cfg.d_model}) must be divisible by model.n_heads ({cfg.n_heads})")
    n_kv = cfg.n_kv_heads or cfg.n_heads
    if cfg.n_heads % n_kv:
        raise ConfigError(f"model.n_kv_heads ({n_kv}) must divide model.n_heads ({cfg.n_heads})")
    if cfg.pos_embedding == "rope" and (cfg.d_model // cfg.n_heads) % 2:
        raise ConfigError(f"RoPE needs an even head dimension, got d_model/n_heads = {cfg.d_model // cfg.n_heads}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.parametrization == "mup" and not (isinstance(cfg.mup_base_width, int) and cfg.mup_base_width > 0):
        raise ConfigError(f"model.parametrization=mup needs model.mup_base_width, the d_model at which the LR and "
                          f"init were tuned (a positive int), got {cfg.mup_base_width!r}")
    if cfg.parametrization != "mup":  # set alone, a µP field would leave a standard model that looks µP
        for name, unset in (("mup_base_width", None), ("mup_base_head_dim", None), ("mup_output_multiplier", 1.0)):
            if getattr(cfg, name) != unset:
                raise ConfigError(f"model.{name}={getattr(cfg, name)} is µP's: it needs model.parametrization=mup "
                                  "(the standard parametrization has no base width nor output multiplier)")
    if cfg.mup_base_head_dim is not None and not (isinstance(cfg.mup_base_head_dim, int) and cfg.mup_base_head_dim > 0):
        raise ConfigError(f"model.mup_base_head_dim must be a positive int (the base model's head size), got "
                          f"{cfg.mup_base_head_dim!r}")


def _norm_params(cfg: ModelConfig) -> int:
    return cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def _matmul_params_per_layer(cfg: ModelConfig) -> int:
    """Weight-matrix entries of one block: attention (with GQA's narrower k, v) and MLP."""
    d, head_dim = cfg.d_model, cfg.d_model // cfg.n_heads
    q_width, kv_width = cfg.n_heads * head_dim, (cfg.n_kv_heads or cfg.n_heads) * head_dim
    attention = d * q_width + 2 * d * kv_width + q_width * d  # wq, wk, wv, wo
    mlp_in = 2 if cfg.mlp == "swiglu" else 1  # swiglu has a gate (w1) and an up (w3) projection
    return attention + (mlp_in + 1) * d * ffn_hidden_size(cfg)


def _bias_params_per_layer(cfg: ModelConfig) -> int:
    if not cfg.bias:
        return 0
    d, head_dim = cfg.d_model, cfg.d_model // cfg.n_heads
    q_width, kv_width = cfg.n_heads * head_dim, (cfg.n_kv_heads or cfg.n_heads) * head_dim
    mlp_in = 2 if cfg.mlp == "swiglu" else 1
    return q_width + 2 * kv_width + d + mlp_in * ffn_hidden_size(cfg) + d


def _need_vocab(cfg: ModelConfig) -> int:
    if not isinstance(cfg.vocab_size, int) or cfg.vocab_size <= 0:
        raise ValueError(f"model.vocab_size must be set to count embeddings, got {cfg.vocab_size!r}")
    return cfg.vocab_size


def count_params(cfg: ModelConfig, exclude_embeddings: bool = False) -> int:
    """Exact number of distinct parameters of `Transformer(cfg)` (a tied head counts once).

    exclude_embeddings=True leaves out the token and position embeddings and an untied output
    head (Kaplan et al.'s non-embedding count); it needs no vocab_size.
    """
    norms_per_layer = 1 if cfg.parallel_block else 2
    per_layer = _matmul_params_per_layer(cfg) + _bias_params_per_layer(cfg) + norms_per_layer * _norm_params(cfg)
    total = cfg.n_layers * per_layer + _norm_params(cfg)  # blocks + final norm
    if exclude_embeddings:
        return total
    vocab = _need_vocab(cfg)
    total += vocab * cfg.d_model
    if cfg.pos_embedding == "learned":
        total += cfg.max_seq_len * cfg.d_model
    if not cfg.tie_embeddings:
        total += cfg.d_model * vocab
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 * N_matmul + 12 * n_layers * d_model * seq_len.

    N_matmul counts the weight-matrix entries of the blocks plus the output head (d * vocab,
    tied or not: the matmul is done either way); embedding lookups, biases, norms and softmax are
    left out. Each weight entry costs 2 FLOPs forward (multiply, add) and 4 backward (gradients of
    input and weight). The second term is the attention-score matmuls QK^T and AV (2 * 2 * T * d
    per token per layer forward, times 3), counted over the full T x T square as PaLM (appendix B)
    and nanoGPT's estimate_mfu do, although causal masking makes half of it redundant. This is
    the numerator of MFU.
    """
    matmul_params = cfg.n_layers * _matmul_params_per_layer(cfg) + cfg.d_model * _need_vocab(cfg)
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len
