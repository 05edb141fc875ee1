"""µP (raylm.model.mup): the same model as the standard one at its base width, the LR of each
parameter group, and µP's own coordinate check: after a few AdamW steps the activations keep
their size as the width grows, where under the standard parametrization they grow."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from raylm.config import ConfigError, ModelConfig, OptimConfig
from raylm.model import mup
from raylm.model.transformer import Transformer
from raylm.train.optim import apply_lr, build_optimizer

BASE = 64


def config(width: int, parametrization: str, **extra) -> ModelConfig:
    return ModelConfig(d_model=width, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32,
                       parametrization=parametrization, mup_base_width=BASE if parametrization == "mup" else None,
                       **extra)


def train(cfg: ModelConfig, steps: int, lr: float, seed: int = 0) -> tuple[Transformer, list[float]]:
    torch.manual_seed(seed)
    model = Transformer(cfg, seed=seed)
    optimizer = build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0), cfg)
    apply_lr(optimizer, lr)
    tokens = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(seed))  # a 64-token unigram
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_at_its_base_width_mup_is_the_standard_model():
    for tied in (False, True):
        standard, mine = (train(config(BASE, p, tie_embeddings=tied), steps=5, lr=1e-2) for p in ("standard", "mup"))
        assert mine[1] == standard[1]
        for (name, a), (_, b) in zip(standard[0].state_dict().items(), mine[0].state_dict().items()):
            assert torch.equal(a, b), name


def test_a_blocks_matrices_train_at_lr_over_the_width_ratio_the_rest_at_lr():
    cfg = config(4 * BASE, "mup", tie_embeddings=True)
    model = Transformer(cfg, seed=0)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1), cfg)
    apply_lr(optimizer, 2e-2)
    lr_of = {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        hidden = name.startswith("layers.") and p.ndim == 2
        assert lr_of[id(p)] == (2e-2 / 4 if hidden else 2e-2, 0.1 if p.ndim == 2 else 0.0), name
    # And they start narrower: std / sqrt(m).
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02 / 2, rel=0.05)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_the_output_multiplier_scales_the_logits_and_is_mups_alone():
    cfg = config(2 * BASE, "mup")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    one, three = (Transformer(dataclasses.replace(cfg, mup_output_multiplier=alpha), seed=0) for alpha in (1.0, 3.0))
    three.load_state_dict(one.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(three(tokens), 3 * one(tokens))
    with pytest.raises(ConfigError, match="model.mup_output_multiplier=3.0 is µP's"):
        Transformer(dataclasses.replace(config(BASE, "standard"), mup_output_multiplier=3.0))
    with pytest.raises(ConfigError, match="model.mup_output_multiplier must be positive"):
        Transformer(dataclasses.replace(cfg, mup_output_multiplier=0.0))
    # A base width set alone (a user who forgot parametrization=mup) trained a standard model silently.
    for field, value in (("mup_base_width", 64), ("mup_base_head_dim", 16)):
        with pytest.raises(ConfigError, match=f"model.{field}={value} is µP's: it needs model.parametrization=mup"):
            Transformer(dataclasses.replace(config(BASE, "standard"), **{field: value}))


def test_mup_needs_its_base_width():
    with pytest.raises(ConfigError, match="model.parametrization=mup needs model.mup_base_width"):
        Transformer(dataclasses.replace(config(BASE, "standard"), parametrization="mup"))


def test_attention_is_scaled_against_the_base_models_head_size():
    # Heads kept, each 4x wider: 1/d_head relative to the base's, sqrt(16) / 64.
    assert mup.attention_scale(config(4 * BASE, "mup")) == pytest.approx(math.sqrt(16) / 64)
    # Heads of the base's size added (a ladder of head_dim 16): SDPA's own 1/sqrt(16) at every width.
    added = dataclasses.replace(config(4 * BASE, "mup"), n_heads=16, mup_base_head_dim=16)
    assert mup.attention_scale(added) == pytest.approx(1 / math.sqrt(16))
    with pytest.raises(ConfigError, match="model.mup_base_head_dim must be a positive int"):
        Transformer(dataclasses.replace(added, mup_base_head_dim=0))


def activation_sizes(parametrization: str, width: int) -> dict[str, float]:
    """The RMS of each block's output and of the logits after 4 AdamW steps at a high LR."""
    model, _ = train(config(width, parametrization), steps=4, lr=3e-2)
    sizes: dict[str, float] = {}
    hooks = [block.register_forward_hook(lambda m, i, out, n=n: sizes.__setitem__(f"block {n}", out.pow(2).mean().sqrt().item()))
             for n, block in model.layers.items()]
    with torch.no_grad():
        logits = model(torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1)))
    sizes["logits"] = logits.pow(2).mean().sqrt().item()
    for hook in hooks:
        hook.remove()
    return sizes


def test_coordinate_check_activations_keep_their_size_as_the_width_grows_under_mup_only():
    widths = (64, 128, 256, 512)
    ratios = {}  # each width's size over the base width's, per activation
    for parametrization in ("standard", "mup"):
        sizes = [activation_sizes(parametrization, width) for width in widths]
        ratios[parametrization] = {key: [size[key] / sizes[0][key] for size in sizes[1:]] for key in sizes[0]}
    # Measured (2026-12-04): under µP every width within 0.55-1.3x of the base's; under the
    # standard parametrization the blocks' outputs 12-300x at 512 wide and the logits 4.2x, as
    # Adam's updates to a matrix add up over its d_model inputs.
    assert all(1 / 2.5 < r < 2.5 for rs in ratios["mup"].values() for r in rs), ratios
    assert all(rs[-1] > 10 for key, rs in ratios["standard"].items() if key.startswith("block")), ratios
    assert ratios["standard"]["logits"][-1] > 3, ratios


def test_a_mup_run_trains_and_resumes_exactly(tiny_dataset, tmp_path):
    """Through the loop: the hidden matrices' LR multiplier survives a checkpoint and a resume."""
    from raylm.train.loop import train_local
    from tests.train.test_loop import losses, tiny_config

    mup_run = ("model.parametrization=mup", "model.mup_base_width=32", "train.steps=6", "checkpoint.every_steps=3",
               "train.eval_every=0", "schedule.name=constant")
    train_local(tiny_config(tiny_dataset, *mup_run), str(tmp_path / "whole"))
    train_local(tiny_config(tiny_dataset, *mup_run, "train.stop_at_step=3"), str(tmp_path / "resumed"))
    train_local(tiny_config(tiny_dataset, *mup_run), str(tmp_path / "resumed"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")
    standard = tiny_config(tiny_dataset, *mup_run[2:])
    train_local(standard, str(tmp_path / "standard"))
    assert losses(tmp_path / "standard")[6] != losses(tmp_path / "whole")[6]  # µP at twice its base: another model
