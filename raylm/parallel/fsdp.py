"""Data parallelism on FSDP2's machinery, and activation checkpointing (full, every k-th block, or
selective: per operator), applied per block.

Every data-parallel layout uses FSDP2's per-parameter DTensor sharding, so TP and PP compose
with all of them and every layout's checkpoint is a DCP state dict of DTensors under the plain
model's names:

| sharding  | wrapper (per block, then the root)      | between micro-batches                           |
|-----------|-----------------------------------------|-------------------------------------------------|
| none      | `replicate` (FSDP2's DDP) over all dp   | grads kept whole, all-reduced after the last    |
| optimizer | `fully_shard`, reshard_after_forward=F  | params stay gathered; grads whole, reduced once |
| gradients | `fully_shard`, reshard_after_forward=F  | params stay gathered; grads reduce-scattered    |
| full      | `fully_shard`, reshard_after_forward=T  | params re-gathered each pass; grads scattered   |

ZeRO-1 (`optimizer`) on FSDP2: during a step parameters are whole (gathered once, kept through
every micro-batch) and gradients are whole and reduced once, as in ZeRO-1; AdamW state and the
fp32 master weights are sharded. Unlike DeepSpeed's ZeRO-1, parameters are re-sharded after the
last backward, so between steps they also take 1/dp of the memory, and the all-gather that ZeRO-1
does after the optimizer step happens before the next forward instead; the bytes moved per step
are the same (one reduce-scatter plus one all-gather = one all-reduce). This keeps the optimizer a
plain AdamW over DTensors, so DCP saves and reshards it like every other layout, which
`ZeroRedundancyOptimizer` (consolidated, rank-local state) does not.

HSDP is `fully_shard` on the 2-D (dp_replicate, dp_shard) mesh: shard within a group, all-reduce
across groups. With pipeline parallelism the micro-batches belong to the schedule, and the
pipeline stage decides instead: every stage keeps gradients whole and parameters gathered until
its last micro-batch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

from raylm.config import ActivationCheckpointing, Sharding
from raylm.model.transformer import embeddings_tied

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """Compute in param_dtype, reduce gradients in reduce_dtype; fp32 means no cast."""
    param = None if param_dtype == "fp32" else DTYPES[param_dtype]
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=DTYPES[reduce_dtype])


def _units(model: nn.Module) -> tuple[list[list[nn.Module]], Optional[list[nn.Module]]]:
    """Communication groups of a Transformer (part) in forward order, and its head group.

    One group per block; the embedding alone; norm + output together (used back to back, and
    first in backward). A tied embedding joins the head's group: one parameter, one owner.
    """
    head = [m for m in (model.norm, model.output) if m is not None]
    tied = embeddings_tied(model)
    units: list[list[nn.Module]] = []
    if tied:
        head = [model.tok_embeddings, *head]
    elif model.tok_embeddings is not None:
        units.append([model.tok_embeddings])
    units += [[block] for block in model.layers.values()]
    return units, head or None


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, sharding: Sharding, mp_policy: MixedPrecisionPolicy,
               cpu_offload: bool) -> None:
    """`fully_shard` each block, the embedding, the head, then the root (`model` itself)."""
    # Pinned host memory makes the copies asynchronous; it needs an accelerator (on a CPU-only
    # mesh offloading is a no-op kept so the code path runs in tests).
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    common = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    reshard = sharding == "full"
    units, head = _units(model)
    for unit in units:
        fully_shard(unit[0] if len(unit) == 1 else unit, reshard_after_forward=reshard, **common)
    if head is not None:
        # Backward starts with the head: freeing it after forward would only gather it again at once.
        fully_shard(head, reshard_after_forward=False, **common)
    fully_shard(model, **common)


def apply_replicate(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy) -> None:
    """DDP on FSDP2's machinery: the same groups as `apply_fsdp`, each one gradient all-reduce."""
    units, head = _units(model)
    for unit in units + ([head] if head is not None else []):
        replicate(unit[0] if len(unit) == 1 else unit, mesh=mesh, mp_policy=mp_policy)
    replicate(model, mesh=mesh, mp_policy=mp_policy)


def set_micro_batch_sync(model: nn.Module, sharding: Sharding, last: bool) -> None:
    """Before each micro-batch's backward: when to reduce gradients and re-shard parameters."""
    if not isinstance(model, FSDPModule):
        return
    # ZeRO-1 and DDP keep whole gradients until the last micro-batch; ZeRO-2/3 reduce-scatter each.
    model.set_requires_gradient_sync(last or sharding in ("gradients", "full"))
    if sharding != "none":
        # ZeRO-1/2 keep parameters gathered across micro-batches; ZeRO-3 frees them after each.
        model.set_reshard_after_backward(last or sharding == "full")


# Selective checkpointing keeps the outputs of these ops (torchtitan's op-level policy): the
# matmuls and attention kernels that hold nearly all of a block's FLOPs, and sequence
# parallelism's reduce-scatter (a collective not to repeat in backward). Backward then recomputes
# only the cheap ops between them: norms, RoPE, the MLP's activation and product, residual adds,
# casts. Every matmul is kept, not torchtitan's every other one (counted in call order, it keeps
# wq, wv, w1, w2 and recomputes wk, wo, w3): that would run about 40% of an MHA SwiGLU block's
# matmul FLOPs twice, and which projections it keeps would change with the order of the model's
# code; memory between this and `full` is what every_k trades for. SDPA's math path (the s x s
# scores) is composite, so its pieces are recomputed: Korthikanti et al.'s selective recompute.
# The kept bytes are `raylm.parallel.planner.memory.selective_layer_bytes`.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,  # a Linear with a bias
    torch.ops.aten._scaled_mm.default,  # a float8 Linear's matmul (train.precision=float8)
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _keep_matmuls(ctx: SelectiveCheckpointContext, op: torch._ops.OpOverload, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple:
    """A fresh pair per checkpointed forward: its cache holds that forward's kept outputs."""
    return create_selective_checkpoint_contexts(_keep_matmuls)


def apply_ac(model: nn.Module, mode: ActivationCheckpointing, every: int) -> None:
    """Recompute chosen blocks' activations in backward (composable, so FQNs do not change).

    every_k checkpoints blocks whose global index is a multiple of `every`, so the choice does not
    depend on how a pipeline splits the layers. selective checkpoints every block but keeps its
    matmul and attention outputs (`_SAVED_OPS`).
    """
    if mode == "none":
        return
    for layer_id, block in model.layers.items():
        if mode == "selective":
            checkpoint(block, context_fn=_selective_contexts)
        elif mode == "full" or int(layer_id) % every == 0:
            checkpoint(block)
