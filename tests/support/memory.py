"""A rank's peak memory while it builds its share of the model, or loads a checkpoint into it
(Linux), for the start-up test and `benchmarks/startup_memory.py`.

Peak resident memory, not tracemalloc (blind to torch's allocations) or ru_maxrss (a lifetime
peak that cannot be reset): Linux resets the process's peak (VmHWM) when "5" is written to
/proc/self/clear_refs, so the growth of the peak over the resident memory just before is what
the build itself took at its worst moment. glibc returns large freed blocks to the system at
once, so transient tensors count while they live. A small model of the same shape is built
first: the first build pages in torch's code and lazily made state (a forked rank shares its
server's libraries but faults their pages in anew), which is not the model's memory and which
once added 120 MiB to a 104 MiB shard.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace

from torch.distributed.tensor import DTensor

from raylm.config import Config, ModelConfig, ParallelConfig, TrainConfig
from raylm.model.transformer import Transformer
from raylm.parallel.world import World
from raylm.train.checkpoint import format as checkpoint
from raylm.train.optim import build_optimizer
from raylm.parallel.layout import resolve_layout
from raylm.train.step import build_model
from tests.support.checkpoints import TOKENIZER_SHA, save_checkpoint, train_steps


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _config(model_cfg: ModelConfig, sharding: str) -> Config:
    return Config(model=model_cfg, train=TrainConfig(micro_batch_size=1), parallel=ParallelConfig(sharding=sharding))


def _build(model_cfg: ModelConfig, sharding: str, whole: bool) -> list:
    if whole:
        return list(Transformer(model_cfg).parameters())
    cfg = _config(model_cfg, sharding)
    world = World.current()
    dims = resolve_layout(cfg.parallel, cfg.model, world.world_size, cfg.train.seq_len)
    return list(build_model(lambda: Transformer(cfg.model), cfg, world, dims).model.parameters())


def startup_peak(model_cfg: ModelConfig, sharding: str, whole: bool = False) -> dict[str, float]:
    """Runs on each rank: build this rank's share of the model under data-parallel `sharding`
    (or, with `whole`, a plain `Transformer` built whole, as every rank did before meta-device
    start-up). Returns the growth of peak resident memory while building (MiB), the bytes of the
    parameters this rank then holds (MiB) and the seconds it took."""
    _build(replace(model_cfg, d_model=model_cfg.n_heads * 8, vocab_size=256), sharding, whole)
    _reset_peak()
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    params = _build(model_cfg, sharding, whole)
    seconds = time.perf_counter() - start
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in params)
    return {"peak_mib": _status_mib("VmHWM") - before, "held_mib": held / 2**20, "seconds": seconds}


def load_peak(model_cfg: ModelConfig, sharding: str, run_dir: str) -> dict[str, float]:
    """Runs on each rank: build, take one step (the optimizer state exists), save a checkpoint
    into `run_dir`, then load it back as a resume does; returns the growth of peak resident
    memory during the load alone (MiB): DCP reads into this rank's shards in place."""
    cfg = _config(model_cfg, sharding)
    world = World.current()
    model = build_model(lambda: Transformer(cfg.model), cfg, world,
                        resolve_layout(cfg.parallel, cfg.model, world.world_size, cfg.train.seq_len))
    optimizer = build_optimizer(model.parts, cfg.optim)
    train_steps(model, optimizer, range(1), vocab=model_cfg.vocab_size)
    path = save_checkpoint(run_dir, cfg, 1, model, optimizer)
    _reset_peak()
    before = _status_mib("VmRSS")
    checkpoint.load(path, model, optimizer, world, TOKENIZER_SHA)
    return {"load_peak_mib": _status_mib("VmHWM") - before}
