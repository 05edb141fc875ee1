"""A run resolved once, on the driver: its config filled in from its data (vocabulary, seq_len,
absolute paths) and with the defaults that depend on the run (train.compile), checked against the
model's shape rules, its parallel layout resolved for every world size the run may have, and the
datasets it reads. Workers receive the `RunSpec` whole; each checks that it sees the same data
(one manifest read, compared by digest) and reads the layout of its world size instead of deriving
anything again. Where a run's directory is (`run_uri`, `local_run_dir`) is also derived here, for
the driver and workers.

This is the one place where "resolve" happens; the config package knows neither the model nor
the layout, and the model and the layout know nothing of the data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

from raylm.config import Config, ConfigError, config_from_dict, config_to_dict, global_batch_sequences
from raylm.data import storage
from raylm.data.inspect import verify_once, verify_or_raise
from raylm.data.manifest import Manifest, load_dataset_tokenizer
from raylm.data.storage import StorageError
from raylm.data.stream import BatchSchedule, Datasets
from raylm.model.sizes import check_model_config
from raylm.parallel.layout import ParallelDims, resolve_layout


@dataclass(frozen=True)
class RunSpec:
    config: Config
    """With model.vocab_size and train.seq_len set from the data, and local paths absolute."""
    datasets: Datasets
    tokenizer_json: str
    """The datasets' tokenizer, saved into every checkpoint (generation and export need it)."""
    layouts: dict[int, ParallelDims]
    """The layout's degrees for every world size the run may have (an elastic run's range)."""

    @property
    def seq_len(self) -> int:
        return self.datasets.manifest.seq_len

    @property
    def global_batch(self) -> int:
        return global_batch_sequences(self.config, self.seq_len)

    @property
    def batch_schedule(self) -> BatchSchedule:
        return batch_schedule(self.config, self.seq_len)

    @property
    def tokenizer_sha256(self) -> str:
        return self.datasets.manifest.tokenizer.sha256

    @property
    def data_sha256(self) -> list[str]:
        """Each dataset's manifest, hashed: a checkpoint records them, and a resume compares."""
        return [hashlib.sha256(m.to_json().encode()).hexdigest() for m in self.datasets.manifests]

    def layout(self, world_size: int) -> ParallelDims:
        """The resolved layout of a world of `world_size` ranks."""
        try:
            return self.layouts[world_size]
        except KeyError:
            p = self.config.parallel
            raise ConfigError(f"this run was resolved for {sorted(self.layouts)} worker(s) (parallel.num_workers="
                              f"{p.num_workers}, parallel.min_workers={p.min_workers}), but it runs on "
                              f"{world_size}") from None

    def with_config(self, cfg: Config) -> "RunSpec":
        """Another run on the same data (a sweep's trial): `cfg` filled in and checked as
        `resolve_run` does, without reading the data again."""
        cfg = _fill_from_data(_resolve_defaults(cfg), self.datasets.manifest, announce=False)
        sizes = range(min(self.layouts), max(self.layouts) + 1)  # the world this spec was resolved for
        return dataclasses.replace(self, config=cfg, layouts=resolve_layouts(cfg, self.seq_len, sizes))

    def to_dict(self) -> dict:
        return {"config": config_to_dict(self.config), "datasets": self.datasets.to_dict(),
                "tokenizer_json": self.tokenizer_json,
                "layouts": [dataclasses.asdict(dims) for dims in self.layouts.values()]}

    @classmethod
    def from_dict(cls, d: dict) -> "RunSpec":
        layouts = [ParallelDims(**dims) for dims in d["layouts"]]
        return cls(config_from_dict(d["config"]), Datasets.from_dict(d["datasets"]), d["tokenizer_json"],
                   {dims.world_size: dims for dims in layouts})

    def check_same_data(self, where: str) -> None:
        """Read the manifests again here (a worker) and compare: the same storage access and the
        same data as the driver, or an error that names `where` (the node)."""
        cfg = self.config
        try:
            seen = Datasets.load(cfg.data, cfg.storage)
        except (StorageError, ConfigError) as e:
            raise type(e)(f"{where}: cannot read the training data that the driver read: {e}") from None
        if seen.digest() != self.datasets.digest():
            changed = [uri for uri, a, b in zip(seen.uris, seen.manifests, self.datasets.manifests)
                       if a.to_json() != b.to_json()]
            raise ConfigError(f"{where}: the dataset manifest of {', '.join(changed)} differs from the one the "
                              "driver resolved the run with: was the data re-prepared during the launch?")


def check_config(cfg: Config) -> None:
    """What can be checked of `cfg` before its data is read: the model's shape rules and the
    layout at every world size (the vocabulary and seq_len, which the data decides, unchecked)."""
    check_model_config(cfg.model, need_vocab=False)
    for world_size in world_sizes(cfg):
        resolve_layout(cfg.parallel, cfg.model, world_size, cfg.train.seq_len)


def resolve_run(cfg: Config, announce: bool = False, sizes: Optional[range] = None) -> RunSpec:
    """Read `cfg`'s dataset manifests, fill in what the data decides, check the model and resolve
    the layout for every world size (`sizes`, by default the run's own: `world_sizes`) with the
    batch split, then verify every shard as data.verify says (the one slow part, last). `announce`
    prints what was filled in (on the driver)."""
    cfg = _resolve_defaults(_absolute_paths(cfg))
    datasets = Datasets.load(cfg.data, cfg.storage)
    cfg = _fill_from_data(cfg, datasets.manifest, announce)
    _check_val_split(cfg, datasets)
    layouts = resolve_layouts(cfg, datasets.manifest.seq_len, sizes)
    for uri, manifest in zip(datasets.uris, datasets.manifests):
        if cfg.data.verify is True:
            verify_or_raise(uri, cfg.storage, manifest)
        elif cfg.data.verify == "once" and not verify_once(uri, cfg.storage, manifest) and announce:
            print(f"raylm: {uri}: verified before and unchanged since: not read again (data.verify=true reads "
                  "it at every start)", flush=True)
    tokenizer = load_dataset_tokenizer(datasets.uris[0], cfg.storage, datasets.manifest)
    spec = RunSpec(cfg, datasets, tokenizer.to_json(), layouts)
    if announce:
        _announce_epochs(spec)
    return spec


def _announce_epochs(spec: RunSpec) -> None:
    """A run longer than an epoch of a dataset trains its samples again, each epoch in another
    order: said at the start, not found in the losses."""
    samples, weights = spec.batch_schedule.samples(spec.config.train.steps), spec.datasets.weights
    repeated = [(samples * w / sum(weights) / m.splits["train"].rows, uri, m.splits["train"].rows)
                for uri, w, m in zip(spec.datasets.uris, weights, spec.datasets.manifests)]
    if listed := [f"{epochs:.2f} epochs of {uri} ({rows:,} rows)" for epochs, uri, rows in repeated if epochs > 1]:
        print(f"raylm: train.steps={spec.config.train.steps} trains {samples:,} samples: {', '.join(listed)}; each "
              "epoch after the first trains the same samples again, in another order", flush=True)


def _check_val_split(cfg: Config, datasets: Datasets) -> None:
    """The stability guard's canary and train.eval_every read the val split: a dataset without
    one (prepared with --val-fraction 0, or too small to fill a row) failed every worker, and
    each of Ray's restarts again."""
    needs = [what for what, on in (("guard.enabled (its canary batches)", cfg.guard.enabled),
                                   (f"train.eval_every={cfg.train.eval_every}", cfg.train.eval_every > 0)) if on]
    empty = [uri for uri, m in zip(datasets.uris, datasets.manifests) if not getattr(m.splits.get("val"), "rows", 0)]
    if needs and empty:
        raise ConfigError(f"{', '.join(empty)}: the val split is empty (prepared with --val-fraction 0, or too "
                          f"little text for a row), and {' and '.join(needs)} read it: prepare the data with a "
                          "val split, or set guard.enabled=false and train.eval_every=0")


def world_sizes(cfg: Config) -> range:
    """Every world size the run may have: num_workers, or an elastic run's [min_workers, num_workers]."""
    parallel = cfg.parallel
    return range(parallel.min_workers or parallel.num_workers, parallel.num_workers + 1)


def resolve_layouts(cfg: Config, seq_len: int, sizes: Optional[range] = None) -> dict[int, ParallelDims]:
    """The layout of every world size in `sizes` (the run's own by default), each checked, and
    each splitting every global batch the run goes through into whole micro-batches per
    data-parallel rank: an elastic resize keeps the global batch and recomputes gradient
    accumulation, and so does each stage of a batch ramp-up."""
    check_model_config(cfg.model)
    sizes = sizes or world_sizes(cfg)
    layouts = {n: resolve_layout(cfg.parallel, cfg.model, n, seq_len) for n in sizes}
    micro = cfg.train.micro_batch_size
    for global_batch in batch_schedule(cfg, seq_len).sizes():
        bad = [str(n) for n, dims in layouts.items() if global_batch % (dims.dp * micro)]
        if bad:
            parallel = cfg.parallel
            # The least batch that splits at every size: the data-parallel ranks times the micro-batch.
            multiple = math.lcm(*(dims.dp * micro for dims in layouts.values()))
            where = ("" if len(layouts) == 1 else f", which splits over every size from {min(layouts)} to "
                     f"{max(layouts)} workers (parallel.min_workers to parallel.num_workers), or narrow that range")
            workers = bad[0] if len(bad) == 1 else f"{', '.join(bad[:-1])} or {bad[-1]}"
            raise ConfigError(f"global batch {global_batch} cannot be split over {workers} workers "
                              f"(parallel.tp={parallel.tp}, parallel.pp={parallel.pp}, "
                              f"train.micro_batch_size={micro}) into whole micro-batches: choose a global batch "
                              f"(and batch_rampup sizes) that is a multiple of {multiple}{where}")
    if cfg.parallel.fault_tolerance == "replica":  # each replica group trains on its own rank
        layouts[1] = resolve_layout(dataclasses.replace(cfg.parallel, dp_replicate=1), cfg.model, 1, seq_len)
    return layouts


def absolute(uri: str) -> str:
    """Local paths made absolute: Ray workers run in other directories."""
    return uri if not uri or storage.is_s3(uri) else os.path.abspath(uri)


def storage_root(cfg: Config) -> str:
    return absolute(cfg.run.storage_path)


def run_uri(cfg: Config) -> str:
    """The run directory: config, checkpoints and metrics (local path or s3:// URI)."""
    return storage.join(storage_root(cfg), cfg.run.name)


def local_run_dir(cfg: Config) -> str:
    """Where rank 0 writes metrics and TensorBoard: the run directory itself when it is local,
    else a local mirror whose metrics.jsonl is uploaded with every checkpoint."""
    uri = run_uri(cfg)
    return os.path.join(tempfile.gettempdir(), "raylm-runs", uri[len("s3://"):]) if storage.is_s3(uri) else uri


def _absolute_paths(cfg: Config) -> Config:
    data = dataclasses.replace(cfg.data, path=absolute(cfg.data.path), mixture=[
        dataclasses.replace(c, path=absolute(c.path)) for c in cfg.data.mixture])
    return dataclasses.replace(cfg, data=data, run=dataclasses.replace(cfg.run, storage_path=absolute(cfg.run.storage_path)))


def _resolve_defaults(cfg: Config) -> Config:
    """Defaults that depend on the rest of the run, made concrete: the workers, and the config saved
    with every checkpoint, read what runs. train.compile=None is on with GPUs and off on CPU, where
    compiling costs 20-25 s and gives no speedup."""
    if cfg.train.compile is not None:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=cfg.parallel.use_gpu))


def padded_vocab(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def _fill_from_data(cfg: Config, manifest: Manifest, announce: bool) -> Config:
    """model.vocab_size and train.seq_len from the dataset, or refused when they contradict it."""
    m, t = cfg.model, cfg.train
    data_vocab = manifest.vocab_size
    vocab = padded_vocab(data_vocab, m.vocab_multiple) if m.vocab_size is None else m.vocab_size
    if vocab < data_vocab:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the dataset's tokenizer vocabulary "
            f"({data_vocab}, tokenizer {manifest.tokenizer.kind} {manifest.tokenizer.sha256[:12]}); "
            "set it to null to take the dataset's, or re-prepare the data with the model's tokenizer")
    if announce and m.vocab_size is not None and vocab > data_vocab:
        print(f"raylm: model.vocab_size={vocab} pads the tokenizer's {data_vocab} tokens with "
              f"{vocab - data_vocab} rows no token uses (allowed: padding for fast matmuls; "
              "model.vocab_multiple does it for you)", flush=True)
    if t.seq_len is not None and t.seq_len != manifest.seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} but the dataset was packed with seq_len="
                          f"{manifest.seq_len}; re-run `raylm prepare --seq-len {t.seq_len}` or drop the key")
    if manifest.seq_len > m.max_seq_len:
        raise ConfigError(f"the dataset's seq_len ({manifest.seq_len}) exceeds model.max_seq_len "
                          f"({m.max_seq_len})")
    return dataclasses.replace(cfg, model=dataclasses.replace(m, vocab_size=vocab),
                               train=dataclasses.replace(t, seq_len=manifest.seq_len))


def batch_schedule(cfg: Config, seq_len: int) -> BatchSchedule:
    """The global batch over the run: constant, or ramping up (train.batch_rampup)."""
    final, ramp = global_batch_sequences(cfg, seq_len), cfg.train.batch_rampup
    if ramp is None:
        return BatchSchedule(final)
    if ramp.start >= final or (final - ramp.start) % ramp.increment:
        raise ConfigError(f"train.batch_rampup: start {ramp.start} must be below the global batch {final} and reach "
                          f"it in whole increments of {ramp.increment}")
    return BatchSchedule(final, ramp.start, ramp.increment, ramp.samples)
