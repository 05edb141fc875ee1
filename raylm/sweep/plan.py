"""A sweep resolved on the driver before any trial (`resolve`), and the record that ties a
sweep directory to the one sweep it holds (`check_same_sweep`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import yaml

from raylm.config import Config, ParallelConfig, build_dataclass, config_to_dict
from raylm.data import storage
from raylm.data.order import chunking_warning
from raylm.errors import ConfigError
from raylm.sweep import ladder
from raylm.sweep.config import SweepConfig, load_sweep, sweep_to_dict
from raylm.sweep.results import SWEEP_FILE
from raylm.sweep.summary import say
from raylm.train.spec import absolute, resolve_run


FINAL_FILE = "final.json"  # a finished trial's result, in its directory


def trial_dir(trials_dir: str, trial_id: str) -> str:
    return os.path.join(trials_dir, trial_id)


@dataclasses.dataclass(frozen=True)
class TrialPlan:
    """What every trial of a phase shares (handed over once, through the object store). Here, not
    beside the trial's function (`raylm.sweep.trial`), which imports torch: the driver, which only
    plans and fits, never does."""

    sweep: SweepConfig
    spec: dict  # RunSpec.to_dict() of the base run, resolved against its data on the driver
    rungs: dict[str, ladder.Rung]
    trials_dir: str
    threads: int  # torch threads: the trial's whole CPUs
    use_gpu: bool


@dataclasses.dataclass
class Plan:
    """The sweep resolved on the driver, before any trial: every rule checked."""

    sweep: SweepConfig
    base: Config  # the user's base run
    spec: object  # RunSpec of the trials' base (one in-process worker, local reader), resolved against the data
    sizes: list[ladder.Size]
    rungs: list[ladder.Rung]
    batches: list[int]
    directory: str

    @property
    def resolved(self) -> Config:
        return self.spec.config

    def rung(self, name: str) -> ladder.Rung:
        return next(r for r in self.rungs if r.name == name)

    def with_output_multiplier(self, value: float) -> Plan:
        """Every model of the sweep (ladder, check shapes, the recommended run's, through
        `ladder.mup_keys`) at this µP output multiplier: the one µP's search found."""
        by_index: dict[int, ladder.Size] = {}
        for size in [*self.sizes, *(r.size for r in self.rungs)]:
            by_index.setdefault(size.index, dataclasses.replace(
                size, model=dataclasses.replace(size.model, mup_output_multiplier=value)))
        return dataclasses.replace(self, sizes=[by_index[s.index] for s in self.sizes],
                                   rungs=[dataclasses.replace(r, size=by_index[r.size.index]) for r in self.rungs])


def resolve(path: str, overrides: list[str]) -> Plan:
    """Load and check everything a sweep needs, reading the data once; no Ray yet."""
    sweep, base = load_sweep(path, overrides)
    directory = storage.join(absolute(base.run.storage_path), base.run.name)
    if storage.is_s3(directory):
        raise ConfigError(f"run.storage_path={base.run.storage_path}: a sweep directory must be a local or shared "
                          "file system path (trials checkpoint into it); s3:// is not supported for sweeps")
    trials_base = dataclasses.replace(
        base, parallel=ParallelConfig(num_workers=1, use_gpu=sweep.trial.gpus > 0),
        data=dataclasses.replace(base.data, loader="local"))  # in-process trials read with pyarrow
    spec = resolve_run(trials_base, announce=True)
    sizes = ladder.build_sizes(sweep, spec.config)
    depths = sorted({s.model.n_layers for s in sizes})
    if sweep.parametrization == "mup" and len(depths) > 1:
        say(f"warning: µP transfers the learning rate across widths at one depth; the ladder's sizes are "
            f"{depths[0]} to {depths[-1]} layers deep, where the transfer is not assured")
    shapes = ladder.build_check_shapes(sweep, spec.config, sizes) if sweep.check else []
    rungs = ladder.build_rungs(sweep, sizes, shapes)
    ladder.check_budgets(sweep, spec.config, rungs)
    unique_tokens = sum(m.splits["train"].unique_tokens for m in spec.datasets.manifests)
    for line in ladder.check_repetition(sweep, rungs, unique_tokens):
        say(line)
    ladder.check_fittable(sweep, rungs)
    batches = ladder.batch_sizes(sweep, spec.config)
    if warning := chunking_warning(spec.config.data.chunk_rows, min(batches), "a trial's batch"):
        say(f"warning: {warning}")
    probe_lr = sweep.lr.grid[0] if sweep.lr.grid else sweep.lr.low
    for rung in rungs:  # every trial's complete config, built and validated now
        for batch in batches:
            ladder.trial_config(sweep, spec.config, rung, probe_lr * rung.lr_scale, batch, "probe")
    return Plan(sweep, base, spec, sizes, rungs, batches, directory)


def _effective(cls: type, tree) -> Optional[dict]:
    """A recorded config as it reads today: keys added to raylm since take their defaults."""
    try:
        return dataclasses.asdict(build_dataclass(cls, tree))
    except (ConfigError, TypeError):
        return None


def _trials_began(directory: str) -> bool:
    """Whether a phase of the sweep in `directory` was handed to Tune: its experiment or a trial's
    run directory exists."""
    return any(name == "trials" or name.startswith("tune-") for name in os.listdir(directory))


def check_same_sweep(plan: Plan, path: str) -> None:
    """A sweep directory belongs to one sweep: resuming it with other settings would mix results.
    One refused before any trial began (a trial larger than the cluster) holds nothing to mix:
    the corrected command takes it over."""
    record = {"sweep": sweep_to_dict(plan.sweep), "base": config_to_dict(plan.base)}
    os.makedirs(plan.directory, exist_ok=True)
    target = os.path.join(plan.directory, SWEEP_FILE)
    if os.path.exists(target) and _trials_began(plan.directory):
        with open(target) as f:
            previous = yaml.safe_load(f)
        changed = [key for key, cls in (("sweep", SweepConfig), ("base", Config))
                   if _effective(cls, previous.get(key)) != record[key]]
        if changed:
            raise ConfigError(f"{plan.directory} holds a sweep started with different settings ({', '.join(changed)} "
                              f"differ from {path} and the overrides; see {target}): resume it with the same "
                              "command, or choose another run.name")
        return
    storage.write_bytes(target, yaml.safe_dump(record, sort_keys=False).encode())  # whole or not at all
