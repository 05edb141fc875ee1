"""Named model sizes: the values a `model.size` key stands for (explicit keys beside it win).

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

from raylm.errors import ConfigError

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
