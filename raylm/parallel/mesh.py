"""Parallel degrees -> a validated DeviceMesh, and the data-parallel coordinates of this rank.

Mesh dimensions follow torchtitan's order, outermost first: ["pp", "dp_replicate", "dp_shard", "tp"].
TP is innermost so a TP group is made of neighbouring ranks (one node); pipeline stages are
outermost, so only the activations of stage boundaries cross the slowest links. Only dimensions
in use are built; "dp_shard" is kept at size 1 where FSDP2 wraps the model without sharding over
it (`ParallelDims.fsdp`: beside TP or PP, or on one rank when asked for). The data-parallel
dimensions flatten into "dp": data loading, loss averaging and DDP use it; ranks with the same dp
coordinate (TP and PP peers) consume the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raylm.config import ConfigError
from raylm.parallel.layout import ParallelDims

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelMesh:
    """The device mesh of a run and its named sub-meshes (None where a dimension is absent)."""

    dims: ParallelDims
    world: Optional[DeviceMesh] = None
    pp: Optional[DeviceMesh] = None
    tp: Optional[DeviceMesh] = None
    dp: Optional[DeviceMesh] = None
    """All data-parallel ranks as one dimension (replicate x shard): DDP, data, loss averaging."""
    fsdp: Optional[DeviceMesh] = None
    """FSDP2's mesh: 2-D (dp_replicate, dp_shard) for HSDP, else 1-D dp_shard; None without FSDP2."""

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank() if self.dp is not None else 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """The DeviceMesh of the resolved layout `dims` over the live world."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size != dims.world_size:
        raise ConfigError(f"the layout was resolved for {dims.world_size} rank(s) ({dims}), but this process group "
                          f"has {world_size}")
    if dims.fsdp and not dist.is_initialized():
        raise ConfigError("parallel.one_rank_fsdp (or cpu_offload) wraps the model in FSDP2, which needs a "
                          "torch.distributed process group (of one rank here); this process has none: train with "
                          "`raylm train`, or set both off")
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp}
    names = tuple(n for n in DIM_NAMES if sizes[n] > 1 or (n == "dp_shard" and dims.fsdp))
    if not dist.is_initialized() or not names:
        return ParallelMesh(dims)
    world = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    sub = {n: world[n] for n in names}
    dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
    if len(dp_names) == 2:
        dp = world[dp_names]._flatten(mesh_dim_name="dp")
    else:
        dp = sub.get(dp_names[0]) if dp_names else None
    fsdp = None
    if dims.fsdp:  # then "dp_shard" is always in the mesh
        fsdp = world[dp_names] if len(dp_names) == 2 else sub["dp_shard"]
    return ParallelMesh(dims, world, pp=sub.get("pp"), tp=sub.get("tp"), dp=dp, fsdp=fsdp)
