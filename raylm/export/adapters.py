"""One adapter per Hugging Face model family: which raylm models it can hold, its config.json,
and the tensor map both ways (torchtitan's state_dict_adapter, one small class per family).

A `Rule` ties one HF tensor to the raylm tensors it is made of, with the function each way.
Export and import walk the same rules, so a tensor that round-trips HF -> raylm -> HF comes
back bit for bit. Rules are plain tensor functions: export applies them to meta tensors first
to learn every output shape before it reads a byte.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from raylm.config import ConfigError, ModelConfig
from raylm.model.sizes import ffn_hidden_size


def _same(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def _unwrap(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


@dataclass(frozen=True)
class Rule:
    hf: str
    raylm: tuple[str, ...]
    to_hf: Callable[[list[torch.Tensor]], torch.Tensor] = _same
    from_hf: Callable[[torch.Tensor], list[torch.Tensor]] = _unwrap


def interleaved_to_half(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (n_heads * head_dim, ...) from raylm's RoPE layout, which rotates
    pairs (2i, 2i+1) like Meta's LLaMA, to HF Llama's rotate_half layout, which rotates
    (i, i + head_dim/2): within each head, the even rows first, then the odd ones."""
    hd = t.shape[0] // n_heads
    return t.reshape(n_heads, hd // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def half_to_interleaved(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_half`."""
    hd = t.shape[0] // n_heads
    return t.reshape(n_heads, 2, hd // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _per_layer(n_layers: int, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(hf.format(i), ours.format(i)) for i in range(n_layers) for hf, ours in pairs]


class Adapter(ABC):
    """A family: `problems` lists the raylm options it cannot hold (empty: it can hold them)."""

    architecture: str
    model_type: str
    base_prefix: str
    """The prefix of the base model's tensors, which some saved checkpoints leave out."""
    ignored_hf: tuple[str, ...] = ()
    """HF tensor name suffixes that hold no weights (buffers some versions saved)."""

    @abstractmethod
    def problems(self, m: ModelConfig) -> list[str]: ...

    @abstractmethod
    def hf_config(self, m: ModelConfig, eot_id: int) -> dict: ...

    @abstractmethod
    def rules(self, m: ModelConfig) -> list[Rule]: ...

    @abstractmethod
    def model_config(self, hf: dict) -> tuple[ModelConfig, list[str]]:
        """The raylm ModelConfig of an HF config.json, and warnings about inexact parts."""

    def zero_biases(self, m: ModelConfig) -> list[tuple[str, int]]:
        """HF tensors the family always has that a raylm model without biases lacks: (name,
        size) of biases written as exact zeros."""
        return []


class LlamaAdapter(Adapter):
    """LlamaForCausalLM: RMSNorm, RoPE, SwiGLU, pre-norm, optional GQA, biases and tied head."""

    architecture, model_type, base_prefix = "LlamaForCausalLM", "llama", "model."
    ignored_hf = ("rotary_emb.inv_freq",)

    def problems(self, m: ModelConfig) -> list[str]:
        need = {"norm": "rmsnorm", "pos_embedding": "rope", "mlp": "swiglu", "parallel_block": False}
        return [f"model.{k}={getattr(m, k)!r} (Llama needs {v!r})" for k, v in need.items() if getattr(m, k) != v]

    def hf_config(self, m: ModelConfig, eot_id: int) -> dict:
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": ffn_hidden_size(m),
            "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads or m.n_heads, "head_dim": m.d_model // m.n_heads,
            "hidden_act": "silu", "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
            # Both spellings: transformers >= 5 reads rope_parameters, earlier versions rope_theta.
            "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "attention_bias": m.bias, "mlp_bias": m.bias, "attention_dropout": 0.0,
            "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
            "bos_token_id": eot_id, "eos_token_id": eot_id,
        }

    def rules(self, m: ModelConfig) -> list[Rule]:
        n_kv = m.n_kv_heads or m.n_heads
        plain = [("model.layers.{}.input_layernorm.weight", "layers.{}.attention_norm.weight"),
                 ("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ffn_norm.weight"),
                 ("model.layers.{}.self_attn.v_proj.weight", "layers.{}.attention.wv.weight"),
                 ("model.layers.{}.self_attn.o_proj.weight", "layers.{}.attention.wo.weight"),
                 ("model.layers.{}.mlp.gate_proj.weight", "layers.{}.feed_forward.w1.weight"),
                 ("model.layers.{}.mlp.up_proj.weight", "layers.{}.feed_forward.w3.weight"),
                 ("model.layers.{}.mlp.down_proj.weight", "layers.{}.feed_forward.w2.weight")]
        rotary = [("model.layers.{}.self_attn.q_proj.weight", "layers.{}.attention.wq.weight", m.n_heads),
                  ("model.layers.{}.self_attn.k_proj.weight", "layers.{}.attention.wk.weight", n_kv)]
        if m.bias:
            plain += [(hf.replace("weight", "bias"), ours.replace("weight", "bias")) for hf, ours in plain[2:]]
            rotary += [(hf.replace("weight", "bias"), ours.replace("weight", "bias"), n) for hf, ours, n in rotary]
        rules = [Rule(hf, (ours,)) for hf, ours in _per_layer(m.n_layers, plain)]
        for i in range(m.n_layers):
            for hf, ours, n in rotary:
                rules.append(Rule(hf.format(i), (ours.format(i),),
                                  lambda ts, n=n: interleaved_to_half(ts[0], n),
                                  lambda t, n=n: [half_to_interleaved(t, n)]))
        rules += [Rule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
                  Rule("model.norm.weight", ("norm.weight",))]
        if not m.tie_embeddings:
            rules.append(Rule("lm_head.weight", ("output.weight",)))
        return rules

    def model_config(self, hf: dict) -> tuple[ModelConfig, list[str]]:
        problems = []
        # transformers applies a scaling from either key (it merges a legacy rope_scaling into
        # rope_parameters), so a default in one does not make the other's scaling harmless.
        for name in ("rope_parameters", "rope_scaling"):
            scaling = hf.get(name) or {}
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type != "default":
                problems.append(f"rope scaling {rope_type!r} in {name} (raylm's RoPE has no scaling)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if hf.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={hf['hidden_act']!r} (raylm's SwiGLU uses silu)")
        if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
            problems.append("attention_bias != mlp_bias (raylm has one model.bias for both)")
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, d // heads):
            problems.append(f"head_dim={hf['head_dim']} != hidden_size/num_attention_heads={d // heads}")
        if problems:
            raise ConfigError(f"this {self.architecture} has no raylm equivalent: {'; '.join(problems)}")
        n_kv = hf.get("num_key_value_heads") or heads
        cfg = ModelConfig(
            d_model=d, n_layers=hf["num_hidden_layers"], n_heads=heads, n_kv_heads=None if n_kv == heads else n_kv,
            vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"], norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6), pos_embedding="rope",
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), mlp="swiglu",
            ffn_hidden=hf["intermediate_size"], tie_embeddings=hf.get("tie_word_embeddings", False),
            bias=hf.get("attention_bias", False), dropout=float(hf.get("attention_dropout", 0.0)),
            init_std=hf.get("initializer_range", 0.02))
        return cfg, []


# transformers' names for GELU: "gelu" is exact (erf) like torch's F.gelu; the others are
# the tanh approximation that GPT-2 itself was trained with.
_EXACT_GELU, _TANH_GELU = ("gelu",), ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


class GPT2Adapter(Adapter):
    """GPT2LMHeadModel: LayerNorm, learned positions, GELU (or ReLU) MLP, full multi-head
    attention, Conv1D weights stored (in, out) and q/k/v fused into one c_attn."""

    architecture, model_type, base_prefix = "GPT2LMHeadModel", "gpt2", "transformer."
    ignored_hf = (".attn.bias", ".attn.masked_bias")

    def problems(self, m: ModelConfig) -> list[str]:
        need = {"norm": "layernorm", "pos_embedding": "learned", "parallel_block": False}
        out = [f"model.{k}={getattr(m, k)!r} (GPT-2 needs {v!r})" for k, v in need.items() if getattr(m, k) != v]
        if m.mlp not in ("gelu", "relu"):
            out.append(f"model.mlp={m.mlp!r} (GPT-2 needs 'gelu' or 'relu')")
        if (m.n_kv_heads or m.n_heads) != m.n_heads:
            out.append(f"model.n_kv_heads={m.n_kv_heads} (GPT-2 has no grouped-query attention; "
                       f"needs n_kv_heads = n_heads = {m.n_heads})")
        return out

    def hf_config(self, m: ModelConfig, eot_id: int) -> dict:
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": m.vocab_size, "n_positions": m.max_seq_len, "n_embd": m.d_model,
            "n_layer": m.n_layers, "n_head": m.n_heads, "n_inner": ffn_hidden_size(m),
            "activation_function": m.mlp, "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": m.tie_embeddings,
            "initializer_range": m.init_std, "bos_token_id": eot_id, "eos_token_id": eot_id,
        }

    def rules(self, m: ModelConfig) -> list[Rule]:
        d = m.d_model
        conv = dict(to_hf=lambda ts: ts[0].t(), from_hf=lambda t: [t.t()])  # Conv1D holds W as (in, out)
        rules = []
        for i in range(m.n_layers):
            h, ours = f"transformer.h.{i}.", f"layers.{i}."
            qkv = tuple(f"{ours}attention.{w}.weight" for w in ("wq", "wk", "wv"))
            rules += [Rule(h + "attn.c_attn.weight", qkv, lambda ts: torch.cat(ts, 0).t(),
                           lambda t: list(t.t().split(d, 0))),
                      Rule(h + "attn.c_proj.weight", (ours + "attention.wo.weight",), **conv),
                      Rule(h + "mlp.c_fc.weight", (ours + "feed_forward.w1.weight",), **conv),
                      Rule(h + "mlp.c_proj.weight", (ours + "feed_forward.w2.weight",), **conv),
                      Rule(h + "ln_1.weight", (ours + "attention_norm.weight",)),
                      Rule(h + "ln_2.weight", (ours + "ffn_norm.weight",))]
            if m.bias:
                rules += [Rule(h + "attn.c_attn.bias", tuple(n.replace("weight", "bias") for n in qkv),
                               lambda ts: torch.cat(ts, 0), lambda t: list(t.split(d, 0)))]
                rules += [Rule(h + hf, (ours + name,)) for hf, name in (
                    ("attn.c_proj.bias", "attention.wo.bias"), ("mlp.c_fc.bias", "feed_forward.w1.bias"),
                    ("mlp.c_proj.bias", "feed_forward.w2.bias"), ("ln_1.bias", "attention_norm.bias"),
                    ("ln_2.bias", "ffn_norm.bias"))]
        rules += [Rule("transformer.wte.weight", ("tok_embeddings.weight",)),
                  Rule("transformer.wpe.weight", ("pos_embeddings.weight",)),
                  Rule("transformer.ln_f.weight", ("norm.weight",))]
        if m.bias:
            rules.append(Rule("transformer.ln_f.bias", ("norm.bias",)))
        if not m.tie_embeddings:
            rules.append(Rule("lm_head.weight", ("output.weight",)))
        return rules

    def zero_biases(self, m: ModelConfig) -> list[tuple[str, int]]:
        """GPT-2 always has biases: a raylm model without them exports exact zeros."""
        if m.bias:
            return []
        hidden, d = ffn_hidden_size(m), m.d_model
        out = [("transformer.ln_f.bias", d)]
        for i in range(m.n_layers):
            h = f"transformer.h.{i}."
            out += [(h + "attn.c_attn.bias", 3 * d), (h + "attn.c_proj.bias", d), (h + "mlp.c_fc.bias", hidden),
                    (h + "mlp.c_proj.bias", d), (h + "ln_1.bias", d), (h + "ln_2.bias", d)]
        return out

    def model_config(self, hf: dict) -> tuple[ModelConfig, list[str]]:
        act = hf.get("activation_function", "gelu_new")
        problems, warnings = [], []
        if act in _TANH_GELU:
            warnings.append(f"activation_function={act!r} is GELU's tanh approximation; raylm's GELU is "
                            "exact (erf): outputs differ slightly until training adapts")
        elif act not in (*_EXACT_GELU, "relu"):
            problems.append(f"activation_function={act!r}")
        for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
            if hf.get(key, ok) != ok:
                problems.append(f"{key}={hf[key]}")
        if problems:
            raise ConfigError(f"this {self.architecture} has no raylm equivalent: {', '.join(problems)}")
        d = hf.get("n_embd", 768)
        cfg = ModelConfig(
            d_model=d, n_layers=hf.get("n_layer", 12), n_heads=hf.get("n_head", 12),
            vocab_size=hf.get("vocab_size", 50257), max_seq_len=hf.get("n_positions", 1024), norm="layernorm",
            norm_eps=hf.get("layer_norm_epsilon", 1e-5), pos_embedding="learned",
            mlp="relu" if act == "relu" else "gelu", ffn_hidden=hf.get("n_inner") or 4 * d,
            tie_embeddings=hf.get("tie_word_embeddings", True), bias=True,
            dropout=float(hf.get("resid_pdrop", 0.1)), init_std=hf.get("initializer_range", 0.02))
        return cfg, warnings


FAMILIES: dict[str, Adapter] = {"llama": LlamaAdapter(), "gpt2": GPT2Adapter()}


def adapter_for(m: ModelConfig) -> Adapter:
    """The family that holds this model exactly, or a ConfigError naming every option in the way.
    RoPE models are Llama candidates and learned-position ones GPT-2 candidates."""
    family = FAMILIES["llama" if m.pos_embedding == "rope" else "gpt2"]
    problems = family.problems(m)
    if problems:
        raise ConfigError(f"no Hugging Face equivalent for this model as {family.architecture}: "
                          f"{'; '.join(problems)}. Exportable: LlamaForCausalLM (rmsnorm, rope, swiglu, "
                          "sequential block) or GPT2LMHeadModel (layernorm, learned positions, gelu|relu, "
                          "n_kv_heads = n_heads, sequential block)")
    return family


def adapter_for_hf(hf: dict, where: str) -> Adapter:
    model_type: Optional[str] = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{where}: model_type {model_type!r} cannot be imported; raylm imports "
                          f"{', '.join(a.architecture for a in FAMILIES.values())} (model_type "
                          f"{' or '.join(repr(k) for k in FAMILIES)})")
    return FAMILIES[model_type]
