"""Materialise a model built on the meta device once its parallel layout is applied: each rank
allocates only its own shards (`to_empty`) and fills them by the model's rule (`param_init`).

A rank's start-up memory is then its shards plus, transiently, one parameter's rows that its
shard touches (the whole parameter at most), never the whole model. The values are those of
the model built whole from the same seed, whatever the layout: the model draws random values
per block of rows from generators keyed by (seed, parameter name, block), so a shard is drawn
without the rest of its parameter, in any order, with no communication.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from raylm.model.transformer import ParamInit


def _index_placement(placement: Placement, dim: int, ndim: int) -> Placement:
    """`placement`'s effect on tensor dim `dim`, restated for a 1-D index along that dim."""
    if isinstance(placement, Shard) and placement.dim % ndim == dim:
        return Shard(0)
    if isinstance(placement, _StridedShard) and placement.dim % ndim == dim:
        return _StridedShard(0, split_factor=placement.split_factor)
    return Replicate()


def local_indices(param: DTensor, dim: int) -> torch.Tensor:
    """The indices along `dim` of the whole parameter that this rank's shard holds, in its order.

    DTensor's own local split (`src_data_rank=None`: no communication) of an index vector, so
    uneven, strided (FSDP2 over TP) and multi-axis shardings follow DTensor's rules exactly.
    """
    placements = [_index_placement(p, dim, param.ndim) for p in param.placements]
    index = torch.arange(param.shape[dim])
    return distribute_tensor(index, param.device_mesh, placements, src_data_rank=None).to_local().cpu()


def _sharded_dims(param: DTensor) -> list[int]:
    return sorted({p.dim % param.ndim for p in param.placements if isinstance(p, (Shard, _StridedShard))})


def local_values(param: DTensor, name: str, init: ParamInit, seed: int) -> torch.Tensor:
    """This rank's shard of the initial value of `param` (called `name`), on CPU: the rows its
    shard holds are drawn, then sliced along any other sharded dim."""
    dims = _sharded_dims(param)
    rows = local_indices(param, 0) if 0 in dims else None
    values = init.draw(tuple(param.shape), seed, rows)  # (rows of this shard, *whole other dims)
    for dim in dims:
        if dim > 0:
            values = values.index_select(dim, local_indices(param, dim))
    local = param.to_local()
    if values.shape != local.shape:
        raise RuntimeError(f"initialising {name}: computed a shard of shape {tuple(values.shape)}, but this "
                           f"rank holds {tuple(local.shape)} under placements {param.placements}")
    return values


@torch.no_grad()
def materialize(part: nn.Module, device: Union[torch.device, str], seed: int,
                buffer_device: Union[torch.device, str, None] = None) -> None:
    """Give the meta-device `part` (a model or pipeline stage, parallelised or not) storage on
    `device` for this rank's shards only, and initialise them as `part.init_weights(seed)` would
    initialise the whole model. Buffers are rebuilt on `buffer_device` (default `device`)."""
    part.to_empty(device=device)
    part.reset_buffers(buffer_device or device)  # after to_empty: re-ties a tied head to its embedding
    for name, param in part.named_parameters():
        init = part.param_init(name)
        if isinstance(param, DTensor):
            param.to_local().copy_(local_values(param, name, init, seed))
        else:
            param.copy_(init.draw(tuple(param.shape), seed))
