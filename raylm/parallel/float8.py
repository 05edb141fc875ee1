"""float8 training through torchao (`train.precision: float8`), applied from outside as the rest of
the layout is: the blocks' linear layers become torchao's `Float8Linear`, which casts its input,
weight and output gradient to float8 with dynamic scales and multiplies on the GPU's float8
tensor cores; the rest of the model computes in bf16.

As torchtitan's float8 converter does:
- Only `nn.Linear`s inside the blocks (`model.layers`), and only those whose in and out features
  are multiples of 16 (the float8 matmul's requirement). The output head and the embedding stay in
  bf16 (torchtitan's configs leave `output` out): the logits feed the softmax and the loss.
- The conversion happens on the meta-device model before anything else of the layout (pipeline
  split, checkpointing, compile, FSDP2), which then see `Float8Linear`s: parameter names do not
  change, so checkpoints load across precisions.
- With the tensorwise recipe under FSDP2, the weights are all-gathered in float8
  (`enable_fsdp_float8_all_gather`: half of bf16's bytes), and their scales are best computed for
  all of them at once, in one all-reduce, after each optimizer step
  (`precompute_float8_dynamic_scale_for_fsdp`): `after_optimizer_step`.

A checkpoint holds the plain tensors under those wrappers (`plain_weights`): it reads back into a
bf16 run, and where torchao is not installed (export, generation).

The config checks refuse what no worker could run (a CPU run, tp > 1, fp16 parameters); a worker
refuses a GPU older than compute capability 8.9 and a missing torchao when it builds the model.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raylm.config import Config, ConfigError
from raylm.parallel.layout import ParallelDims

MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have float8 tensor cores; Ampere has none


def _torchao_float8() -> ModuleType:
    try:
        return importlib.import_module("torchao.float8")
    except ImportError:
        raise ConfigError("train.precision=float8 trains through torchao's float8 linears, and torchao is not "
                          "installed on this worker: pip install 'raylm[float8]'") from None


def check_device(device: torch.device) -> None:
    """Refuse a device without float8 matmuls, naming it and its compute capability."""
    if device.type != "cuda":
        raise ConfigError("train.precision=float8: float8 matmuls need an NVIDIA GPU of compute capability 8.9 or "
                          f"newer (Ada, Hopper); this worker trains on {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(f"train.precision=float8: float8 matmuls need an NVIDIA GPU of compute capability 8.9 or "
                          f"newer (Ada, Hopper); this worker's {torch.cuda.get_device_name(device)} has "
                          f"{capability[0]}.{capability[1]}: use train.precision=bf16")


def all_gathers_float8(cfg: Config, dims: ParallelDims) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8: tensorwise scaling under FSDP2
    (torchao's rowwise scales are per row, which its all-gather does not support)."""
    return cfg.train.precision == "float8" and cfg.train.float8_recipe == "tensorwise" and dims.fsdp


def _eligible(module: nn.Module, fqn: str) -> bool:
    # The float8 matmul (torch._scaled_mm) takes dimensions that are multiples of 16 only.
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: nn.Module, recipe: str, all_gather: bool) -> None:
    """Swap the eligible linears of `model`'s blocks for torchao's `Float8Linear`, in place (on any
    device, meta included): torchao's `recipe` ("tensorwise" or "rowwise"), with float8
    all-gather under FSDP2 when `all_gather` (see `all_gathers_float8`)."""
    ao = _torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    if recipe == "rowwise":
        # torchtitan's workaround for pytorch#150859 (open): compiled, an RMSNorm feeding rowwise
        # float8 casts drove the loss to NaN within ~40 steps; eager's rounding of the casts avoids it.
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    ao.convert_to_float8_training(model.layers, config=config, module_filter_fn=_eligible)
    # Read by after_optimizer_step on each part: pipeline stages are copies of `model`, and FSDP2
    # keeps a module's attributes.
    model.float8_all_gather = all_gather


def after_optimizer_step(model_parts: Sequence[nn.Module]) -> None:
    """Call after every optimizer step, and after anything else that rewrites the weights in place
    (a checkpoint restore, a rollback): where FSDP2 all-gathers float8 weights
    (`all_gathers_float8`), the float8 scales of all of this rank's converted weights in one
    all-reduce, which FSDP2's next all-gathers use instead of one reduction per weight (torchao's
    `precompute_float8_dynamic_scale_for_fsdp`; a scale left from before a rewrite would cast the
    new weights with the old weights' range). Does nothing in every other run, at the cost of an
    attribute lookup per part."""
    parts = [part for part in model_parts if getattr(part, "float8_all_gather", False)]
    if parts:
        precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp
        for part in parts:
            precompute(part)


def plain_weights(state: dict[str, object]) -> dict[str, object]:
    """A model state dict with the weights FSDP2 all-gathers in float8 (DTensors over torchao's
    `WeightWithDynamicFloat8CastTensor`) replaced by DTensors over the plain tensors they wrap, on
    the same storage, for checkpoints: DCP would pickle the wrapper's class into every shard, and a
    reader without torchao imported (export, generation, a bf16 run) could not load them."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None:  # then no such wrapper exists in this process
        return state
    wrapper = fsdp_utils.WeightWithDynamicFloat8CastTensor
    plain = dict(state)
    with torch.no_grad():
        for name, value in state.items():
            if isinstance(value, DTensor) and isinstance(value.to_local(), wrapper):
                plain[name] = DTensor.from_local(value.to_local()._tensor, value.device_mesh, value.placements,
                                                 shape=value.shape, stride=value.stride(), run_check=False)
    return plain
