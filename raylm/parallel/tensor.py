"""Megatron-style tensor parallelism of a `Transformer` (or a pipeline stage of one), through
DTensor's `parallelize_module`.

Per block: wq, wk, wv and w1, w3 are split by output columns (whole heads, so GQA's key/value
heads split with their query groups), wo and w2 by input rows, so each block needs one
all-reduce in attention and one in the MLP. The token embedding is split by vocabulary rows,
the output head by vocabulary columns.

Sequence parallel (Korthikanti et al. 2022) keeps the residual stream and the norms sharded along
the sequence between those matmuls: the all-reduces become reduce-scatter + all-gather pairs and
norm activations shrink by tp. Within a part the residual stream is then a local (B, T/tp, d)
tensor; it enters and leaves each part (a whole model, or a pipeline stage) whole, (B, T, d), so
position handling in `Transformer.forward` and pipeline stage boundaries see full sequences.

Loss parallel leaves the logits sharded by vocabulary; cross entropy must then run inside
`torch.distributed.tensor.parallel.loss_parallel()`, backward included.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _is_tied(model: nn.Module) -> bool:
    return (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard `model`'s parameters over `tp_mesh` in place (DTensors); FQNs are unchanged."""
    tied = _is_tied(model)
    # Between blocks the residual stream is sharded by sequence (SP) or whole on every rank.
    stream = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        # Output whole: positions are added and stage boundaries cross with full sequences.
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=stream,
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:  # both were split into the same vocabulary rows (Shard(0)); share one DTensor again
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            # A parallel block feeds the attention norm's output to both branches: each gathers it.
            plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                   desired_input_layouts=(Replicate(), None, None))
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            if block.ffn_norm is not None:
                plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)

    _replicate_the_rest(model, tp_mesh)
    if sequence_parallel:
        blocks = list(model.layers.values())
        # Enter whole (B, T, d) -> local (B, T/tp, d): a slice, no communication. The RoPE rows and
        # the document mask stay whole: attention runs on whole sequences.
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(), None, None), desired_input_layouts=(Shard(1), None, None),
            use_local_output=True))
        if model.norm is None:  # a stage that hands hidden states on: gather them whole
            parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
            blocks[-1].register_forward_hook(_own_storage)


def _own_storage(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The gathered stage output can be a view; zero-bubble schedules detach stage outputs in
    place after the input-gradient pass, which views refuse. A copy costs one (B, T, d) tensor."""
    return output.clone() if output._is_view() else output


def _replicate_the_rest(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make every parameter the plan left plain (position embeddings; norms without SP) a
    replicated DTensor: an optimizer's foreach kernels and FSDP2 need one kind of tensor.

    Such a module computes its whole output on every TP rank from whole inputs, so its
    gradient is already identical on every rank: no communication is needed.
    """
    def to_dtensor(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def to_local(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local() if isinstance(output, DTensor) else output

    for module in model.modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)
