"""Parallelize a plain model from outside, nearly torchtitan's order: float8 conversion of the
blocks' linears (train.precision=float8), pipeline split, then per part activation checkpointing,
tensor parallel, compile, and data parallel (FSDP2 `fully_shard` or FSDP2-based `replicate`) last.
The model knows nothing of it.

All of it happens on the meta device: no rank ever holds the whole model. Each part is then
materialised with only this rank's shards and initialised by the model's own rule
(`raylm.parallel.init`), to the same weights at every layout for the same `train.seed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from raylm.config import Config, ConfigError
from raylm.parallel import float8
from raylm.parallel.fsdp import apply_ac, apply_fsdp, apply_replicate, mixed_precision
from raylm.parallel.init import materialize
from raylm.parallel.layout import MixedPrecision, ParallelDims, num_stages
from raylm.parallel.mesh import ParallelMesh, build_mesh
from raylm.parallel.tensor import apply_tp
from raylm.parallel.world import World

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

ZERO_NAMES = {"none": "DDP", "optimizer": "ZeRO-1", "gradients": "ZeRO-2", "full": "ZeRO-3"}


@dataclass
class Parallelized:
    """This rank's share of the model: its parts (one, or its pipeline chunks) and the mesh."""

    parts: list[nn.Module]
    mesh: ParallelMesh
    stages: list[PipelineStage] = field(default_factory=list)
    """Pipeline stages on this rank (empty without pipelining)."""
    pp_layers: list[int] = field(default_factory=list)
    """Layers per pipeline stage."""


def describe_layout(cfg: Config, mesh: ParallelMesh) -> dict:
    """The layout in a few keys, for logs and metrics."""
    parallel, d = cfg.parallel, mesh.dims
    layout = {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp,
              "data_parallel": ZERO_NAMES[parallel.sharding] if d.fsdp else "DDP" if d.replicate else "none",
              "hsdp": d.fsdp and d.dp_replicate_enabled and d.dp_shard_enabled,
              "activation_checkpointing": parallel.activation_checkpointing,
              "mixed_precision": str(MixedPrecision.of(cfg.train.precision, parallel, d))}
    if cfg.train.precision == "float8":
        layout.update(float8=cfg.train.float8_recipe, float8_all_gather=float8.all_gathers_float8(cfg, d))
    if d.tp_enabled:
        layout.update(sequence_parallel=parallel.sequence_parallel, loss_parallel=parallel.loss_parallel)
    if d.pp_enabled:
        layout.update(pp_schedule=parallel.pp_schedule, pp_stages=num_stages(parallel))
    return layout


def apply_layout(part: nn.Module, cfg: Config, mesh: ParallelMesh) -> None:
    """Apply activation checkpointing, TP, compile and data parallelism to one (meta) part, in place."""
    parallel = cfg.parallel
    # Checkpointing first: a recompute calls the block again with the inputs its checkpoint took, so
    # its hook must run before sequence parallelism's slice of the first block's input, or the
    # recompute would slice that input twice.
    apply_ac(part, parallel.activation_checkpointing, parallel.ac_every)
    if mesh.tp is not None:
        apply_tp(part, mesh.tp, sequence_parallel=parallel.sequence_parallel, loss_parallel=parallel.loss_parallel)
    if cfg.train.compile:  # in place: parameter names stay the same
        if all(sub is None for sub in (mesh.fsdp, mesh.dp, mesh.tp, mesh.pp)):
            # One device, nothing from outside between the blocks: the whole model is one graph,
            # launched once per pass. Each compiled block's call costs the host time, and a small
            # model's blocks are quick on a GPU: gpt2 on one H200 ran at 0.80x nanoGPT's
            # whole-model compile per block, 0.89x as one graph (with the batch copied from pinned
            # memory; benchmarks/RESULTS.md, GPU check).
            part.compile()
        else:  # per block, between FSDP2's, TP's or a stage's hooks: the repeated structure compiles once
            for block in part.layers.values():
                block.compile()
    policy = mixed_precision(parallel.param_dtype, parallel.reduce_dtype)
    if mesh.fsdp is not None:
        apply_fsdp(part, mesh.fsdp, sharding=parallel.sharding, mp_policy=policy, cpu_offload=parallel.cpu_offload)
    elif mesh.dp is not None:
        apply_replicate(part, mesh.dp, mp_policy=policy)


def _materialize(part: nn.Module, cfg: Config, world: World) -> None:
    """This rank's shards of `part`, initialised from the run's seed; offloaded shards live on the host."""
    device = torch.device("cpu") if cfg.parallel.cpu_offload else world.device
    materialize(part, device, cfg.train.seed, buffer_device=world.device)


def parallelize(model_factory: Callable[[], nn.Module], cfg: Config, world: World,
                dims: ParallelDims) -> Parallelized:
    """Build the model on the meta device (`model_factory` is called under `torch.device("meta")`),
    apply the layout (`dims`, resolved for this world, and `cfg.parallel`'s settings), then
    materialise and initialise this rank's shards."""
    parallel = cfg.parallel
    mesh = build_mesh(dims, world.device.type)
    if parallel.param_dtype != "fp32" and not (dims.fsdp or dims.replicate or dims.amp):
        # torchtitan too leaves mixed precision off for TP or PP without FSDP.
        raise ConfigError(f"parallel.param_dtype={parallel.param_dtype} is applied by FSDP2, or by autocast on one "
                          f"rank; this layout ({dims}, sharding=none) has neither: set parallel.sharding, or use "
                          "train.precision=bf16 (autocast)")
    with torch.device("meta"):
        model = model_factory()
    if cfg.train.precision == "float8":  # before the layout, as torchtitan converts before parallelizing
        float8.check_device(world.device)
        float8.convert(model, cfg.train.float8_recipe, all_gather=float8.all_gathers_float8(cfg, dims))
    if mesh.pp is None:
        apply_layout(model, cfg, mesh)
        _materialize(model, cfg, world)
        built = Parallelized([model], mesh)
    else:
        # Imported here: torch's pipelining imports torch._dynamo, over a second of every worker's start.
        from torch.distributed.pipelining import PipelineStage

        from raylm.parallel import pipeline

        groups = pipeline.layer_split(model, parallel)
        last = num_stages(parallel) - 1
        stages = []
        for sid in pipeline.stage_ids(mesh.pp.get_local_rank(), parallel):
            part = pipeline.stage_module(model, groups[sid], first=sid == 0, last=sid == last)
            apply_layout(part, cfg, mesh)
            _materialize(part, cfg, world)
            stages.append(PipelineStage(part, sid, last + 1, world.device, group=mesh.pp.get_group()))
        del model
        built = Parallelized([s.submod for s in stages], mesh, stages, [len(g) for g in groups])
    # Dropout masks: different on each data-parallel rank, the same within a TP group (whose
    # replicated activations must stay identical on every rank).
    torch.manual_seed(cfg.train.seed + 1 + mesh.dp_rank)
    return built
