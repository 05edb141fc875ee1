"""Choose a parallel layout: enumerate the candidates, estimate each, rank them, print a table and
the recommended `parallel:` block. The accounting itself lives in `raylm.parallel.planner.memory`.

Candidates (`enumerate_layouts`):
- dp_replicate x dp_shard x tp x pp = the number of GPUs.
- tp divides gpus_per_node (a TP group never leaves its node), n_heads and n_kv_heads.
- pp <= n_layers (uneven stages are allowed; the worst stage is estimated).
- sharding `none` is DDP over all data-parallel ranks: dp_replicate = dp, dp_shard = 1.
- optimizer | gradients | full need dp > 1: FSDP with dp_shard = dp, or HSDP with dp_replicate > 1
  and tp x dp_shard dividing gpus_per_node, so each shard group sits inside one node and only
  the replicas' gradient all-reduce crosses nodes.

A layout is the `ParallelConfig` a run uses: num_workers = the GPUs, concrete degrees, and with
tp > 1 sequence and loss parallelism on; `plan` adds the activation checkpointing mode and the
dtypes of its precision, and the recommended `parallel:` block is a dump of those fields.

One GPU is estimated as raylm builds it (`ParallelDims.fsdp`, `ParallelDims.amp`): no FSDP2
wrapper, and a 16-bit param_dtype as autocast over fp32 weights and AdamW state (the `amp`
precision's bytes, whatever precision was asked for); the block's comments say so.

A layout is feasible when raylm can run it (`raylm.parallel.layout.check_layout` accepts
it: e.g. tp divides the MLP width and vocabulary, no pipeline with tied embeddings), its per-GPU
total is at most (1 - headroom) of the GPU's memory (headroom 10% by default, for the CUDA
context, NCCL and allocator fragmentation), and the global batch splits evenly into
dp x micro_batch_size.

Ranking: feasible layouts first, by a step-time proxy = compute + communication, with no overlap
assumed: compute = flops_per_token x global batch tokens / (gpus x peak FLOP/s), times 4/3 for
blocks whose matmuls are recomputed (full, every_k; selective recomputes none) and
(m + pp - 1) / m for the 1F1B bubble with m microbatches; communication = bytes over NVLink
within a node and over the network across nodes (`Hardware`). At equal step time to two
significant figures the simpler layout wins (`_complexity`: fewer model-parallel dimensions, then
smaller pp and tp, plain data parallel before HSDP, less sharding). Infeasible layouts follow,
closest to fitting first.

GB means 1e9 bytes, the ZeRO paper's unit; `parse_memory` accepts GiB too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import yaml

from raylm.config import ConfigError, ModelConfig, ParallelConfig, load_config
from raylm.hardware import A100_FLOPS
from raylm.config.presets import MODEL_SIZES, preset
from raylm.model.sizes import count_params, flops_per_token
from raylm.parallel.planner.memory import (CHECKPOINTING, SHARDINGS, CommEstimate, MemoryEstimate,
                                   estimate_communication, estimate_memory, get_precision, layout_dims,
                                   recomputed_matmuls)
from raylm.parallel.layout import check_layout

DEFAULT_VOCAB = 50272  # OPT's (GPT-2's BPE padded); named sizes leave vocab_size to the dataset
CHECKPOINTING_CHOICES = (*CHECKPOINTING, "auto")


@dataclass(frozen=True)
class Hardware:
    """Per-GPU rates for the step-time proxy; defaults are an A100 node (NVLink 3, HDR 200 Gb/s per GPU)."""

    peak_flops: float = A100_FLOPS
    """Dense bf16 FLOP/s."""
    intra_node_bw: float = 200e9
    """Bytes/s one GPU sends in a collective inside a node (bus bandwidth)."""
    inter_node_bw: float = 25e9
    """Bytes/s one GPU sends across nodes."""


@dataclass
class PlanRow:
    layout: ParallelConfig
    memory: MemoryEstimate
    comm: CommEstimate
    n_microbatches: int
    """Per optimizer step and data-parallel rank."""
    compute_s: float
    comm_s: float
    feasible: bool
    reason: str
    """Why the layout does not fit (empty when it does)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(world_size: int, gpus_per_node: int, n_heads: int, n_layers: int,
                      n_kv_heads: Optional[int] = None, shardings: Sequence[str] = SHARDINGS,
                      max_tp: Optional[int] = None, max_pp: Optional[int] = None) -> list[ParallelConfig]:
    """Every candidate layout of `world_size` GPUs under the rule in the module docstring."""
    for name, value in (("world_size", world_size), ("gpus_per_node", gpus_per_node)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    for s in shardings:
        if s not in SHARDINGS:
            raise ConfigError(f"sharding {s!r} is not one of {', '.join(SHARDINGS)}")
    kv = n_kv_heads or n_heads

    def candidate(dp_replicate: int, dp_shard: int, tp: int, pp: int, sharding: str) -> ParallelConfig:
        return ParallelConfig(num_workers=world_size, use_gpu=True, dp_replicate=dp_replicate, dp_shard=dp_shard,
                              tp=tp, pp=pp, sharding=sharding, sequence_parallel=tp > 1, loss_parallel=tp > 1)

    layouts = []
    for tp in divisors(world_size):
        if gpus_per_node % tp or n_heads % tp or kv % tp or (max_tp and tp > max_tp):
            continue
        for pp in divisors(world_size // tp):
            if pp > n_layers or (max_pp and pp > max_pp):
                continue
            dp = world_size // (tp * pp)
            if "none" in shardings:
                layouts.append(candidate(dp, 1, tp, pp, "none"))
            if dp == 1:
                continue
            shards = [d for d in divisors(dp) if d == dp or (1 < d and gpus_per_node % (tp * d) == 0)]
            for sharding in (s for s in SHARDINGS[1:] if s in shardings):
                for d in shards:
                    layouts.append(candidate(dp // d, d, tp, pp, sharding))
    return layouts


def _complexity(layout: ParallelConfig) -> tuple[int, int, int, bool, int]:
    """Simpler sorts first: fewer model-parallel dimensions, smaller pp (the most intrusive), then
    tp, then plain data parallel before HSDP, then less sharding."""
    model_parallel = (layout.pp > 1) + (layout.tp > 1)
    hsdp = layout.dp_replicate > 1 and layout.dp_shard > 1
    return model_parallel, layout.pp, layout.tp, hsdp, SHARDINGS.index(layout.sharding)


def evaluate_layout(model_cfg: ModelConfig, layout: ParallelConfig, precision: str, seq_len: int,
                    micro_batch_size: int, global_seqs: int, gpus_per_node: int, limit: float, hardware: Hardware,
                    flash_attention: bool) -> PlanRow:
    """One layout's row of the plan: its per-GPU memory against `limit`, and its step-time proxy."""
    dims = layout_dims(layout)
    per_step = dims.dp * micro_batch_size
    m = max(1, global_seqs // per_step)
    memory = estimate_memory(model_cfg, layout, precision, seq_len, micro_batch_size, n_microbatches=m,
                             flash_attention=flash_attention, dims=dims)
    comm = estimate_communication(model_cfg, layout, precision, seq_len, micro_batch_size, m, gpus_per_node, dims)
    blocks = math.ceil(model_cfg.n_layers / dims.pp)
    recomputed = recomputed_matmuls(layout, layout.activation_checkpointing, blocks)
    compute = (flops_per_token(model_cfg, seq_len) * global_seqs * seq_len / (dims.world_size * hardware.peak_flops)
               * (1 + recomputed / 3) * (m + dims.pp - 1) / m)
    reasons = []
    try:
        check_layout(layout, model_cfg, dims)
    except ConfigError as e:
        reasons.append(f"raylm cannot run it: {e}")
    if global_seqs % per_step:
        reasons.append(f"global batch of {global_seqs} sequences does not split into dp {dims.dp} "
                       f"x micro-batch {micro_batch_size}")
    if memory.total > limit:
        reasons.append(f"{memory.total / 1e9:.1f} GB > {limit / 1e9:.1f} GB usable")
    return PlanRow(layout, memory, comm, m, compute, comm.seconds(hardware.intra_node_bw, hardware.inter_node_bw),
                   feasible=not reasons, reason="; ".join(reasons))


def plan(model_cfg: ModelConfig, gpus: int, gpus_per_node: int, gpu_memory_bytes: float,
         seq_len: Optional[int] = None, global_batch_tokens: Optional[int] = None, precision: str = "mixed",
         micro_batch_size: int = 1, activation_checkpointing: str = "none", headroom: float = 0.10,
         hardware: Hardware = Hardware(), flash_attention: bool = True) -> list[PlanRow]:
    """Every candidate layout, estimated and ranked (see the module docstring).

    global_batch_tokens None means one micro-batch per GPU: gpus x micro_batch_size x seq_len.
    activation_checkpointing applies to every layout; `auto` uses none where it fits, else selective,
    else full.
    """
    get_precision(precision)
    for name, value in (("micro_batch_size", micro_batch_size), ("gpu_memory_bytes", gpu_memory_bytes)):
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if activation_checkpointing not in CHECKPOINTING_CHOICES:
        raise ConfigError(f"activation_checkpointing {activation_checkpointing!r} is not one of "
                         f"{', '.join(CHECKPOINTING_CHOICES)}")
    if not 0 <= headroom < 1:
        raise ConfigError(f"headroom must be in [0, 1), got {headroom}")
    seq_len = seq_len or model_cfg.max_seq_len
    if seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"seq_len {seq_len} exceeds model.max_seq_len ({model_cfg.max_seq_len})")
    tokens = global_batch_tokens or gpus * micro_batch_size * seq_len
    if tokens % seq_len:
        raise ConfigError(f"global_batch_tokens {tokens} is not a multiple of seq_len {seq_len}")
    limit = gpu_memory_bytes * (1 - headroom)
    modes = ["none", "selective", "full"] if activation_checkpointing == "auto" else [activation_checkpointing]
    dtypes, _ = precision_settings(precision)
    rows = []
    for layout in enumerate_layouts(gpus, gpus_per_node, model_cfg.n_heads, model_cfg.n_layers, model_cfg.n_kv_heads):
        for mode in modes:
            row = evaluate_layout(model_cfg, replace(layout, activation_checkpointing=mode, **dtypes), precision, seq_len,
                                  micro_batch_size, tokens // seq_len, gpus_per_node, limit, hardware, flash_attention)
            if row.feasible:
                break
        rows.append(row)

    def key(row: PlanRow) -> tuple:
        if row.feasible:
            return (0, float(f"{row.step_s:.2g}"), _complexity(row.layout), row.memory.total)
        return (1, row.memory.total, _complexity(row.layout))

    return sorted(rows, key=key)


def format_table(rows: Sequence[PlanRow], top: Optional[int] = 10) -> str:
    """A ranked table, per-GPU memory terms in GB: act is without checkpointing, act-ckpt with full
    checkpointing, and total uses the layout's ckpt mode."""
    head = (f"{'#':>3} {'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'pp':>3} {'sharding':<9} {'ckpt':<9}"
            f"{'params':>7} {'grads':>6} {'optim':>6} {'master':>6} {'act':>7} {'act-ckpt':>8} {'buffers':>7}"
            f"{'total':>8} {'comm':>8} {'step s':>8}  fits")
    lines = [head, "-" * len(head)]
    for i, row in enumerate(rows[:top] if top else rows, 1):
        lay, mem = row.layout, row.memory
        gb = [x / 1e9 for x in (mem.params, mem.grads, mem.optimizer, mem.master, mem.activations_no_checkpointing,
                                mem.activations_full_checkpointing, mem.buffers, mem.total, row.comm.total)]
        lines.append(f"{i:>3} {lay.dp_replicate:>6} {lay.dp_shard:>8} {lay.tp:>3} {lay.pp:>3} {lay.sharding:<9} "
                     f"{lay.activation_checkpointing:<9}{gb[0]:>7.2f} {gb[1]:>6.2f} {gb[2]:>6.2f} {gb[3]:>6.2f} "
                     f"{gb[4]:>7.2f} {gb[5]:>8.2f} {gb[6]:>7.2f}{gb[7]:>8.2f} {gb[8]:>8.1f} {row.step_s:>8.2f}  "
                     f"{'yes' if row.feasible else 'no: ' + row.reason}")
    if top and len(rows) > top:
        lines.append(f"... {len(rows) - top} more layouts")
    return "\n".join(lines)


def precision_settings(precision: str, one_gpu: bool = False) -> tuple[dict[str, str], list[str]]:
    """The ParallelConfig dtypes that train as `precision` is estimated, and notes on what lies
    outside them; `one_gpu` (`ParallelDims.amp`: one rank, no FSDP2) notes instead what raylm
    builds there."""
    dtypes, notes = {}, []
    if precision in ("mixed", "bf16"):  # 2-byte gradients, as the estimate counts them
        dtypes.update(param_dtype="bf16", reduce_dtype="bf16")
    elif precision == "fp16":
        dtypes["param_dtype"] = "fp16"
    if one_gpu:
        notes.append("one GPU: no FSDP2 wrapper (its per-block hooks cost more host time than a small model's "
                     "blocks take on a GPU, and one rank has nothing to shard); parallel.one_rank_fsdp: true asks "
                     "for one (the multi-GPU layout)")
        if "param_dtype" in dtypes:
            notes.append(f"param_dtype: {dtypes['param_dtype']} runs as {dtypes['param_dtype']} autocast over fp32 "
                         "weights and AdamW state: estimated as `amp`"
                         + (", with dynamic loss scaling" if precision == "fp16" else ""))
    if precision == "bf16" and not one_gpu:
        notes.append("raylm keeps fp32 master weights and AdamW state: expect the `mixed` estimate")
    elif precision == "fp16" and not one_gpu:
        notes.append("raylm scales the fp16 loss dynamically and reduces gradients in fp32 (2 bytes each more)")
    elif precision == "amp":
        notes.append("with train.precision: bf16 (autocast over fp32 weights)")
    return dtypes, notes


def parallel_settings(layout: ParallelConfig) -> dict:
    """The fields of `layout` that the planner decides, as `parallel:` keys: the GPUs and degrees
    always, the rest where they are on (sequence and loss parallelism with tp > 1, checkpointing,
    ac_every with every_k, dtypes other than fp32)."""
    block: dict = {name: getattr(layout, name)
                   for name in ("num_workers", "use_gpu", "dp_replicate", "dp_shard", "tp", "pp", "sharding")}
    if layout.tp > 1:
        block.update(sequence_parallel=layout.sequence_parallel, loss_parallel=layout.loss_parallel)
    if layout.activation_checkpointing != "none":
        block["activation_checkpointing"] = layout.activation_checkpointing
        if layout.activation_checkpointing == "every_k":
            block["ac_every"] = layout.ac_every
    reduced = ("param_dtype",) if layout_dims(layout).amp else ("param_dtype", "reduce_dtype")  # one GPU reduces nothing
    block.update((name, getattr(layout, name)) for name in reduced if getattr(layout, name) != "fp32")
    return block


def parallel_block_yaml(row: PlanRow, precision: str = "mixed") -> str:
    """The `parallel:` block for `row` in ParallelConfig's keys, the estimate and the notes on
    `precision` as comments."""
    block, (_, notes) = parallel_settings(row.layout), precision_settings(precision, layout_dims(row.layout).amp)
    header = [f"raylm plan: {row.memory.total / 1e9:.1f} GB per GPU, step ~{row.step_s:.2f} s "
              f"({row.n_microbatches} micro-batches per rank)", *notes]
    return "".join(f"# {line}\n" for line in header) + yaml.safe_dump({"parallel": block}, sort_keys=False)


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_memory(text: str, name: str = "memory size") -> int:
    """'80GB' -> 80e9 bytes, '80GiB' -> 80 * 2**30. GB is decimal, as in the ZeRO paper; an
    "80GB" A100 has 80 GiB, so passing 80GB leaves a further 7% of margin. `name` is what an
    error calls the text (the option it came from)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ConfigError(f"{name} {text!r} is not a number with a unit: expected e.g. 80GB, 80GiB, 512MB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def model_from_arg(model: str, vocab_size: Optional[int] = None) -> tuple[ModelConfig, Optional[int], list[str]]:
    """A named size or a YAML config path -> (ModelConfig, the config's train.seq_len, notes)."""
    notes = []
    seq_len = None
    if model in MODEL_SIZES:
        cfg = ModelConfig(size=model, **preset(model))
    elif Path(model).is_file():
        full = load_config(model)
        cfg, seq_len = full.model, full.train.seq_len
    else:
        raise ConfigError(f"model {model!r} is neither a named size ({', '.join(MODEL_SIZES)}) nor a config file")
    if vocab_size is not None:
        cfg = replace(cfg, vocab_size=vocab_size)
    elif cfg.vocab_size is None:
        cfg = replace(cfg, vocab_size=DEFAULT_VOCAB)
        notes.append(f"model.vocab_size is unset: assuming {DEFAULT_VOCAB}")
    return cfg, seq_len, notes


def check_whole_nodes(gpus: int, gpus_per_node: int, gpus_key: str = "--gpus",
                      per_node_key: str = "--gpus-per-node") -> None:
    """Refuse a GPU count that is not whole nodes, naming it by `gpus_key` and `per_node_key` (the
    options of `raylm plan`, or a sweep's target keys). A cluster is whole nodes; fewer GPUs than
    one node holds is one partly used node."""
    if gpus > gpus_per_node and gpus % gpus_per_node:
        whole = gpus - gpus % gpus_per_node
        raise ConfigError(f"{gpus_key} {gpus} is not a whole number of nodes of {per_node_key} {gpus_per_node}: "
                          f"give a multiple of it (e.g. {whole} or {whole + gpus_per_node}), or fewer GPUs than "
                          "one node holds")


def run_plan(model: str, gpus: int, gpus_per_node: int, gpu_memory: str, seq_len: Optional[int] = None,
             global_batch_tokens: Optional[int] = None, precision: str = "mixed", micro_batch_size: int = 1,
             output: Optional[str] = None, activation_checkpointing: str = "none",
             vocab_size: Optional[int] = None, top: int = 10, overwrite: bool = False) -> tuple[str, bool]:
    """`raylm plan`: the ranked table and recommended block as text, and whether any layout fits;
    the block also goes to `output` (a YAML file; an existing one only with `overwrite`)."""
    if output is not None and (Path(output).is_dir() or not Path(output).parent.is_dir()):
        problem = "is a directory" if Path(output).is_dir() else "is in a directory that does not exist"
        raise ConfigError(f"--output {output} {problem}: give the path of the YAML file to write")
    if output is not None and Path(output).exists() and not overwrite:
        raise FileExistsError(f"--output {output} already exists; pass --overwrite to replace it")
    check_whole_nodes(gpus, gpus_per_node)
    memory = parse_memory(gpu_memory, "--gpu-memory")
    if memory <= 0:
        raise ConfigError(f"--gpu-memory {gpu_memory} is no memory: give each GPU's memory, e.g. 80GB")
    cfg, config_seq_len, notes = model_from_arg(model, vocab_size)
    seq_len = seq_len or config_seq_len or cfg.max_seq_len
    rows = plan(cfg, gpus, gpus_per_node, memory, seq_len, global_batch_tokens, precision, micro_batch_size,
                activation_checkpointing)
    tokens = global_batch_tokens or gpus * micro_batch_size * seq_len
    lines = [f"# model {cfg.size or model}: {count_params(cfg) / 1e9:.2f}B parameters; {gpus} GPUs "
             f"({gpus_per_node} per node, {memory / 1e9:.1f} GB each); seq_len {seq_len}, "
             f"{tokens} tokens per step, micro-batch {micro_batch_size}, precision {precision}"]
    lines += [f"# note: {n}" for n in notes]
    lines += ["", format_table(rows, top), ""]
    if rows and rows[0].feasible:
        block = parallel_block_yaml(rows[0], precision)
        lines += ["Recommended:", block]
        if output:
            Path(output).write_text(block)
            lines.append(f"# wrote {output}")
    else:
        lines.append("No layout fits: try more GPUs, activation checkpointing, or a smaller micro-batch.")
    return "\n".join(lines), bool(rows and rows[0].feasible)
