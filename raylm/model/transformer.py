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

Initialisation is a rule per parameter name (`param_init`), and its random values are a pure
function of (seed, name, rows): a model built on the meta device, split and sharded, then
materialised shard by shard (`raylm.parallel.init`) starts from the same weights as
`Transformer(cfg)` built whole.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from raylm.config import ModelConfig
from raylm.model import mup
from raylm.model.sizes import check_model_config, ffn_hidden_size


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
    """Rotate each pair (x[2i], x[2i+1]) of x (B, T, H, hd) by angle position * freq_i (LLaMA layout).

    `cache` holds the rows of x's positions: (T, hd), the same for every sequence, or (B, T, hd).
    """
    cos, sin = cache.chunk(2, dim=-1)  # (T, hd/2) or (B, T, hd/2) each
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, H, hd/2) each; rotate in fp32
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (B, T, H, hd/2, 2)
    return rotated.flatten(-2).type_as(x)


def document_ids(tokens: torch.Tensor, end_id: int) -> torch.Tensor:
    """The document of each token of packed rows (B, T) whose documents end with (and include) the
    token `end_id`: the count of ends before it. A row's first tokens, the rest of a document
    begun in an earlier row, are a document of their own."""
    ends = (tokens == end_id).long()
    return ends.cumsum(dim=1) - ends


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (B, T): 0 where the id changes, counting up
    from there; a document's tokens must be contiguous."""
    T = document_ids.shape[1]
    index = torch.arange(T, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask (B, 1, T, T), True where query t may attend to key s: s <= t, same document."""
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


# Random initial values come in blocks of whole rows (dim 0) of about this many values, each
# block from its own generator: a rank draws only the blocks its shard's rows fall in.
_BLOCK_NUMEL = 1 << 20


def _stream_seed(seed: int, key: str, block: int) -> int:
    """A generator seed for block `block` of parameter `key` (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{seed}/{key}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits


@dataclass(frozen=True)
class ParamInit:
    """How one parameter starts: normal(0, std) drawn from the stream named `key`, or a constant."""

    kind: Literal["normal", "zeros", "ones"]
    key: str
    std: float = 0.0

    def draw(self, shape: tuple[int, ...], seed: int, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows `rows` (indices into dim 0; all by default) of the initial value, fp32 on CPU.

        Each block of rows (about `_BLOCK_NUMEL` values) is drawn whole from a generator seeded by
        (seed, key, block index), so a row's values depend neither on which other rows are asked for nor on
        the order parameters are visited: a shard equals the same slice of the whole tensor.
        """
        n = shape[0]
        rows = torch.arange(n) if rows is None else rows
        out_shape = (len(rows), *shape[1:])
        if self.kind != "normal":
            return torch.zeros(out_shape) if self.kind == "zeros" else torch.ones(out_shape)
        per_block = max(1, _BLOCK_NUMEL // max(1, math.prod(shape[1:])))
        out = torch.empty(out_shape)
        blocks = rows // per_block
        for b in torch.unique(blocks).tolist():
            start = b * per_block
            values = torch.empty((min(per_block, n - start), *shape[1:]))
            values.normal_(0.0, self.std, generator=torch.Generator().manual_seed(_stream_seed(seed, self.key, b)))
            take = (blocks == b).nonzero().squeeze(1)
            out[take] = values[rows[take] - start]
        return out


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query (GQA) and multi-query (MQA) variants, over
    the whole sequence or, given a `document_mask`, within each document."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.dropout_p = cfg.dropout
        self.scale = mup.attention_scale(cfg)  # None: SDPA's 1/sqrt(head_dim)
        d, hd = cfg.d_model, self.head_dim
        self.wq = nn.Linear(d, cfg.n_heads * hd, bias=cfg.bias)
        self.wk = nn.Linear(d, n_kv_heads * hd, bias=cfg.bias)
        self.wv = nn.Linear(d, n_kv_heads * hd, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * hd, d, bias=cfg.bias)

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> torch.Tensor:
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
        # A boolean mask rather than flex_attention: torch 2.13 has no flex_attention backward on
        # CPU, where SDPA's fused kernel takes the mask (a step costs 1.11x a causal one,
        # benchmarks/RESULTS.md); on CUDA a mask moves SDPA from flash to memory-efficient attention.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=mask is None, scale=self.scale)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*hd)
        return self.wo(y)


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

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> torch.Tensor:
        h = self.attention_norm(x)  # (B, T, d)
        if self.parallel_block:  # one norm feeds both branches, so their matmuls can run together
            return x + self.dropout(self.attention(h, rope, mask)) + self.dropout(self.feed_forward(h))
        x = x + self.dropout(self.attention(h, rope, mask))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    """Decoder-only language model: tokens (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig, seed: Optional[int] = None):
        """Built whole and initialised from `seed` (see `init_weights`); built inside
        `with torch.device("meta")`, only shapes: materialise with `to_empty` + `init_weights`,
        or shard by shard with `raylm.parallel.init.materialize`."""
        super().__init__()
        check_model_config(cfg)
        self.cfg = cfg
        self.logit_multiplier = mup.output_multiplier(cfg)  # 1 but under µP
        d = cfg.d_model
        # Every weight is set again by init_weights(); fork the CPU RNG so the modules' default
        # initialisation leaves the caller's random stream as it was.
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
        # Not saved in checkpoints: a pure function of the config, rebuilt by reset_buffers().
        self.register_buffer("rope_cache", None, persistent=False)
        if self.tok_embeddings.weight.is_meta:
            self.reset_buffers()  # a meta table, so that to_empty() gives it its place
        else:
            self.init_weights(seed)

    def param_init(self, name: str) -> ParamInit:
        """The rule for parameter `name`, a name of the whole model (pipeline stages, FSDP2 and
        tensor parallelism keep them).

        GPT-2/Megatron: normal(0, init_std) for linears and embeddings; the projections that
        write into the residual stream (attention.wo, feed_forward.w2) get init_std / sqrt(2 n_layers)
        so the residual's variance does not grow with depth; biases 0, norm weights 1. A tied
        head draws its embedding's values. Under µP the blocks' matrices start narrower as the
        width grows (`raylm.model.mup`).
        """
        cfg = self.cfg
        module, _, leaf = name.rpartition(".")
        owner = module.rpartition(".")[2]
        if leaf == "bias":
            return ParamInit("zeros", name)
        if owner in ("attention_norm", "ffn_norm", "norm"):
            return ParamInit("ones", name)
        hidden = mup.hidden_init_scale(cfg)  # 1 but under µP, where it falls with the width
        if owner in ("wo", "w2"):
            return ParamInit("normal", name, hidden * cfg.init_std / math.sqrt(2 * cfg.n_layers))
        if owner in ("wq", "wk", "wv", "w1", "w3"):
            return ParamInit("normal", name, hidden * cfg.init_std)
        if owner == "output" and cfg.tie_embeddings:
            return ParamInit("normal", "tok_embeddings.weight", cfg.init_std)
        if owner in ("tok_embeddings", "pos_embeddings", "output"):
            return ParamInit("normal", name, cfg.init_std)
        raise ValueError(f"Transformer.param_init has no rule for parameter {name!r}")

    def reset_buffers(self, device: Optional[Union[torch.device, str]] = None) -> None:
        """Rebuild what is not a trained tensor: the RoPE table, on `device` (else where it lives
        now), and the head's tie to the embedding, which `to_empty()` from meta undoes."""
        cfg = self.cfg
        if cfg.pos_embedding == "rope":
            device = device or (self.rope_cache.device if self.rope_cache is not None else None)
            self.rope_cache = rope_cache(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta, device)
        tied = cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None
        if tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None, buffer_device: Optional[Union[torch.device, str]] = None) -> None:
        """(Re)initialise every parameter (by `param_init`, from `seed`) and buffer this model or
        pipeline stage holds. `seed` defaults to `torch.initial_seed()`, the last
        `torch.manual_seed`. The RoPE buffer is rebuilt on `buffer_device`, else where it lives now.
        """
        self.reset_buffers(buffer_device)
        seed = torch.initial_seed() if seed is None else seed
        for name, param in self.named_parameters():
            param.copy_(self.param_init(name).draw(tuple(param.shape), seed))

    def forward(self, tokens: torch.Tensor, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens (B, T) ids -> logits (B, T, vocab).

        A pipeline stage without tok_embeddings takes hidden states (B, T, d) instead, and one
        without output returns hidden states (every stage is given the same `document_ids`).
        Without `document_ids` a row is one sequence: positions 0..T-1, each token attending to
        every earlier one. With them (B, T; see `document_ids()`), a token attends only to earlier
        tokens of its own document and positions restart at each document's first token, so a
        packed document gets the logits it would get alone.
        """
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len ({self.cfg.max_seq_len})")
        if document_ids is None:
            positions, mask = torch.arange(T, device=tokens.device), None  # (T,): the same for every row
        else:
            positions, mask = document_positions(document_ids), document_mask(document_ids)  # (B, T), (B, 1, T, T)
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)  # (B, T, d)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(positions)  # (T, d) broadcast over B, or (B, T, d)
            h = self.dropout(h)
        elif self.pos_embeddings is not None:
            raise ValueError("pos_embeddings is set but tok_embeddings is None: a pipeline stage that "
                             "does not embed tokens must drop pos_embeddings too")
        else:
            h = tokens  # hidden states from the previous pipeline stage, (B, T, d)
        rope = self.rope_cache[positions] if self.rope_cache is not None else None  # (T, hd) or (B, T, hd)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)  # (B, T, vocab)
            if self.logit_multiplier != 1.0:
                h = h * self.logit_multiplier
        return h
