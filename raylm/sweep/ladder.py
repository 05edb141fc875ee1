"""The ladder: model sizes, their token budgets, and each trial's complete run config.

Pure functions of the sweep config and the base run (already resolved against its data, so the
vocabulary and seq_len are known): no Ray. Every rule that can reject the input runs here, on
the driver, before any trial starts; errors name the sweep field at fault.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from raylm.config import Config, ModelConfig, build_dataclass, config_from_dict, config_to_dict
from raylm.errors import ConfigError
from raylm.model.sizes import count_params, flops_per_token
from raylm.model.sizes import check_model_config
from raylm.sweep.config import SweepConfig

CHINCHILLA_TOKENS_PER_PARAM = 20.0


@dataclass(frozen=True)
class Size:
    index: int
    where: str  # the sweep field that defined it, for messages
    model: ModelConfig  # vocabulary filled in from the data
    params: int  # N as fit.params counts it: what tokens_per_param multiplies and the fits use
    params_non_embedding: int
    params_total: int
    flops_per_token: float  # the model's real training FLOPs per token at the data's seq_len


@dataclass(frozen=True)
class Rung:
    """One size at one token budget: the unit within which learning rates compete."""

    name: str
    size: Size
    budget: str  # "tokens_per_param=20" or "flops=1e+13"
    target_tokens: float
    held_out: bool
    lr_scale: float  # (N / N_smallest)^lr.scale_exponent


def _model_for(base: ModelConfig, keys: dict, where: str) -> ModelConfig:
    """The base run's model with `keys` laid over it; a named size brings its own defaults."""
    if "size" in keys:  # the preset decides the architecture; the data still decides the vocabulary
        tree = {"vocab_size": base.vocab_size, "vocab_multiple": base.vocab_multiple, **keys}
    else:
        tree = {**{k: v for k, v in dataclasses.asdict(base).items() if k != "size"}, **keys}
    try:
        model = build_dataclass(ModelConfig, tree, where)
        check_model_config(model)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return model


def rule_shape(d_model: int, aspect_ratio: float, head_dim: int, min_layers: int = 1) -> dict:
    """The ladder's width rule: depth grows with width, heads keep their dimension."""
    n_layers = max(min_layers, math.floor(d_model / aspect_ratio + 0.5))  # halves round up, not to even
    return {"d_model": d_model, "n_layers": n_layers, "n_heads": d_model // head_dim}


def _size(sweep: SweepConfig, base: Config, index: int, where: str, keys: dict) -> Size:
    model = _model_for(base.model, keys, where)
    non_emb, total = count_params(model, exclude_embeddings=True), count_params(model)
    return Size(index, where, model, non_emb if sweep.fit.params == "non_embedding" else total, non_emb, total,
                flops_per_token(model, base.train.seq_len))


def build_sizes(sweep: SweepConfig, base: Config) -> list[Size]:
    ladder = sweep.ladder
    if ladder.sizes:
        shapes = [(f"ladder.sizes[{i}]", dict(s)) for i, s in enumerate(ladder.sizes)]
    else:
        shapes = []
        for i, d in enumerate(ladder.d_model):
            if d % ladder.head_dim:
                raise ConfigError(f"ladder.d_model[{i}]={d} is not a multiple of ladder.head_dim={ladder.head_dim}")
            shapes.append((f"ladder.d_model[{i}]", rule_shape(d, ladder.aspect_ratio, ladder.head_dim)))
    # Under mup the base width is the smallest size's, known once it is built. Built first with a
    # stand-in µP base (no shape or count depends on it), so that the base run's own µP fields (an
    # output multiplier) are valid there too.
    first = {"parametrization": "mup", "mup_base_width": 1} if sweep.parametrization == "mup" else {}
    sizes = [_size(sweep, base, i, where, {**keys, **first}) for i, (where, keys) in enumerate(shapes)]
    if sweep.parametrization == "mup":
        sizes = [_size(sweep, base, i, where, {**keys, **mup_keys(sweep, sizes)})
                 for i, (where, keys) in enumerate(shapes)]
    for a, b in zip(sizes, sizes[1:]):
        if b.params <= a.params:
            raise ConfigError(f"{b.where} ({b.params:,} parameters) is not larger than {a.where} ({a.params:,}): "
                              "list the ladder's sizes smallest first, each larger than the last")
    return sizes


def mup_keys(sweep: SweepConfig, sizes: list[Size]) -> dict:
    """The model keys of every model the sweep makes (ladder, check shapes, the recommended run):
    under sweep.parametrization=mup, µP based at the ladder's smallest size (its width and its head
    size: a ladder may add heads of one size as it widens), at its output multiplier; else none."""
    if sweep.parametrization != "mup":
        return {}
    base = sizes[0].model
    return {"parametrization": "mup", "mup_base_width": base.d_model, "mup_base_head_dim": base.d_model // base.n_heads,
            "mup_output_multiplier": base.mup_output_multiplier}


SHAPE_TOLERANCE = 0.25  # how far a check shape's parameter count may sit from the held-out size's


def build_check_shapes(sweep: SweepConfig, base: Config, sizes: list[Size]) -> list[Size]:
    """check_shapes as sizes numbered after the ladder's; each of about the held-out size."""
    held_out = sizes[-1]
    shapes = [_size(sweep, base, len(sizes) + i, f"check_shapes[{i}]", {**keys, **mup_keys(sweep, sizes)})
              for i, keys in enumerate(sweep.check_shapes)]
    for shape in shapes:
        if abs(shape.params / held_out.params - 1) > SHAPE_TOLERANCE:
            raise ConfigError(f"{shape.where} has {shape.params:,} parameters, the held-out size ({held_out.where}) "
                              f"{held_out.params:,}: the check averages shapes of one size, within "
                              f"{SHAPE_TOLERANCE:.0%} of it")
    return shapes


def check_tokens_per_param(sweep: SweepConfig) -> float:
    ratios = sweep.ladder.tokens_per_param
    return sweep.check_tokens_per_param or (statistics.median(ratios) if ratios else CHINCHILLA_TOKENS_PER_PARAM)


def build_rungs(sweep: SweepConfig, sizes: list[Size], check_shapes: Sequence[Size] = ()) -> list[Rung]:
    """Every (size, budget) of the ladder; with `check`, the largest size is held out at one budget,
    and after it the check's other shapes at that budget (`held_out_rung` is the first)."""
    ladder, smallest = sweep.ladder, sizes[0].params
    rungs = []
    for size in [*sizes, *check_shapes]:
        scale = (size.params / smallest) ** sweep.lr.scale_exponent
        held_out = sweep.check and size.index >= sizes[-1].index
        if held_out:
            ratio = check_tokens_per_param(sweep)
            rungs.append(Rung(f"s{size.index}-check", size, f"tokens_per_param={ratio:g}", ratio * size.params,
                              True, scale))
            continue
        for ratio in ladder.tokens_per_param:
            rungs.append(Rung(f"s{size.index}-tpp{ratio:g}", size, f"tokens_per_param={ratio:g}",
                              ratio * size.params, False, scale))
        for flops in ladder.flops:
            rungs.append(Rung(f"s{size.index}-f{flops:.3g}", size, f"flops={flops:.3g}",
                              flops / size.flops_per_token, False, scale))
    return rungs


def held_out_rung(rungs: list[Rung]) -> Rung:
    """The held-out size's rung, the one the check predicts and picks a learning rate for."""
    return next(r for r in rungs if r.held_out)


def batch_sizes(sweep: SweepConfig, base: Config) -> list[int]:
    if sweep.ladder.batch_size:
        return list(sweep.ladder.batch_size)
    t = base.train
    return [t.global_batch_size if t.global_batch_size is not None else t.global_batch_tokens // t.seq_len]


def schedule_shape(base: Config) -> tuple[float, float]:
    """The base run's schedule as fractions, kept by every trial: warmup steps / steps, min_lr / lr."""
    return base.schedule.warmup_steps / base.train.steps, base.schedule.min_lr / base.optim.lr


def steps_for(tokens: float, batch: int, seq_len: int) -> int:
    return max(1, round(tokens / (batch * seq_len)))


def trial_config(sweep: SweepConfig, base: Config, rung: Rung, lr: float, batch: int, run_name: str,
                 seed: int = 0, output_multiplier: Optional[float] = None) -> Config:
    """The complete run config of one trial: the base run with the rung's model and budget, this
    learning rate and batch, an evaluation every 1/trial.evals of the budget, and a checkpoint at
    each evaluation (a restarted trial loses at most one interval). `seed` > 0 moves the
    initialization and the data order (`train.seed`, `data.seed`) by that much: a repeat.
    `output_multiplier` replaces the rung's model's µP output multiplier (µP's search)."""
    seq_len = base.train.seq_len
    steps = steps_for(rung.target_tokens, batch, seq_len)
    warmup_fraction, min_lr_fraction = schedule_shape(base)
    eval_every = max(1, steps // sweep.trial.evals)
    micro = min(base.train.micro_batch_size, batch)
    tree = config_to_dict(base)
    tree["model"] = dataclasses.asdict(rung.size.model)
    if output_multiplier is not None:
        tree["model"]["mup_output_multiplier"] = output_multiplier
    tree["optim"]["lr"] = lr
    tree["schedule"].update(warmup_steps=round(warmup_fraction * steps), min_lr=lr * min_lr_fraction)
    tree["train"].update(steps=steps, global_batch_size=batch, global_batch_tokens=None, micro_batch_size=micro,
                         stop_at_step=None, eval_every=eval_every, log_every=eval_every, report_every_s=0.0,
                         tensorboard=False)
    tree["checkpoint"].update(every_steps=eval_every, every_minutes=None, keep_last=1, keep_every=None,
                              resume="auto")
    tree["run"]["name"] = run_name
    tree["train"]["seed"] += seed
    tree["data"]["seed"] += seed
    if "guard" in tree:
        # A trial's loss must show what its learning rate does: no skipped data, no rollbacks
        # (a diverging trial ends as diverged), and no norm metrics nobody reads.
        tree["guard"].update(enabled=False, norms_every=0)
    return config_from_dict(tree)


def check_budgets(sweep: SweepConfig, base: Config, rungs: list[Rung]) -> None:
    """Each rung's budget must hold at least one global batch at every swept batch size."""
    seq_len = base.train.seq_len
    micro = base.train.micro_batch_size
    for b in batch_sizes(sweep, base):
        if b % min(micro, b):
            raise ConfigError(f"ladder.batch_size {b} is not a multiple of train.micro_batch_size={micro}")
    for rung in rungs:
        for batch in batch_sizes(sweep, base):
            if rung.target_tokens < batch * seq_len:
                field = ("check_tokens_per_param" if rung.held_out else
                         "ladder.tokens_per_param" if rung.budget.startswith("tokens") else "ladder.flops")
                raise ConfigError(
                    f"{field}: the budget {rung.budget} gives {rung.size.where} ({rung.size.params:,} parameters) "
                    f"{rung.target_tokens:,.0f} tokens, less than one batch ({batch} x {seq_len} = "
                    f"{batch * seq_len:,} tokens); raise the budget or lower the batch size")


def check_repetition(sweep: SweepConfig, rungs: list[Rung], unique_tokens: int) -> list[str]:
    """Each rung's epochs over the data's unique training tokens, as lines to print. A rung that
    would see a token twice is refused unless sweep.allow_repeated_data: repeated data bends the
    loss curve (Muennighoff et al. 2023), and the fits assume fresh tokens."""
    epochs = {r.name: r.target_tokens / unique_tokens for r in rungs}
    repeated = [r for r in rungs if epochs[r.name] > 1]
    if repeated and not sweep.allow_repeated_data:
        listed = ", ".join(f"{r.name} {epochs[r.name]:.2f}" for r in repeated)
        raise ConfigError(f"the data has {unique_tokens:,} unique training tokens, and these rungs would train on "
                          f"repeated tokens (epochs: {listed}); repetition bends the loss curve the fits assume. "
                          "Prepare more data, lower ladder.tokens_per_param, ladder.flops or the sizes, or set "
                          "sweep.allow_repeated_data=true to fit them anyway")
    most = max(rungs, key=lambda r: epochs[r.name])
    lines = [f"data: {unique_tokens:,} unique training tokens; the rungs train {min(epochs.values()):.3g} to "
             f"{epochs[most.name]:.3g} epochs ({most.name})"]
    if repeated:
        lines.append(f"warning: {len(repeated)} rung(s) train on repeated tokens (sweep.allow_repeated_data)")
    return lines


def check_fittable(sweep: SweepConfig, rungs: list[Rung]) -> None:
    """The parametric fit has 5 constants: a check or a target needs enough distinct (N, D) to fit them."""
    if not (sweep.check or sweep.target.flops or sweep.target.params):
        return
    fitted = [r for r in rungs if not r.held_out]
    sizes = {r.size.index for r in fitted}
    ratios = {round(r.target_tokens / r.size.params, 6) for r in fitted}
    if len(fitted) < 6 or len(sizes) < 2 or len(ratios) < 2:
        why = "check: true" if sweep.check else "a target"
        raise ConfigError(f"{why} needs the fit L(N, D) = E + A/N^a + B/D^b, which takes at least 6 fitted rungs "
                          f"over 2+ sizes and 2+ tokens-per-parameter ratios; the ladder has {len(fitted)} rungs, "
                          f"{len(sizes)} sizes, {len(ratios)} ratios (add ladder.tokens_per_param values or sizes)")


def lr_values(sweep: SweepConfig, rung: Rung) -> list[float]:
    """search.algorithm=grid: this rung's learning rates."""
    return [v * rung.lr_scale for v in sweep.lr.grid]


def shape_for_params(target: float, sweep: SweepConfig, sizes: list[Size], base: Config) -> Size:
    """A model of about `target` parameters (as fit.params counts them), shaped like the ladder:
    its width rule, or for explicit sizes the largest size's aspect ratio and head dimension, no
    shallower than the ladder's sizes at or below the target (a fixed-depth ladder, chosen because
    shallower models sit off its trend, is not answered with a shallower model)."""
    min_layers = 1
    if sweep.ladder.d_model:
        aspect, head_dim, keys = sweep.ladder.aspect_ratio, sweep.ladder.head_dim, {}
    else:
        top = sizes[-1].model
        aspect, head_dim = top.d_model / top.n_layers, top.d_model // top.n_heads
        keys = {k: v for k, v in dataclasses.asdict(top).items() if k not in ("size", "d_model", "n_layers", "n_heads")}
        min_layers = max((s.model.n_layers for s in sizes if s.params <= target), default=sizes[0].model.n_layers)
    keys.update(mup_keys(sweep, sizes))
    step = head_dim if head_dim % 2 == 0 else 2 * head_dim  # RoPE wants an even head dimension
    best: Optional[Size] = None
    d = step
    while True:
        model = _model_for(base.model, {**keys, **rule_shape(d, aspect, head_dim, min_layers)}, "target")
        non_emb, total = count_params(model, exclude_embeddings=True), count_params(model)
        n = non_emb if sweep.fit.params == "non_embedding" else total
        candidate = Size(-1, "target", model, n, non_emb, total, flops_per_token(model, base.train.seq_len))
        if best is None or abs(math.log(n / target)) < abs(math.log(best.params / target)):
            best = candidate
        if n > target:
            return best
        d += step
