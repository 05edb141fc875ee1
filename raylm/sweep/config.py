"""The typed configuration of a scaling-law sweep: which model sizes, token budgets and learning
rates to train, how Ray Tune searches and stops them, and what to fit and recommend.

A sweep file names a base run config (`base`, a `raylm train` YAML); every trial is that run
with the ladder's model shape, budget, learning rate and batch put in. Command-line overrides
apply to the base run (`data.path=...`, `run.name=...`), or, prefixed with `sweep.`, to the
sweep itself (`sweep.trial.evals=4`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional


# The generic YAML -> dataclass builder of raylm.config: the same key checks and messages
# ("unknown key ladder.sizez (did you mean 'sizes'?)") for the sweep file as for run configs.
from raylm.config import Config, build_dataclass, load_config, merge_trees, parse_overrides
from raylm.config.load import read_yaml_mapping
from raylm.errors import ConfigError
from raylm.parallel.planner.plan import check_whole_nodes

SWEEP_PREFIX = "sweep."


@dataclass
class LadderConfig:
    sizes: list[dict] = field(default_factory=list)
    """Model shapes, smallest first: each a mapping of model keys laid over the base run's model
    (`{d_model: 64, n_layers: 2, n_heads: 4}`, or `{size: tiny}`). Or leave empty and give d_model."""
    d_model: list[int] = field(default_factory=list)
    """Instead of sizes: widths, each shaped by the rule n_layers = round(d_model / aspect_ratio)
    (at least 1), n_heads = d_model / head_dim."""
    aspect_ratio: float = 32.0
    head_dim: int = 16
    tokens_per_param: list[float] = field(default_factory=list)
    """Token budgets as multiples of each size's parameter count (fit.params decides which count)."""
    flops: list[float] = field(default_factory=list)
    """isoFLOP budgets: every size trains C / (FLOPs per token) tokens for each C (enables the
    isoFLOP fit, Chinchilla approach 2)."""
    batch_size: list[int] = field(default_factory=list)
    """Global batch sizes (sequences) to sweep; empty: the base run's batch only."""
    seeds: int = 1
    """Trainings of each fitted rung at its best learning rate, each with its own seed (`train.seed`,
    `data.seed`): the first is the search's trial, the others run after the ladder, and the fits
    take their mean loss. With `check`, the held-out rung (at the picked rate) and every
    check_shapes shape are trained as many times. One seed's loss moves by a few percent at these
    sizes, as much as the error a check is judged by."""


@dataclass
class LRConfig:
    grid: list[float] = field(default_factory=list)
    """search.algorithm=grid: the learning rates of the smallest size; list the likely best first
    (ASHA compares later trials against earlier ones)."""
    low: Optional[float] = None
    """random, bayes: the log-uniform range of the smallest size's learning rates."""
    high: Optional[float] = None
    scale_exponent: float = 0.0
    """Per size, the grid (or range) is multiplied by (N / N_smallest)^scale_exponent: centres it
    on where the optimum moves as models grow (e.g. -0.3)."""


@dataclass
class SearchConfig:
    algorithm: Literal["grid", "random", "bayes"] = "grid"
    """grid: every lr.grid value (x every batch size) per rung; random: `samples` log-uniform draws
    per rung; bayes: `samples` Optuna TPE suggestions per rung (Ray Tune's OptunaSearch)."""
    samples: int = 4
    """random, bayes: trials per rung (a rung is one size at one budget)."""
    seed: int = 0


@dataclass
class EarlyStoppingConfig:
    asha: bool = True
    """ASHA on validation loss, within each rung: hopeless learning rates stop early."""
    grace_fraction: float = 0.5
    """No trial is stopped before this fraction of its budget: earlier, a cosine schedule is still
    near its peak learning rate, and a high rate that would end best looks worst."""
    reduction_factor: float = 2.0
    """At each milestone (grace_fraction x reduction_factor^k) a trial continues only if its loss
    is within the best 1/reduction_factor of its rung's trials so far."""


@dataclass
class TrialConfig:
    cpus: float = 1.0
    """CPUs per trial (its torch threads); concurrency is the cluster's CPUs divided by this."""
    gpus: float = 0.0
    """GPUs per trial (0: train on CPU); with GPUs, concurrency is the cluster's GPUs / this."""
    check_cpus: Optional[float] = None
    """CPUs of each held-out trial (the check's learning rates run as many at once as the cluster
    holds); None: all of the cluster's CPUs, one trial at a time."""
    evals: int = 8
    """Validation-loss reports per trial (the points at which ASHA may stop it)."""
    max_failures: int = 2
    """Restarts of a failed trial, each from its own newest checkpoint."""
    max_concurrent: Optional[int] = None
    """Cap on trials at once; None: as many as the cluster's resources allow."""


@dataclass
class FitConfig:
    params: Literal["non_embedding", "total"] = "non_embedding"
    """Which parameter count N the fits and tokens_per_param use."""
    bootstrap: int = 200
    """Bootstrap resamples for the confidence intervals."""
    huber_delta: float = 1e-3
    """Huber loss threshold on log-loss residuals (Hoffmann et al. 2022 used 1e-3)."""
    confidence: float = 0.95
    seed: int = 0
    local_sizes: int = 0
    """The local form is fitted on the rungs of this many of the ladder's largest sizes (0: all).
    Refitted on every size rather than the top two, the 26 recorded sweeps' held-out errors fell
    from 3.17% to 2.26% on average, the largest from 8.85% to 5.24% (benchmarks/RESULTS.md)."""


@dataclass
class TargetConfig:
    flops: Optional[float] = None
    """Compute budget of the recommended run (FLOPs); it gets the compute-optimal N and D."""
    params: Optional[float] = None
    """Or: the recommended run's parameter count; it gets the compute-optimal tokens for it."""
    gpus: Optional[int] = None
    """A GPU cluster for the recommended run: its `parallel:` block is `raylm plan`'s best layout
    for this many GPUs (None: the base run's parallel block)."""
    gpus_per_node: int = 8
    gpu_memory: str = "80GB"


@dataclass
class SweepConfig:
    base: str = ""
    """The base run config (a `raylm train` YAML), relative to the sweep file."""
    base_overrides: list[str] = field(default_factory=list)
    """Dotted overrides of the base run (applied before the command line's)."""
    parametrization: Literal["standard", "mup"] = "standard"
    """standard: every rung searches its own learning rate (lr, search). mup: every trial's model
    is µP (`model.parametrization`) based at the ladder's smallest size (`model.mup_base_width`,
    `model.mup_base_head_dim`);
    the learning rate is searched at that width only (lr, search, early_stopping: phase lr-search),
    and every size trains at the best of it with ladder.seeds seeds (3 or more: the compute the
    per-rung search took)."""
    mup_output_multiplier: list[float] = field(default_factory=list)
    """parametrization=mup: output multipliers (`model.mup_output_multiplier`, the logits x alpha /
    width multiplier) searched with the learning rate at the base width (every lr x every value,
    within each rung), e.g. [4, 8, 16]; the best (lowest mean loss over the base width's rungs)
    and its learning rate transfer to every size and to the recommended run. Empty: the base run's
    multiplier, not searched."""
    ladder: LadderConfig = field(default_factory=LadderConfig)
    lr: LRConfig = field(default_factory=LRConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    trial: TrialConfig = field(default_factory=TrialConfig)
    fit: FitConfig = field(default_factory=FitConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    check: bool = False
    """Hold the largest size out of the fits, predict its loss, train it, and record the error."""
    check_tokens_per_param: Optional[float] = None
    """The held-out size's budget; None: the median of ladder.tokens_per_param (20 without)."""
    check_shapes: list[dict] = field(default_factory=list)
    """Other shapes of the held-out size (model keys, as ladder.sizes; within 25% of its parameter
    count), trained at its budget and at the learning rate lr_vs_params gives them: the check's
    error averaged over them and the held-out shape (with check: true; ignored without). Shapes of
    one size sit a percent or two apart, so one shape alone says as much about its shape as about
    the fit."""
    allow_repeated_data: bool = False
    """Let rungs whose budget exceeds the data's unique training tokens train on repeated tokens
    (refused by default: repetition bends the curve the fits assume)."""


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Command-line overrides -> (the sweep's, without the `sweep.` prefix; the base run's)."""
    sweep = [o[len(SWEEP_PREFIX):] for o in overrides if o.startswith(SWEEP_PREFIX)]
    base = [o for o in overrides if not o.startswith(SWEEP_PREFIX)]
    sweep_keys = {f.name for f in dataclasses.fields(SweepConfig)}
    for o in base:
        if o.split("=", 1)[0].split(".", 1)[0] in sweep_keys:
            raise ConfigError(f"{o!r} sets the sweep, not its base run: write {SWEEP_PREFIX}{o}")
    return sweep, base


def load_sweep(path: str | Path, overrides: Optional[list[str]] = None) -> tuple[SweepConfig, Config]:
    """The sweep config and its base run config, overrides applied and both validated."""
    tree = read_yaml_mapping(path, "sweep file")
    sweep_overrides, base_overrides = split_overrides(list(overrides or []))
    # With overrides, errors name the keys as the command line writes them: sweep.<key>.
    sweep: SweepConfig = build_dataclass(SweepConfig, merge_trees(tree, parse_overrides(sweep_overrides)),
                                         SWEEP_PREFIX.rstrip(".") if sweep_overrides else "")
    if not sweep.base:
        raise ConfigError(f"{path}: `base` must name the base run config (a raylm train YAML)")
    base_path = Path(path).parent / sweep.base
    if not base_path.is_file():  # relative to the sweep file, not to where the command runs
        raise ConfigError(f"{path}: base {sweep.base!r} not found: looked for {base_path.resolve()}, beside the "
                          "sweep file")
    base = load_config(base_path, [*sweep.base_overrides, *base_overrides])
    check_sweep(sweep)
    return sweep, base


def check_sweep(sweep: SweepConfig) -> None:
    """What the sweep's own fields must satisfy; the ladder against the model and data is checked
    when the rungs are built (`raylm.sweep.ladder`)."""
    ladder, lr, search = sweep.ladder, sweep.lr, sweep.search
    if bool(ladder.sizes) == bool(ladder.d_model):
        raise ConfigError("give exactly one of ladder.sizes (model shapes) and ladder.d_model (widths shaped by "
                          "ladder.aspect_ratio and ladder.head_dim)")
    if not ladder.tokens_per_param and not ladder.flops:
        raise ConfigError("the ladder needs token budgets: ladder.tokens_per_param (e.g. [10, 20, 40]) "
                          "and/or ladder.flops (isoFLOP budgets)")
    for name, values in (("ladder.tokens_per_param", ladder.tokens_per_param), ("ladder.flops", ladder.flops),
                         ("ladder.batch_size", ladder.batch_size), ("ladder.d_model", ladder.d_model)):
        for i, v in enumerate(values):
            if v <= 0:
                raise ConfigError(f"{name}[{i}] must be positive, got {v}")
    if search.algorithm == "grid":
        if not lr.grid:
            raise ConfigError("lr.grid is empty: search.algorithm=grid needs at least one learning rate "
                              "(e.g. lr.grid: [3e-3, 1e-3, 1e-2])")
        if any(v <= 0 for v in lr.grid):
            raise ConfigError(f"lr.grid values must be positive, got {lr.grid}")
    else:
        if lr.low is None or lr.high is None or not 0 < lr.low < lr.high:
            raise ConfigError(f"search.algorithm={search.algorithm} needs 0 < lr.low < lr.high, got "
                              f"lr.low={lr.low}, lr.high={lr.high}")
        if search.samples <= 0:
            raise ConfigError(f"search.samples must be positive, got {search.samples}")
    es = sweep.early_stopping
    if not 0 < es.grace_fraction <= 1 or es.reduction_factor <= 1:
        raise ConfigError("early_stopping needs 0 < grace_fraction <= 1 and reduction_factor > 1, got "
                          f"{es.grace_fraction} and {es.reduction_factor}")
    t = sweep.trial
    if t.cpus <= 0 or t.gpus < 0 or t.evals <= 0 or t.max_failures < 0:
        raise ConfigError(f"trial needs cpus > 0, gpus >= 0, evals > 0, max_failures >= 0; got {t}")
    if sweep.target.flops is not None and sweep.target.params is not None:
        raise ConfigError("give at most one of target.flops and target.params")
    if sweep.target.gpus:  # the recommendation is `raylm plan`'s layout: the same cluster it accepts
        check_whole_nodes(sweep.target.gpus, sweep.target.gpus_per_node, "target.gpus", "target.gpus_per_node")
    if sweep.fit.bootstrap < 0 or not 0 < sweep.fit.confidence < 1:
        raise ConfigError("fit needs bootstrap >= 0 and 0 < confidence < 1")
    if sweep.fit.local_sizes == 1 or sweep.fit.local_sizes < 0:
        raise ConfigError(f"fit.local_sizes must be 0 (every size) or at least 2 (a power law needs two sizes), "
                          f"got {sweep.fit.local_sizes}")
    if ladder.seeds < 1:
        raise ConfigError(f"ladder.seeds must be at least 1 (the search's own trial), got {ladder.seeds}")
    if sweep.parametrization == "mup":
        _check_mup(sweep)
    elif sweep.mup_output_multiplier:
        raise ConfigError(f"sweep.mup_output_multiplier={sweep.mup_output_multiplier} is searched at µP's base width: it "
                          "needs sweep.parametrization=mup")
    if sweep.check and len(ladder.sizes or ladder.d_model) < 3:
        raise ConfigError("check: true holds the largest size out of the fit; the ladder then needs at "
                          "least 3 sizes (2 to fit, 1 to check)")


def _check_mup(sweep: SweepConfig) -> None:
    """What sweep.parametrization=mup contradicts: a learning rate or batch chosen per size."""
    if sweep.lr.scale_exponent != 0:
        raise ConfigError(f"sweep.parametrization=mup trains every size at the learning rate found at the base width, "
                          f"but lr.scale_exponent={sweep.lr.scale_exponent:g} moves it per size: set "
                          "sweep.lr.scale_exponent=0")
    for i, v in enumerate(sweep.mup_output_multiplier):
        if v <= 0:
            raise ConfigError(f"sweep.mup_output_multiplier[{i}] must be positive, got {v:g}")
    if len(set(sweep.mup_output_multiplier)) < len(sweep.mup_output_multiplier):
        raise ConfigError(f"sweep.mup_output_multiplier lists a value twice: {sweep.mup_output_multiplier}")
    if len(sweep.ladder.batch_size) > 1:
        raise ConfigError(f"sweep.parametrization=mup transfers the learning rate across widths, not a batch size "
                          f"chosen per size: ladder.batch_size takes one value under mup, got {sweep.ladder.batch_size}")


def sweep_to_dict(sweep: SweepConfig) -> dict:
    return dataclasses.asdict(sweep)
