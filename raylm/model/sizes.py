"""Named model sizes, and closed-form parameter and FLOP counts.

Sizes leave `vocab_size` unset: the tokenizer of the prepared dataset decides it. The published
parameter counts quoted below assume the original vocabularies (OPT and GPT-2: 50272 and 50257,
LLaMA 3: 128256).

- `tiny`, `mini`, `10m`: LLaMA-style models for tests and CPU runs.
- `gpt2`: GPT-2 small as in nanoGPT (124M with vocab 50257), for reproductions.
- `125m` .. `175b`: the OPT family (Zhang et al. 2022, table 1), the open replica of GPT-3's
  shapes: pre-LayerNorm, learned positions, ReLU MLP of 4d, biases, tied embeddings, 2048
  context, Megatron init std 0.006. Deviations from OPT: no dropout by default (OPT used 0.1;
  set model.dropout=0.1 to match), 2048 position rows (OPT's checkpoints carry 2 spare ones),
  and 350m uses the same uniform pre-LN shape as the others (OPT-350m projected its embeddings
  from 512 and used post-LN).
- `llama-1b`: the shape of Llama 3.2 1B (GQA 32/8, SwiGLU 8192, RoPE theta 5e5, tied), for GPU
  MFU benchmarks; 2048 context.
"""

from __future__ import annotations

from raylm.config import ConfigError, ModelConfig
from raylm.model.transformer import ffn_hidden_size

_LLAMA = dict(norm="rmsnorm", pos_embedding="rope", mlp="swiglu", bias=False, parallel_block=False,
              tie_embeddings=False, init_std=0.02)
_GPT2 = dict(norm="layernorm", pos_embedding="learned", mlp="gelu", bias=True, parallel_block=False,
             tie_embeddings=True, init_std=0.02)
_OPT = dict(_GPT2, mlp="relu", max_seq_len=2048, init_std=0.006)


def _opt(d_model: int, n_layers: int, n_heads: int) -> dict:
    return dict(_OPT, d_model=d_model, n_layers=n_layers, n_heads=n_heads)


MODEL_SIZES: dict[str, dict] = {
    # Non-embedding parameters in comments; OPT sizes are named by total parameters.
    "tiny": dict(_LLAMA, d_model=64, n_layers=2, n_heads=4, max_seq_len=256),  # 0.1M
    "mini": dict(_LLAMA, d_model=128, n_layers=4, n_heads=4, max_seq_len=256),  # 0.85M
    "10m": dict(_LLAMA, d_model=384, n_layers=6, n_heads=6, max_seq_len=256),  # 10.6M: nanoGPT's shakespeare_char shape
    "gpt2": dict(_GPT2, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "125m": _opt(768, 12, 12),
    "350m": _opt(1024, 24, 16),
    "1.3b": _opt(2048, 24, 32),
    "2.7b": _opt(2560, 32, 32),
    "6.7b": _opt(4096, 32, 32),
    "13b": _opt(5120, 40, 40),
    "30b": _opt(7168, 48, 56),
    "66b": _opt(9216, 64, 72),
    "175b": _opt(12288, 96, 96),
    "llama-1b": dict(_LLAMA, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                     rope_theta=500000.0, tie_embeddings=True, max_seq_len=2048),
}


def preset(name: str) -> dict:
    """ModelConfig field values of the named size (a fresh dict)."""
    if name not in MODEL_SIZES:
        raise ConfigError(f"model.size: unknown size {name!r}; valid sizes: {', '.join(MODEL_SIZES)}")
    return dict(MODEL_SIZES[name])


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
