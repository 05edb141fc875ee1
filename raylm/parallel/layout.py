"""A layout's parallel degrees and every rule it must satisfy, checked before any process group
exists. No torch here: the driver checks a run's layout before any process imports it;
`raylm.parallel.mesh` builds the DeviceMesh from the degrees checked here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raylm.config import ConfigError, ModelConfig, ParallelConfig
from raylm.model.sizes import ffn_hidden_size

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def __str__(self) -> str:
        return f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp}"


def parallel_dims(parallel: ParallelConfig, world_size: int) -> ParallelDims:
    """The four degrees for `world_size` ranks, inferring dp_shard=-1; an error says why not."""
    for name in ("dp_replicate", "tp", "pp"):
        if getattr(parallel, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(parallel, name)}")
    if parallel.dp_shard == 0 or parallel.dp_shard < -1:
        raise ConfigError(f"parallel.dp_shard must be >= 1 or -1 (infer), got {parallel.dp_shard}")
    others = parallel.dp_replicate * parallel.tp * parallel.pp
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(f"cannot infer parallel.dp_shard: world size {world_size} is not divisible by "
                              f"dp_replicate={parallel.dp_replicate} x tp={parallel.tp} x pp={parallel.pp} = {others}")
        dp_shard = world_size // others
    dims = ParallelDims(parallel.pp, parallel.dp_replicate, dp_shard, parallel.tp)
    if dims.world_size != world_size:
        raise ConfigError(f"parallel degrees {dims} multiply to {dims.world_size}, but the world size "
                          f"(parallel.num_workers) is {world_size}; make the product equal it or set "
                          "dp_shard=-1 to infer it")
    return dims


def num_stages(parallel: ParallelConfig) -> int:
    return parallel.pp * parallel.pp_virtual_stages


def check_parallel_config(parallel: ParallelConfig, model: ModelConfig, world_size: int,
                          seq_len: Optional[int] = None) -> ParallelDims:
    """Every rule a layout must satisfy before any process group exists; returns the degrees.
    `seq_len` is checked when known (the dataset sets it)."""
    dims = parallel_dims(parallel, world_size)
    if parallel.ac_every < 1:
        raise ConfigError(f"parallel.ac_every must be >= 1, got {parallel.ac_every}")
    if parallel.cpu_offload and parallel.sharding == "none":
        raise ConfigError("parallel.cpu_offload needs FSDP2: set parallel.sharding to optimizer, gradients or full")
    if dims.tp == 1 and (parallel.sequence_parallel or parallel.loss_parallel):
        raise ConfigError("parallel.sequence_parallel and parallel.loss_parallel split over the tensor-parallel "
                          f"group: they need parallel.tp > 1 (tp={dims.tp})")
    if dims.tp > 1:
        _check_tp_divides(model, dims.tp)
    if parallel.sequence_parallel and seq_len is not None and seq_len % dims.tp:
        raise ConfigError(f"parallel.sequence_parallel splits sequences over tp={dims.tp} ranks: "
                          f"train.seq_len={seq_len} must be a multiple of it")
    if dims.pp > 1:
        _check_pipeline(parallel, model)
    return dims


def _check_tp_divides(model: ModelConfig, tp: int) -> None:
    sizes = {"n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads or model.n_heads,
             "the MLP width (ffn_hidden)": ffn_hidden_size(model)}
    if model.vocab_size is not None:  # unknown until the dataset is resolved
        sizes["vocab_size"] = model.vocab_size
    for name, size in sizes.items():
        if size % tp:
            hint = "; pad it with model.vocab_multiple (e.g. 64)" if name == "vocab_size" else ""
            raise ConfigError(f"parallel.tp={tp} does not divide model {name}={size}{hint}")


def _check_pipeline(parallel: ParallelConfig, model: ModelConfig) -> None:
    v, stages = parallel.pp_virtual_stages, num_stages(parallel)
    if parallel.pp_schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule} runs one stage per rank: set "
                          f"pp_virtual_stages=1 (got {v}) or choose interleaved_1f1b")
    if parallel.pp_schedule in V_SCHEDULES and v != 2:
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule} places exactly 2 stages per rank in a V: "
                          f"set pp_virtual_stages=2 (got {v})")
    if parallel.pp_schedule not in SINGLE_STAGE_SCHEDULES + V_SCHEDULES and v < 2:
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule} interleaves several stages per rank: "
                          f"set pp_virtual_stages >= 2 (got {v}), or use 1f1b")
    if parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES and parallel.sharding == "full":
        # Seen on torch 2.13 (gloo): losses off by ~20% within five steps, while the same schedules
        # with sharding gradients/optimizer (parameters kept gathered) match a single process.
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule} computes weight gradients in a separate pass "
                          "after the input gradients, which gives wrong gradients with sharding=full (FSDP2 "
                          "re-sharding parameters after forward) in torch 2.13: use sharding=gradients or "
                          "optimizer with it")
    if model.tie_embeddings:
        raise ConfigError("model.tie_embeddings shares the embedding with the output head, which live on the "
                          f"first and last pipeline stages: untie them or set parallel.pp=1 (pp={parallel.pp})")
    if parallel.pp_microbatches is not None and parallel.pp_microbatches < 1:
        raise ConfigError(f"parallel.pp_microbatches must be >= 1 or null, got {parallel.pp_microbatches}")
    if parallel.pp_layer_split:
        split = parallel.pp_layer_split
        if len(split) != stages or sum(split) != model.n_layers or min(split) < 1:
            raise ConfigError(f"parallel.pp_layer_split={split} must give >= 1 layer to each of the "
                              f"{stages} stages (pp={parallel.pp} x pp_virtual_stages={v}) and sum to "
                              f"model.n_layers={model.n_layers}")
    elif model.n_layers < stages:
        raise ConfigError(f"{stages} pipeline stages (pp={parallel.pp} x pp_virtual_stages={v}) need at least "
                          f"{stages} layers; model.n_layers={model.n_layers}")
