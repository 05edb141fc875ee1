"""µP, the maximal update parametrization (Yang et al. 2022, "Tensor Programs V"), for AdamW, as
"The Practitioner's Guide to the Maximal Update Parameterization" (EleutherAI and Cerebras,
2024) tabulates it. With the width ratio m = d_model / model.mup_base_width:

| parameters                                   | init std       | AdamW LR | forward            |
|----------------------------------------------|----------------|----------|--------------------|
| hidden matrices (every 2-D weight of a block) | std / sqrt(m)  | lr / m   |                    |
| embeddings, norms, biases                     | std            | lr       |                    |
| the head                                      | std            | lr       | logits x alpha / m |
| attention scores                              |                |          | 1 / d_head, not 1 / sqrt(d_head) |

alpha is `model.mup_output_multiplier` (the guide's alpha_output, 1 by default), tuned at the base
width with the LR. The head's rule equals the embedding's but for its forward multiplier, so a tied
head (the embedding's own matrix) needs nothing else. Attention's 1/d_head is taken relative to the
base: sqrt(d_head_base) / d_head, which is 1/sqrt(d_head) at the base width, and at every width
whose heads keep the base's size (model.mup_base_head_dim). At the base width every rule is 1 (with
alpha 1): the model is the standard one, and LR and init tuned there transfer to every width. Weight
decay is AdamW's decoupled lr x wd, so it follows each group's LR.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Optional

from raylm.config import ModelConfig

# A block's weights, whatever the wrapper (FSDP2, tensor or pipeline parallel) keeps of the name.
_HIDDEN = re.compile(r"(^|\.)layers\.\d+\.")


def is_mup(cfg: ModelConfig) -> bool:
    return cfg.parametrization == "mup"


def width_ratio(cfg: ModelConfig) -> float:
    """m = d_model / mup_base_width; 1 under the standard parametrization."""
    return cfg.d_model / cfg.mup_base_width if is_mup(cfg) else 1.0


def is_hidden(name: str, ndim: int) -> bool:
    """Whether the parameter `name` (a model's name) is a hidden matrix: a block's 2-D weight."""
    return ndim >= 2 and bool(_HIDDEN.search(name))


def hidden_init_scale(cfg: ModelConfig) -> float:
    """The factor on a hidden matrix's init std."""
    return 1.0 / math.sqrt(width_ratio(cfg))


def lr_multiplier(cfg: ModelConfig, name: str, ndim: int) -> float:
    """The factor on the LR of the parameter `name`."""
    return 1.0 / width_ratio(cfg) if is_hidden(name, ndim) else 1.0


def output_multiplier(cfg: ModelConfig) -> float:
    """The factor on the logits."""
    return cfg.mup_output_multiplier / width_ratio(cfg) if is_mup(cfg) else 1.0


def attention_scale(cfg: ModelConfig) -> Optional[float]:
    """SDPA's scale of the attention scores; None: its default, 1/sqrt(d_head)."""
    if not is_mup(cfg):
        return None
    head_dim = cfg.d_model // cfg.n_heads
    base_head_dim = cfg.mup_base_head_dim or cfg.mup_base_width / cfg.n_heads
    return math.sqrt(base_head_dim) / head_dim


def folded(cfg: ModelConfig) -> tuple[ModelConfig, Callable[[str], tuple[str, float]]]:
    """The standard model that computes what the µP model `cfg` computes, for formats that have no
    place for µP's multipliers (a Hugging Face model): the logit multiplier folded into the head's
    weights (a tied head becomes a head of its own: the embedding's rows stay as they are), the
    attention scale into the query projection's. Returns its config and, for each of its tensors'
    names, the µP model's tensor it is made from and the factor on it."""
    if not is_mup(cfg):
        return cfg, lambda name: (name, 1.0)
    head = output_multiplier(cfg)
    query = attention_scale(cfg) * math.sqrt(cfg.d_model // cfg.n_heads)  # over SDPA's default 1/sqrt(d_head)
    untie = cfg.tie_embeddings and head != 1.0
    standard = dataclasses.replace(cfg, parametrization="standard", mup_base_width=None, mup_base_head_dim=None,
                                   mup_output_multiplier=1.0,
                                   tie_embeddings=cfg.tie_embeddings and not untie)

    def source(name: str) -> tuple[str, float]:
        if name == "output.weight":
            return ("tok_embeddings.weight" if untie else name), head
        if name.endswith((".attention.wq.weight", ".attention.wq.bias")):
            return name, query
        return name, 1.0
    return standard, source
