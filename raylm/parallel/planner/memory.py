"""Per-GPU memory and per-step communication of a parallel layout: the accounting behind `raylm plan`.

Pure arithmetic on a `ModelConfig` and a layout, the `ParallelConfig` a run uses (its degrees over
`num_workers` GPUs and how activations are kept); nothing here touches torch.distributed.

Bytes per parameter (Ψ = the parameters one GPU's model replica holds after tensor and pipeline
splitting; Adam keeps two moments, m and v):

| precision | params | grads | Adam m+v | master | total | activations | what it models                  |
|-----------|--------|-------|----------|--------|-------|-------------|---------------------------------|
| bf16      | 2      | 2     | 2+2      | -      | 8Ψ    | 16-bit      | pure bf16, states too           |
| mixed     | 2      | 2     | 4+4      | 4      | 16Ψ   | 16-bit      | ZeRO paper: 2Ψ + 2Ψ + 12Ψ       |
| fp16      | 2      | 2     | 4+4      | 4      | 16Ψ   | 16-bit      | as mixed                        |
| amp       | 4      | 4     | 4+4      | -      | 16Ψ   | 16-bit      | fp32 weights under bf16 autocast (*) |
| fp32      | 4      | 4     | 4+4      | -      | 16Ψ   | 32-bit      | everything fp32                 |

(*) raylm's `train.precision: bf16`, and what a one-GPU run without FSDP2 makes of
`parallel.param_dtype: bf16` (`ParallelDims.amp`): `estimate_memory` counts mixed, bf16 and fp16 as
amp there. Autocast also keeps the bf16 copy of every weight it cast, saved for backward, whatever
the sharding: 2Ψ more, counted with the buffers.

What the data-parallel shard degree D = `dp_shard` divides (with HSDP only the shard dimension
counts; replicas each hold a full shard set):

| sharding        | params | grads | optimizer + master |
|-----------------|--------|-------|--------------------|
| none (DDP)      | Ψ      | Ψ     | Ψ                  |
| optimizer ZeRO-1| Ψ      | Ψ     | Ψ/D                |
| gradients ZeRO-2| Ψ      | Ψ/D   | Ψ/D                |
| full ZeRO-3     | Ψ/D    | Ψ/D   | Ψ/D                |

Terms are what a GPU holds at its peak within a step: raylm's ZeRO-1/2 keep parameters gathered
through the step (raylm/parallel/fsdp.py), hence whole. The ZeRO convention counts 16-bit
gradients for `mixed`; the planner's `parallel:` block sets reduce_dtype bf16 to match (fp32
reductions keep 2 more bytes per gradient).

Tensor parallelism divides every parameter by tp (blocks column/row-wise, embeddings and head
vocab-parallel; norm gains and learned positions are replicated but small). Pipeline parallelism
gives each stage ceil(n_layers / pp) blocks (an upper bound on raylm's parameter-balanced split);
the token (and learned position) embedding lives on the first stage, the final norm and head on
the last (a tied head is a second copy there). Estimates are for the worst stage.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models": per layer s·b·h·(34 + 5·a·s/h) bytes in 16-bit for a GeLU 4h MLP with
dropout (`flash_attention=False`), divided by tp with sequence parallelism (which the planner
always turns on with TP; `parallel.sequence_parallel=False` gives the paper's 10 + 24/t form).
The 34 is generalised from the config (MLP width and kind, GQA; dropout masks only when
dropout > 0). By default `flash_attention=True` drops the 5·a·s²·b score terms: raylm's attention
is `scaled_dot_product_attention`, whose GPU kernels keep no s x s scores. Full checkpointing
keeps each block's input (2·s·b·h) plus one block's activations during recompute. Selective
checkpointing (raylm/parallel/fsdp.py) keeps each block's input and the outputs of its matmuls and
attention, in the paper's units s·b·h·(10 + 4·kv + 4·f/h) for SwiGLU (2·f/h for a GeLU or ReLU
MLP), kv the key/value heads over the heads and f the MLP width: 22·s·b·h for the paper's GeLU 4h
block, against 34 (`selective_layer_bytes`); no scores and no dropout masks, which it recomputes.
1F1B keeps min(pp, microbatches) microbatches in flight on the first stage; the last stage adds
the logits.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Optional

from raylm.config import ActivationCheckpointing, ConfigError, ModelConfig, ParallelConfig, Sharding
from raylm.model.sizes import count_params
from raylm.model.sizes import ffn_hidden_size
from raylm.parallel.layout import ParallelDims

SHARDINGS: tuple[str, ...] = typing.get_args(Sharding)
CHECKPOINTING: tuple[str, ...] = typing.get_args(ActivationCheckpointing)


@dataclass(frozen=True)
class Precision:
    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """Adam m and v together."""
    master_bytes: int
    activation_bytes: int
    autocast_copy_bytes: int = 0
    """Per parameter: the low-precision weight copies autocast saves for backward."""


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision("bf16", 2, 2, 4, 0, 2),
    "mixed": Precision("mixed", 2, 2, 8, 4, 2),
    "fp16": Precision("fp16", 2, 2, 8, 4, 2),
    "amp": Precision("amp", 4, 4, 8, 0, 2, autocast_copy_bytes=2),
    "fp32": Precision("fp32", 4, 4, 8, 0, 4),
}


def get_precision(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def applied_precision(precision: str | Precision, dims: ParallelDims) -> Precision:
    """The precision a layout trains `precision` in: 16-bit parameters are FSDP2's cast, so where
    no wrapper casts them (one GPU without FSDP2, `ParallelDims.amp`) the weights and AdamW stay
    fp32 under autocast, as `amp` counts them."""
    prec = get_precision(precision)
    return PRECISIONS["amp"] if dims.amp and prec.param_bytes == 2 else prec


def layout_dims(parallel: ParallelConfig) -> ParallelDims:
    """The degrees of `parallel` on its `num_workers` GPUs, after checking the fields the
    accounting reads; an error names the field and what is valid. For callers that estimate one
    layout; the planner resolves each candidate once and hands the degrees in."""
    if parallel.num_workers < 1:
        raise ConfigError(f"parallel.num_workers must be >= 1, got {parallel.num_workers}")
    if parallel.ac_every < 1:
        raise ConfigError(f"parallel.ac_every must be >= 1, got {parallel.ac_every}")
    if parallel.sharding not in SHARDINGS:
        raise ConfigError(f"parallel.sharding {parallel.sharding!r} is not one of {', '.join(SHARDINGS)}")
    if parallel.activation_checkpointing not in CHECKPOINTING:
        raise ConfigError(f"parallel.activation_checkpointing {parallel.activation_checkpointing!r} "
                         f"is not one of {', '.join(CHECKPOINTING)}")
    return ParallelDims.of(parallel, parallel.num_workers)


@dataclass(frozen=True)
class ModelShape:
    """What the accounting needs of a model, with exact parameter counts from `count_params`."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab: int
    mlp: str
    dropout: bool
    block_params: int
    first_params: int
    """Outside the blocks, on the first pipeline stage: token and position embeddings."""
    last_params: int
    """Outside the blocks, on the last stage: final norm and an untied head."""
    tied: bool
    total_params: int


def model_shape(cfg: ModelConfig) -> ModelShape:
    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size is None: the planner needs an explicit vocabulary size")
    total = count_params(cfg)
    # One block's parameters as a difference of counts, so the split stays exact whatever the
    # block holds (biases, norms, GQA projections).
    block = count_params(dataclasses.replace(cfg, n_layers=2)) - count_params(dataclasses.replace(cfg, n_layers=1))
    vocab = cfg.vocab_size
    first = vocab * cfg.d_model + (cfg.max_seq_len * cfg.d_model if cfg.pos_embedding == "learned" else 0)
    return ModelShape(
        n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads or cfg.n_heads, ffn_hidden=ffn_hidden_size(cfg), vocab=vocab, mlp=cfg.mlp,
        dropout=cfg.dropout > 0, block_params=block, first_params=first,
        last_params=total - cfg.n_layers * block - first, tied=cfg.tie_embeddings, total_params=total,
    )


def model_state_bytes(n_params: float, precision: str | Precision, sharding: str, dp_shard: int) -> dict[str, float]:
    """The ZeRO table: params, grads, optimizer and master bytes for `n_params` on one GPU."""
    prec = get_precision(precision)
    if sharding not in SHARDINGS:
        raise ConfigError(f"sharding {sharding!r} is not one of {', '.join(SHARDINGS)}")
    level = SHARDINGS.index(sharding)  # 0 DDP .. 3 ZeRO-3
    opt_div = dp_shard if level >= 1 else 1
    grad_div = dp_shard if level >= 2 else 1
    param_div = dp_shard if level >= 3 else 1
    return {
        "params": n_params * prec.param_bytes / param_div,
        "grads": n_params * prec.grad_bytes / grad_div,
        "optimizer": n_params * prec.optimizer_bytes / opt_div,
        "master": n_params * prec.master_bytes / opt_div,
    }


def layer_activation_bytes(shape: ModelShape, seq_len: int, micro_batch_size: int, tp: int,
                           precision: Precision, flash_attention: bool = True,
                           sequence_parallel: bool = True) -> float:
    """One block's saved activations for one microbatch (Korthikanti et al. 2022).

    flash_attention=False is the paper's s·b·h·(34 + 5·a·s/h) for a GeLU 4h block with dropout:
    divided by tp with sequence parallelism, s·b·h·(10 + 24/t + 5·a·s/(h·t)) without.
    """
    s, b, h, a = seq_len, micro_batch_size, shape.d_model, shape.n_heads
    u = precision.activation_bytes / 2  # the paper counts 2 bytes per element
    kv = shape.n_kv_heads / shape.n_heads
    # Inputs of QKV, Q, K, V, the output projection and the two norms, in units of s·b·h·2 bytes
    # (the paper's 10 + 4 with kv = 1).
    attention_and_norms = 2 + 2 + 4 * kv + 2 + 4
    ratio = shape.ffn_hidden / h
    mlp = 2 + (8 * ratio if shape.mlp == "swiglu" else 4 * ratio)  # 2 + 16 for GeLU 4h
    masks = 2 if shape.dropout else 0  # two 1-byte residual dropout masks
    # Without SP the norms' inputs, the QKV and MLP inputs and the dropout masks are whole on
    # every TP rank (the paper's 10); the rest is split by heads or MLP columns.
    whole = 0 if sequence_parallel else (4 + 2 + 2) * u + masks
    split = (attention_and_norms + mlp) * u + masks - whole
    scores = 0.0
    if not flash_attention:  # softmax output (2), its dropout mask (1) and output (2) per score
        scores = a * s * s * b * (2 * u + ((1 + 2 * u) if shape.dropout else 0))
    return s * b * h * whole + (s * b * h * split + scores) / tp


def selective_layer_bytes(shape: ModelShape, seq_len: int, micro_batch_size: int, tp: int,
                          precision: Precision, sequence_parallel: bool = True) -> float:
    """One block's kept activations under selective checkpointing, for one microbatch: what its
    policy saves (the matmuls' and attention's outputs) plus the block's input.

    In units of s·b·h·2 bytes: the block input (2), Q, K and V (2 + 4·kv), the attention output
    (2; its log-sum-exp, 4 bytes per head and token, is left out), the MLP's up projections (4·f/h
    for SwiGLU's two, 2·f/h for one) and the outputs of the two row-split projections, wo and w2
    (2 + 2). Under TP those two are partial sums of the whole sequence, kept before their
    reduction, so they never divide by tp; with sequence parallelism their reduce-scattered
    outputs are kept too (2 + 2, divided by tp like the block input).
    """
    s, b, h = seq_len, micro_batch_size, shape.d_model
    u = precision.activation_bytes / 2  # the paper counts 2 bytes per element
    kv = shape.n_kv_heads / shape.n_heads
    ratio = shape.ffn_hidden / h
    up = 4 * ratio if shape.mlp == "swiglu" else 2 * ratio
    split = (2 + 4 * kv + 2 + up) * u  # whole heads and MLP columns per TP rank
    partial_sums = (2 + 2) * u
    sp = sequence_parallel and tp > 1
    sequence = (2 + (4 if sp else 0)) * u
    return s * b * h * (partial_sums + split / tp + sequence / (tp if sp else 1))


@dataclass
class MemoryEstimate:
    """Per-GPU bytes on the worst pipeline stage."""

    params: float
    grads: float
    optimizer: float
    master: float
    activations: float
    """For the layout's activation_checkpointing mode; the total uses this one."""
    activations_no_checkpointing: float
    activations_full_checkpointing: float
    buffers: float
    """Communication buffers (FSDP unsharded units and gradients, DDP buckets) and autocast's
    weight copies."""
    stage: int

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer + self.master

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers


def _stage_params(shape: ModelShape, dims: ParallelDims, stage: int) -> tuple[int, float, float]:
    """(blocks, per-GPU parameters of one block, per-GPU parameters outside the blocks) of a stage."""
    blocks = math.ceil(shape.n_layers / dims.pp)
    if dims.pp == 1:
        other = shape.first_params + shape.last_params
    elif stage == 0:
        other = shape.first_params
    else:  # a tied head is a second copy of the embedding on the last stage
        other = shape.last_params + (shape.vocab * shape.d_model if shape.tied else 0)
    return blocks, shape.block_params / dims.tp, other / dims.tp


def checkpointed_blocks(parallel: ParallelConfig, mode: str, blocks: int) -> int:
    """How many of a stage's `blocks` recompute activations in backward under checkpointing `mode`:
    full and every_k keep only those blocks' inputs; selective recomputes the cheap ops of every
    block (and, under TP, the all-gathers of its matmuls' inputs)."""
    return {"none": 0, "full": blocks, "every_k": math.ceil(blocks / parallel.ac_every), "selective": blocks}[mode]


def recomputed_matmuls(parallel: ParallelConfig, mode: str, blocks: int) -> float:
    """The fraction of a stage's block matmuls that run again in backward: selective keeps every
    one (its recompute, norms and elementwise ops, is outside a FLOP count)."""
    return 0.0 if mode == "selective" else checkpointed_blocks(parallel, mode, blocks) / blocks


def _activations(shape: ModelShape, parallel: ParallelConfig, dims: ParallelDims, precision: Precision,
                 seq_len: int, micro_batch_size: int, stage: int, in_flight: int, mode: str,
                 flash_attention: bool) -> float:
    blocks = math.ceil(shape.n_layers / dims.pp)
    sp = parallel.sequence_parallel
    full = layer_activation_bytes(shape, seq_len, micro_batch_size, dims.tp, precision, flash_attention, sp)
    layer_input = seq_len * micro_batch_size * shape.d_model * precision.activation_bytes / (dims.tp if sp else 1)
    checkpointed = checkpointed_blocks(parallel, mode, blocks)
    if mode == "selective":
        stored = blocks * selective_layer_bytes(shape, seq_len, micro_batch_size, dims.tp, precision, sp)
    else:
        stored = checkpointed * layer_input + (blocks - checkpointed) * full
    # One block's activations rebuilt at a time (under selective fewer: it reuses the kept outputs).
    recompute = full if checkpointed else 0.0
    act = in_flight * stored + recompute
    if stage == dims.pp - 1:  # logits, plus fp32 log-probabilities and their gradient for the loss
        logits = seq_len * micro_batch_size * shape.vocab * (precision.activation_bytes + 8)
        act += logits / (dims.tp if parallel.loss_parallel else 1)
    return act


def _buffers(parallel: ParallelConfig, dims: ParallelDims, prec: Precision, n_local: float, block: float,
             other: float) -> float:
    return n_local * prec.autocast_copy_bytes + _comm_buffers(parallel, dims, prec, n_local, block, other)


def _comm_buffers(parallel: ParallelConfig, dims: ParallelDims, prec: Precision, n_local: float, block: float,
                  other: float) -> float:
    """As raylm applies data parallelism (raylm/parallel/fsdp.py): FSDP2 units of one block each,
    and the embeddings and head; DDP is FSDP2's `replicate` over the same units."""
    if dims.dp == 1:
        return 0.0
    unit_grads = max(block, other) * prec.grad_bytes  # flat copy for one unit's reduction
    if parallel.sharding == "none" or dims.dp_shard == 1:
        return unit_grads
    if parallel.sharding == "full":
        # The embeddings and head stay gathered from forward through backward; the next block
        # is prefetched while one computes.
        return (other + 2 * block) * prec.param_bytes + unit_grads
    # ZeRO-1/2 keep parameters gathered through the step (the params term); without a master
    # copy, the sharded parameters FSDP2 steps on are a second, sharded copy of the weights.
    return unit_grads + (0.0 if prec.master_bytes else n_local * prec.param_bytes / dims.dp_shard)


def estimate_memory(model_cfg: ModelConfig, parallel: ParallelConfig, precision: str | Precision = "mixed",
                    seq_len: Optional[int] = None, micro_batch_size: int = 1,
                    n_microbatches: Optional[int] = None, flash_attention: bool = True,
                    dims: Optional[ParallelDims] = None) -> MemoryEstimate:
    """Per-GPU memory of the layout `parallel` (over its num_workers GPUs) on its worst pipeline stage.

    `precision` as the layout applies it (`applied_precision`). `n_microbatches` (per optimizer
    step and data-parallel rank) bounds the microbatches 1F1B keeps in flight; None assumes at
    least pp. `flash_attention` (SDPA's GPU kernels, which raylm's attention uses) keeps no s x s
    attention scores. `dims`: the layout's degrees when the caller has resolved them
    (`layout_dims` otherwise).
    """
    dims = dims or layout_dims(parallel)
    prec = applied_precision(precision, dims)
    shape = model_shape(model_cfg)
    seq_len = seq_len or model_cfg.max_seq_len
    m = n_microbatches or dims.pp
    mode = parallel.activation_checkpointing
    worst: Optional[MemoryEstimate] = None
    for stage in sorted({0, dims.pp - 1}):
        blocks, block, other = _stage_params(shape, dims, stage)
        n_local = blocks * block + other
        in_flight = min(dims.pp - stage, m)
        act = {kept: _activations(shape, parallel, dims, prec, seq_len, micro_batch_size, stage, in_flight, kept,
                                  flash_attention)
               for kept in {"none", "full", mode}}
        est = MemoryEstimate(activations=act[mode],
                             activations_no_checkpointing=act["none"], activations_full_checkpointing=act["full"],
                             buffers=_buffers(parallel, dims, prec, n_local, block, other), stage=stage,
                             **model_state_bytes(n_local, prec, parallel.sharding, dims.dp_shard))
        if worst is None or est.total > worst.total:
            worst = est
    assert worst is not None
    return worst


@dataclass
class CommEstimate:
    """Bytes one GPU sends per optimizer step, by kind, and how many of them cross nodes."""

    data_parallel: float
    tensor_parallel: float
    pipeline: float
    inter_node: float

    @property
    def total(self) -> float:
        return self.data_parallel + self.tensor_parallel + self.pipeline

    def seconds(self, intra_node_bw: float, inter_node_bw: float) -> float:
        """Transfer time at the given per-GPU bandwidths (bytes/s), with no overlap."""
        return (self.total - self.inter_node) / intra_node_bw + self.inter_node / inter_node_bw


def _ring(n: int) -> float:
    """The fraction of a buffer each rank sends in a ring all-gather or reduce-scatter."""
    return (n - 1) / n


def estimate_communication(model_cfg: ModelConfig, parallel: ParallelConfig, precision: str | Precision = "mixed",
                           seq_len: Optional[int] = None, micro_batch_size: int = 1, n_microbatches: int = 1,
                           gpus_per_node: int = 8, dims: Optional[ParallelDims] = None) -> CommEstimate:
    """Ring-collective bytes sent per GPU per optimizer step of `n_microbatches` microbatches.

    Ranks are laid out pp, dp_replicate, dp_shard, tp from outermost to innermost (torchtitan's
    mesh order), so a group stays inside a node when its span of ranks fits in gpus_per_node.
    As raylm/parallel/fsdp.py schedules them: DDP and ZeRO-1 reduce gradients once per step, ZeRO-2
    and ZeRO-3 reduce-scatter every microbatch; ZeRO-1/2 gather parameters once per step, ZeRO-3
    twice per microbatch (forward and backward). `dims` as in `estimate_memory`.
    """
    dims = dims or layout_dims(parallel)
    prec = get_precision(precision)
    shape = model_shape(model_cfg)
    seq_len = seq_len or model_cfg.max_seq_len
    m = n_microbatches
    blocks = math.ceil(shape.n_layers / dims.pp)
    n_local = max(b * block + other for b, block, other in
                  (_stage_params(shape, dims, stage) for stage in {0, dims.pp - 1}))
    tp, ds, dr = dims.tp, dims.dp_shard, dims.dp_replicate

    transfers: list[tuple[float, int]] = []  # (bytes, span of ranks the group covers)
    if parallel.sharding == "none" or ds == 1:  # all-reduce = reduce-scatter + all-gather
        transfers.append((2 * _ring(dims.dp) * n_local * prec.grad_bytes, tp * dims.dp))
    else:
        syncs = 1 if parallel.sharding == "optimizer" else m
        gathers = 2 * m if parallel.sharding == "full" else 1
        transfers.append((_ring(ds) * n_local * (gathers * prec.param_bytes + syncs * prec.grad_bytes), tp * ds))
        # HSDP: replicas all-reduce their gradient shards.
        transfers.append((syncs * 2 * _ring(dr) * n_local / ds * prec.grad_bytes, tp * ds * dr))
    data_parallel = sum(volume for volume, _ in transfers)

    sbh = seq_len * micro_batch_size * shape.d_model * prec.activation_bytes
    tensor_parallel = 0.0
    if tp > 1:  # an SP all-gather + reduce-scatter pair moves what one all-reduce does
        recomputed = checkpointed_blocks(parallel, parallel.activation_checkpointing, blocks)
        tensor_parallel = m * (4 * blocks + 2 * recomputed) * 2 * _ring(tp) * sbh
    # A middle stage sends each microbatch's activations forward and its gradient backward, whole
    # sequences even with SP.
    pipeline = m * 2 * sbh if dims.pp > 1 else 0.0
    transfers.append((pipeline, 2 * dims.dp * tp))  # neighbouring stages are dp*tp ranks apart
    inter = sum(volume for volume, span in transfers if span > gpus_per_node)
    return CommEstimate(data_parallel=data_parallel, tensor_parallel=tensor_parallel, pipeline=pipeline,
                        inter_node=inter)
