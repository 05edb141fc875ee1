"""A GPT-class decoder in plain PyTorch.

The model knows nothing of parallelism: FSDP2, tensor parallel and pipeline stages are applied
from outside (`raylm.parallel`), torchtitan style. The module names below are therefore a
contract that those plans rely on:

    Transformer
      tok_embeddings   nn.Embedding(vocab, d) | None
      pos_embeddings   nn.Embedding(max_seq_len, d) | None    (learned positions only)
      dropout          embedding dropout
      layers           ModuleDict "0".."n-1" -> TransformerBlock (names survive pipeline splits)
        attention_norm, attention (wq wk wv wo), ffn_norm (None in a parallel block),
        feed_forward (w1 w2 [w3]), dropout (residual dropout)
      norm             final norm | None
      output           nn.Linear(d, vocab, bias=False) | None; tied: output.weight IS tok_embeddings.weight

A pipeline stage deletes what it does not own (`tok_embeddings = None`, `del layers["3"]`,
`norm = None`, `output = None`); `forward` then takes and/or returns hidden states.
The loss is computed outside, so loss-parallel can wrap it.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

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
               "mlp": ("swiglu", "gelu", "relu")}
    for name, valid in choices.items():
        if getattr(cfg, name) not in valid:
            raise ConfigError(f"model.{name} must be one of {valid}, got {getattr(cfg, name)!r}")
    for name in ("d_model", "n_layers", "n_heads", "max_seq_len"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"model.{name} must be positive, got {getattr(cfg, name)}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"model.d_model ({cfg.d_model}) must be divisible by model.n_heads ({cfg.n_heads})")
    n_kv = cfg.n_kv_heads or cfg.n_heads
    if cfg.n_heads % n_kv:
        raise ConfigError(f"model.n_kv_heads ({n_kv}) must divide model.n_heads ({cfg.n_heads})")
    if cfg.pos_embedding == "rope" and (cfg.d_model // cfg.n_heads) % 2:
        raise ConfigError(f"RoPE needs an even head dimension, got d_model/n_heads = {cfg.d_model // cfg.n_heads}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.dropout}")


def embeddings_tied(model: nn.Module) -> bool:
    """Whether the head's weight IS the token embedding's (a part that holds both)."""
    return (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)


def build_norm(cfg: ModelConfig) -> Union[nn.RMSNorm, nn.LayerNorm]:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_cache(seq_len: int, head_dim: int, theta: float, device: Optional[torch.device] = None) -> torch.Tensor:
    """cos and sin of position * frequency, (seq_len, head_dim): [cos | sin], head_dim/2 each.

    Kept real (not complex like LLaMA's freqs_cis) so the buffer works on every device and dtype path.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)  # (T, hd/2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)  # (T, hd)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of x (B, T, H, hd) by angle position * freq_i (LLaMA layout)."""
    cos, sin = cache.chunk(2, dim=-1)  # (T, hd/2) each
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, hd/2)
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, H, hd/2) each; rotate in fp32
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (B, T, H, hd/2, 2)
    return rotated.flatten(-2).type_as(x)


def _init_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query (GQA) and multi-query (MQA) variants."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.dropout_p = cfg.dropout
        d, hd = cfg.d_model, self.head_dim
        self.wq = nn.Linear(d, cfg.n_heads * hd, bias=cfg.bias)
        self.wk = nn.Linear(d, n_kv_heads * hd, bias=cfg.bias)
        self.wv = nn.Linear(d, n_kv_heads * hd, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * hd, d, bias=cfg.bias)

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: tensor parallel gives this rank a slice of the heads, so count them from shapes.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, hd)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:  # query head i reads kv head i // n_rep; a TP shard keeps whole groups
            k = k.repeat_interleave(n_rep, dim=2)  # (B, T, H, hd)
            v = v.repeat_interleave(n_rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_p if self.training else 0.0, is_causal=True)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*hd)
        return self.wo(y)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _init_linear(linear, std)
        _init_linear(self.wo, out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); GELU/ReLU: w2(act(w1 x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = ffn_hidden_size(cfg)
        self.activation = cfg.mlp
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)  # gate (swiglu) or up projection
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)  # down projection
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias) if cfg.mlp == "swiglu" else None  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, d)
        act = F.gelu if self.activation == "gelu" else F.relu
        return self.w2(act(self.w1(x)))  # (B, T, d)

    def init_weights(self, std: float, out_std: float) -> None:
        _init_linear(self.w1, std)
        if self.w3 is not None:
            _init_linear(self.w3, std)
        _init_linear(self.w2, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block; with `parallel_block`, PaLM's x + attn(norm(x)) + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.parallel_block = cfg.parallel_block
        self.attention_norm = build_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = None if cfg.parallel_block else build_norm(cfg)
        self.feed_forward = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)  # residual dropout on each branch's output

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor]) -> torch.Tensor:
        h = self.attention_norm(x)  # (B, T, d)
        if self.parallel_block:  # one norm feeds both branches, so their matmuls can run together
            return x + self.dropout(self.attention(h, rope)) + self.dropout(self.feed_forward(h))
        x = x + self.dropout(self.attention(h, rope))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))

    def init_weights(self, std: float, out_std: float) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            if norm is not None:
                norm.reset_parameters()  # weight 1, bias 0
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)


class Transformer(nn.Module):
    """Decoder-only language model: tokens (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_model_config(cfg)
        self.cfg = cfg
        d = cfg.d_model
        # Every weight is set again by init_weights(); fork the CPU RNG so the modules' default
        # initialisation does not consume it, and a seeded build equals meta + to_empty + init_weights.
        with torch.random.fork_rng(devices=[]):
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, d)
            learned = cfg.pos_embedding == "learned"
            self.pos_embeddings = nn.Embedding(cfg.max_seq_len, d) if learned else None
            self.dropout = nn.Dropout(cfg.dropout)
            self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
            self.norm = build_norm(cfg)
            self.output = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not saved in checkpoints: a pure function of the config, rebuilt by init_weights().
        self.register_buffer("rope_cache", None, persistent=False)
        self.init_weights()

    def init_weights(self, buffer_device: Optional[Union[torch.device, str]] = None) -> None:
        """(Re)initialise every parameter and buffer this model (or pipeline stage) holds.

        GPT-2/Megatron: normal(0, init_std) for linears and embeddings; the projections that
        write into the residual stream (attention.wo, feed_forward.w2) get init_std / sqrt(2 n_layers)
        so the residual's variance does not grow with depth; biases 0, norm weights 1.
        Materialise a meta-device model with `model.to_empty(device=...)` then this; the RoPE
        buffer is rebuilt on `buffer_device`, else where it lives now.
        """
        cfg = self.cfg
        if cfg.pos_embedding == "rope":
            device = buffer_device or (self.rope_cache.device if self.rope_cache is not None else None)
            self.rope_cache = rope_cache(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta, device)
        tied = cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None
        if tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight  # to_empty() from meta unties them
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for embedding in (self.tok_embeddings, self.pos_embeddings):
            if embedding is not None:
                nn.init.normal_(embedding.weight, mean=0.0, std=std)
        for layer in self.layers.values():
            layer.init_weights(std, out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not tied:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) ids -> logits (B, T, vocab).

        A pipeline stage without tok_embeddings takes hidden states (B, T, d) instead, and one
        without output returns hidden states. Positions are 0..T-1.
        """
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len ({self.cfg.max_seq_len})")
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)  # (B, T, d)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(torch.arange(T, device=tokens.device))  # (T, d) broadcast over B
            h = self.dropout(h)
        elif self.pos_embeddings is not None:
            raise ValueError("pos_embeddings is set but tok_embeddings is None: a pipeline stage that "
                             "does not embed tokens must drop pos_embeddings too")
        else:
            h = tokens  # hidden states from the previous pipeline stage, (B, T, d)
        rope = self.rope_cache[:T] if self.rope_cache is not None else None  # (T, hd)
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)  # (B, T, vocab)
        return h
