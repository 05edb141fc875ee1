"""A layout's parallel degrees, resolved once per world size (`ParallelDims`), and every rule its
settings must satisfy, checked before any process group exists. No torch here: the driver
resolves a run's layout before any process imports it; `raylm.parallel.mesh` builds the
DeviceMesh from the resolved degrees."""

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
    """A layout's degrees for one world size, resolved in the constructor (torchtitan's
    ParallelDims): dp_shard=-1 is inferred here, and whether FSDP2 wraps the model is decided in
    `of`; everything downstream (the mesh, the data split, the mixed precision, the memory
    planner) reads these instead of deriving one again."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    fsdp: bool
    """FSDP2's `fully_shard` wraps the model (parallel.sharding != none); on a world of one rank
    only when parallel.one_rank_fsdp or parallel.cpu_offload asks for it."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"parallel.dp_shard must be >= 1 or -1 (infer), got {self.dp_shard}")
        others = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(f"cannot infer parallel.dp_shard: world size {self.world_size} is not divisible by "
                                  f"dp_replicate={self.dp_replicate} x tp={self.tp} x pp={self.pp} = {others}")
            object.__setattr__(self, "dp_shard", self.world_size // others)
        if others * self.dp_shard != self.world_size:
            raise ConfigError(f"parallel degrees {self} multiply to {others * self.dp_shard}, but the world size "
                              f"(parallel.num_workers) is {self.world_size}; make the product equal it or set "
                              "dp_shard=-1 to infer it")

    @classmethod
    def of(cls, parallel: ParallelConfig, world_size: int) -> "ParallelDims":
        # One rank has nothing to shard, and FSDP2's per-block hooks cost more host time than a
        # GPT-2 block takes on a GPU: 0.40x nanoGPT's tokens/s on one H200 against 0.89x without
        # them (benchmarks/RESULTS.md, GPU check). An elastic run that shrinks to one worker
        # resumes its sharded checkpoint into plain tensors (DCP reshards).
        fsdp = parallel.sharding != "none" and (world_size > 1 or parallel.one_rank_fsdp or parallel.cpu_offload)
        return cls(parallel.dp_replicate, parallel.dp_shard, parallel.tp, parallel.pp, world_size, fsdp)

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas x shards): the ranks that split each global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def replicate(self) -> bool:
        """FSDP2's `replicate` (DDP) wraps the model: data-parallel ranks without sharding."""
        return self.dp_enabled and not self.fsdp

    @property
    def amp(self) -> bool:
        """No wrapper on a world of one rank: parallel.param_dtype applies as autocast over fp32
        weights and optimizer state (torchtitan's `maybe_enable_amp` on a single device)."""
        return self.world_size == 1 and not self.fsdp

    def __str__(self) -> str:
        return f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp}"


@dataclass(frozen=True)
class MixedPrecision:
    """What computes in 16 bits and who casts: `params`, the dtype FSDP2 (`fully_shard` or
    `replicate`) casts the parameters to for forward and backward; `autocast`, the dtype the
    forward runs under autocast in; None where nothing does."""

    params: Optional[str] = None
    autocast: Optional[str] = None

    @classmethod
    def of(cls, precision: str, parallel: ParallelConfig, dims: ParallelDims) -> "MixedPrecision":
        """train.precision (`precision`) and parallel.param_dtype on the layout `dims`: a wrapper
        casts the parameters; one rank without one takes param_dtype as autocast over fp32 weights
        (torchtitan's `maybe_enable_amp`); train.precision=bf16/fp16 is autocast on any layout, and
        float8 leaves the rest of the model in bf16 (autocast, unless a wrapper casts to bf16)."""
        wrapped = dims.fsdp or dims.replicate
        params = parallel.param_dtype if wrapped and parallel.param_dtype != "fp32" else None
        if precision in ("bf16", "fp16"):
            autocast: Optional[str] = precision
        elif precision == "float8":
            autocast = None if params == "bf16" else "bf16"
        elif dims.amp and parallel.param_dtype != "fp32":
            autocast = parallel.param_dtype
        else:
            autocast = None
        return cls(params, autocast)

    def __str__(self) -> str:
        parts = [f"fsdp2 {self.params}"] * bool(self.params) + [f"autocast {self.autocast}"] * bool(self.autocast)
        return " + ".join(parts) or "none"


def num_stages(parallel: ParallelConfig) -> int:
    return parallel.pp * parallel.pp_virtual_stages


def check_layout(parallel: ParallelConfig, model: ModelConfig, dims: ParallelDims,
                 seq_len: Optional[int] = None) -> None:
    """Every rule the layout's settings must satisfy with these degrees, before any process
    group exists. The vocabulary (model.vocab_size) and `seq_len` are checked when known."""
    if parallel.ac_every < 1:
        raise ConfigError(f"parallel.ac_every must be >= 1, got {parallel.ac_every}")
    for name in ("cpu_offload", "one_rank_fsdp"):
        if getattr(parallel, name) and parallel.sharding == "none":
            raise ConfigError(f"parallel.{name} needs FSDP2: set parallel.sharding to optimizer, gradients or full")
    if not dims.tp_enabled and (parallel.sequence_parallel or parallel.loss_parallel):
        raise ConfigError("parallel.sequence_parallel and parallel.loss_parallel split over the tensor-parallel "
                          f"group: they need parallel.tp > 1 (tp={dims.tp})")
    if dims.tp_enabled:
        _check_tp_divides(model, dims.tp)
    if parallel.sequence_parallel and seq_len is not None and seq_len % dims.tp:
        raise ConfigError(f"parallel.sequence_parallel splits sequences over tp={dims.tp} ranks: "
                          f"train.seq_len={seq_len} must be a multiple of it")
    if dims.pp_enabled:
        _check_pipeline(parallel, model)


def resolve_layout(parallel: ParallelConfig, model: ModelConfig, world_size: int,
                   seq_len: Optional[int] = None) -> ParallelDims:
    """The degrees for `world_size` ranks, checked against every rule (`check_layout`)."""
    dims = ParallelDims.of(parallel, world_size)
    check_layout(parallel, model, dims, seq_len)
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
    if parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES and parallel.activation_checkpointing != "none":
        # torch 2.13's composable checkpoint rebuilds a block once per backward pass, and can only once.
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule} runs each stage's backward in two passes "
                          "(input, then weight gradients), and a checkpointed block cannot be recomputed twice: "
                          f"set parallel.activation_checkpointing=none (got {parallel.activation_checkpointing}) "
                          "or choose 1f1b or interleaved_1f1b")
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
