"""The typed configuration of a raylm run: one dataclass per section, the whole run in `Config`.

One `Config` describes a run from a laptop to a cluster. Field docstrings (the string literal
under each field) are the help text shown by `raylm train --help-config` (`raylm.config.describe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

CONFIG_FILE = "config.yaml"  # the resolved config, in every run directory and checkpoint

# Choices that other modules enumerate (`typing.get_args`) rather than repeat.
LRScheduleName = Literal["cosine", "linear", "inverse_sqrt", "wsd", "constant"]
Sharding = Literal["none", "optimizer", "gradients", "full"]
ActivationCheckpointing = Literal["none", "full", "every_k", "selective"]
PipelineScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                               "zbv_zero_bubble", "dualpipev"]


@dataclass
class ModelConfig:
    size: Optional[str] = None
    """Named size (see `raylm.config.presets.MODEL_SIZES`); its values are defaults that the
    other keys given next to it override."""
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    """Key/value heads: None or n_heads for MHA, 1 for MQA, a divisor of n_heads for GQA."""
    vocab_size: Optional[int] = None
    """None takes the prepared dataset's vocabulary size (padded to vocab_multiple);
    an explicit value smaller than the tokenizer's vocabulary is an error."""
    vocab_multiple: int = 1
    """Pad the embedding table to a multiple of this (64 speeds up GPU matmuls)."""
    max_seq_len: int = 256
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    pos_embedding: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    attention: Literal["causal", "document"] = "causal"
    """causal: a token attends to every earlier token of its packed row, across documents.
    document: only to earlier tokens of its own document (documents end with the tokenizer's
    end-of-text token), with positions restarting at each document; training and its validation
    loss only: generation, `raylm eval` and export treat a sequence as one document."""
    mlp: Literal["swiglu", "gelu", "relu"] = "swiglu"
    ffn_hidden: Optional[int] = None
    """MLP hidden width; None gives 4*d_model (gelu, relu) or the LLaMA 2/3 * 4*d_model
    rounded up to ffn_multiple (swiglu)."""
    ffn_multiple: int = 64
    parallel_block: bool = False
    """PaLM-style block: attention and MLP read the same normed input and are summed."""
    tie_embeddings: bool = False
    bias: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    parametrization: Literal["standard", "mup"] = "standard"
    """mup: the maximal update parametrization (raylm.model.mup), under which the best learning
    rate and init stay put as d_model grows: tune them at mup_base_width, train every width at them."""
    mup_base_width: Optional[int] = None
    """The d_model at which mup and standard are the same model (mup needs it)."""
    mup_base_head_dim: Optional[int] = None
    """The base model's head size, against which mup's attention scale 1/d_head is taken. None:
    mup_base_width / n_heads, for widths that keep the head count; widths that keep the head size
    and add heads (the sweep's ladders) give that size, so the scale stays 1/sqrt(d_head)."""
    mup_output_multiplier: float = 1.0
    """µP's output multiplier (the guide's alpha_output): the logits are multiplied by it / (d_model /
    mup_base_width). Tuned at the base width with the LR and kept at every width; 1 leaves the base
    the standard model."""


@dataclass
class MixtureComponent:
    path: str
    """Prepared dataset directory or s3:// URI."""
    weight: float = 1.0


@dataclass
class DataConfig:
    path: str = ""
    """Prepared dataset (directory or s3:// URI written by `raylm prepare`)."""
    mixture: list[MixtureComponent] = field(default_factory=list)
    """Weighted datasets to interleave instead of `path` (weights are normalised; each at least
    1/1000 of their sum). Like seed and chunk_rows, fixed once a run has trained: a resume
    refuses another order of the samples."""
    seed: int = 0
    """Seeds the sample order: the order is a pure function of (manifests, seed, epoch)."""
    chunk_rows: int = 64
    """Rows read together and shuffled as a unit; smaller means finer shuffling, more reads. A
    global batch of fewer rows trains several steps in a row on one passage (warned of at start)."""
    loader: Literal["auto", "ray", "local"] = "auto"
    """`ray` reads rows in one reader actor per rank (on the rank's node when it has room), a
    few spans of steps ahead; `local` reads with pyarrow on a thread of the
    training process. auto: `ray` on a joined cluster, `local` on a Ray that raylm starts on this
    machine (a reader actor would cost a one-machine run seconds of start-up and buy nothing)
    and in runs without Ray."""
    verify: Union[bool, Literal["once"]] = "once"
    """Check every shard's checksum and row count on the driver before training starts. once: the
    first start reads the dataset and records the verification beside it (verified.json); a later
    run or resubmit finds it unchanged (the same manifest; each file of the size and modification
    time it had) and reads nothing but a listing. true: at every start. false: never (the stream
    still refuses a shard that holds fewer rows than its manifest lists)."""
    prefetch_chunks: int = 4
    shard_cache_mb: int = 1024
    """Each reading process keeps whole shards in memory when the split fits in this many MiB
    (one fetch per shard); a larger split is read by the row groups each batch needs. 0: never cache."""
    skip: list[list[int]] = field(default_factory=list)
    """Global sample ranges [start, end) never fed to the model (rolling past bad data)."""


@dataclass
class OptimConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Applied to 2-D parameters (weight matrices, embeddings) only, never to biases or norm gains."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""


@dataclass
class ScheduleConfig:
    name: LRScheduleName = "cosine"
    warmup_steps: int = 100
    min_lr: float = 3e-5
    """Floor of cosine and wsd decay."""
    final_lr_fraction: float = 0.1
    """`linear`: decay to this fraction of lr at the last step (OPT used 0.1)."""
    decay_fraction: float = 0.2
    """`wsd`: the final fraction of steps spent decaying to min_lr."""


@dataclass
class BatchRampup:
    """Megatron's --rampup-batch-size: the global batch grows from `start` by `increment` in
    equal shares of `samples`, then stays at the configured global batch (PaLM, GPT-3)."""

    start: int
    increment: int
    samples: int
    """Samples consumed over the whole ramp."""


@dataclass
class ProfileConfig:
    """A PyTorch profiler trace of a few steps: one Chrome/Perfetto JSON file per rank in
    <run>/profile/ (open it in https://ui.perfetto.dev or chrome://tracing); the other steps pay
    nothing. The profiled steps run slower and the step after them pays for writing the files:
    their step times and MFU are not the run's."""

    start_step: int = 10
    """The first profiled step, counted as metrics.jsonl counts them (the first step is 1): past
    the start-up steps, whose first allocations and warm-up are not the steady state."""
    steps: int = 2
    """Steps profiled from start_step on (a trace grows with each)."""
    memory: bool = False
    """Also record memory: allocations and frees in the trace, and on CUDA the allocator's history
    over the profiled steps as a snapshot, <run>/profile/rank_NNNNN.memory.pickle (open it in
    https://pytorch.org/memory_viz)."""


@dataclass
class TaskEvalConfig:
    """Downstream tasks scored with lm-evaluation-harness (extra `eval`) during training, as
    `raylm eval --tasks` scores a checkpoint: every rank runs the same requests through its share
    of the model (the forwards are collective) and rank 0 logs each score in metrics.jsonl as
    `<task>/<metric>` (e.g. `hellaswag/acc_norm`). Keep the set small (limit): training waits."""

    tasks: list[str] = field(default_factory=list)
    """lm-eval task, group or tag names, e.g. [hellaswag, arc_easy]."""
    every_steps: int = 1000
    """Steps between evaluations (and at the last step)."""
    limit: Optional[float] = None
    """Documents per task, or below 1 a fraction of each task's (lm-eval's --limit); None: all."""
    num_fewshot: Optional[int] = None
    """Few-shot examples; None: each task's default."""
    include_path: Optional[str] = None
    """Directory of extra task YAMLs (lm-eval's --include_path), readable from every worker."""
    batch_size: int = 8
    """Sequences per forward pass."""


@dataclass
class TrainConfig:
    steps: int = 1000
    global_batch_size: Optional[int] = 32
    """Sequences per optimizer step, across all data-parallel ranks."""
    global_batch_tokens: Optional[int] = None
    """Alternative to global_batch_size: tokens per optimizer step (a multiple of seq_len)."""
    batch_rampup: Optional[BatchRampup] = None
    """Grow the global batch at the start, e.g. {start: 8, increment: 8, samples: 4096}; every size
    must split over the data-parallel ranks in whole micro-batches."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; accumulation fills the global batch."""
    seq_len: Optional[int] = None
    """Tokens per training sequence; None takes the dataset's seq_len."""
    stop_at_step: Optional[int] = None
    """End this invocation after this step, with a checkpoint, leaving the schedule to
    train.steps (time-boxed or preemptible jobs; the next invocation resumes)."""
    precision: Literal["fp32", "bf16", "fp16", "float8"] = "fp32"
    """bf16/fp16 run the forward under autocast; weights and optimizer stay fp32. fp16 (and
    parallel.param_dtype=fp16) adds dynamic loss scaling. float8: the blocks' linear layers
    compute in float8 through torchao (extra `float8`; an NVIDIA GPU of compute capability 8.9 or
    newer: Ada, Hopper), everything else in bf16 (FSDP2's parameter casts under a
    parallel.param_dtype=bf16 wrapper, bf16 autocast otherwise); the output head and the
    embedding stay in bf16, as torchtitan does."""
    float8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """train.precision=float8: torchao's scaling recipe (Float8LinearConfig.from_recipe_name).
    tensorwise: one scale per tensor; under FSDP2 the weights are all-gathered in float8.
    rowwise: a scale per row, more accurate, all-gathers in the parameter dtype."""
    loss_scale_initial: float = 65536.0
    """fp16: the first loss scale (torch.amp.GradScaler's default)."""
    loss_scale_growth_interval: int = 2000
    """fp16: clean steps before the scale doubles; an overflow halves it and skips the step."""
    loss_scale_min: float = 1.0
    """fp16: a scale below this is a divergence, not an overflow (metaseq's alarm): the guard rolls
    back (or, with the guard off, the run stops)."""
    seed: int = 1337
    eval_every: int = 100
    """Validation loss on the held-out split every N steps (and at the last step); 0: never."""
    eval_batches: int = 8
    """Global batches of the validation set: chunks of data.chunk_rows rows drawn across the val
    split by a fixed seed (the same for every data.seed and world size)."""
    eval_tasks: Optional[TaskEvalConfig] = None
    """lm-eval tasks every N steps, e.g. {tasks: [hellaswag], every_steps: 500, limit: 200} (see
    TaskEvalConfig); None: never."""
    log_every: int = 10
    """Steps between progress lines; metrics.jsonl gets every step."""
    read_every: Optional[int] = None
    """Steps between the loop's reads of each step's verdict, loss and gradient norm from the
    device. The steps in between queue their work without waiting for the device (no host sync:
    the update a suspect step must not take is withheld on the device), and their metrics.jsonl
    rows are written at the read. Guard checks, evaluations, checkpoints, timers and the last
    step are read at their own step too, and a suspect step's later batches, computed in vain
    behind it, are queued again. None: log_every on GPUs (the progress line reads anyway), every
    step on a CPU, which runs each operation as it is queued: nothing to overlap there."""
    report_every_s: float = 30.0
    """Seconds between metrics-only reports to Ray Train (Tune sees these); 0: only with
    checkpoints. Each report holds every rank about a second (Ray's cross-rank barrier and its
    one-slot result queue, drained once per controller poll), so reports go by time, not steps."""
    z_loss: float = 0.0
    """PaLM's z-loss weight (1e-4 in PaLM): adds z_loss * log(Z)^2 to the training loss (the
    reported `loss` includes it; `val_loss` is plain cross entropy). 0: off."""
    compile: Optional[bool] = None
    """torch.compile the loss and the model: per block between FSDP2's or TP's hooks, as one graph
    on one device with no wrapper. The first steps pay for compiling (seconds to minutes). None:
    on with GPUs (parallel.use_gpu), off on CPU, where compiling costs 20-25 s and gains nothing."""
    peak_tflops: Optional[float] = None
    """Per-device peak for MFU; None: table for known GPUs, a measured matmul rate on CPU."""
    tensorboard: bool = True
    trackers: list[Literal["mlflow", "wandb"]] = field(default_factory=list)
    """Experiment trackers besides metrics.jsonl and TensorBoard (extra `tracking`); their
    credentials and endpoints come from the environment only (see raylm/train/observe/trackers.py)."""
    audit_samples: bool = False
    """Add to each step's metrics.jsonl row the sorted global indices of the samples it trained
    on, gathered from every data-parallel rank: the record that proves no sample was lost or
    repeated across restarts and resizes. Costs a gather per step; for tests and audits."""
    inject_nonfinite: list[int] = field(default_factory=list)
    """Fault drills: steps (as metrics.jsonl numbers them) whose first forward pass in each
    process gives a non-finite loss, once: what the guard's rerun is for (benchmarks/drill.py)."""
    profile: Optional[ProfileConfig] = None
    """Profile steps start_step .. start_step + steps - 1, e.g. {start_step: 10, steps: 2}: a trace
    per rank in <run>/profile/, linked from `raylm report` (see ProfileConfig). None: never."""


@dataclass
class CheckpointConfig:
    every_steps: int = 500
    """Save every N steps (and at the last step); 0 saves only at the end."""
    every_minutes: Optional[float] = None
    """Also save when this many minutes have passed since the last save (rank 0's clock)."""
    on_unusable: Literal["fail", "start_over"] = "fail"
    """When the run directory holds finished checkpoints and none is usable (corrupt, unparseable,
    a checksum mismatch): `fail` stops, naming each; `start_over` trains from step 0 beside them."""
    resume: Literal["auto", "never", "required"] = "auto"
    """`auto` resumes from the run's latest complete checkpoint when there is one; `required`
    fails without one; `never` fails if the run directory already holds one (a fresh run).
    Restarts after a failure or resize always resume from the latest complete checkpoint."""
    keep_last: Optional[int] = None
    """Keep only this many most recent checkpoints (None keeps all) ..."""
    keep_every: Optional[int] = None
    """... plus every checkpoint whose step is a multiple of this."""
    async_save: bool = False
    """Stage the state in memory and write it in the background (DCP async_save on a process
    group of its own); training continues while the checkpoint is written and published."""
    write_attempts: int = 3
    """Attempts to write a checkpoint (with backoff) before the failure counts."""
    allow_failures: bool = False
    """Keep training when a checkpoint cannot be written, warning on every step until one
    succeeds; a run whose final checkpoint cannot be written still fails at its end, naming the
    steps no checkpoint holds. Off (the default): training stops with the error; it never goes
    on silently."""


@dataclass
class ParallelConfig:
    num_workers: int = 2
    """Ray Train workers (processes); one per GPU with use_gpu. The most workers when elastic."""
    min_workers: Optional[int] = None
    """Elastic: run on as few as this many workers when nodes drop, growing back to num_workers
    when capacity returns (each resize restarts from the latest checkpoint)."""
    resize_check_s: float = 10.0
    """Elastic: how often Ray Train looks for capacity to grow into."""
    use_gpu: bool = False
    """GPUs and NCCL; otherwise CPU and gloo."""
    cpus_per_worker: Union[float, Literal["auto"]] = "auto"
    """CPUs each worker reserves, and its torch threads. auto: a local Ray started by raylm gives
    the workers all the machine's cores (cores ÷ num_workers, at least 1); on a joined cluster,
    1 (GPU workers need few, and a CPU cluster's node size is not known before placement)."""
    dp_replicate: int = 1
    """Data-parallel replicas; with dp_shard > 1 and sharding != none this is HSDP: shard within
    a group of dp_shard ranks (a node), replicate across groups."""
    dp_shard: int = -1
    """Data-parallel ranks that shard parameters/gradients/optimizer state (per `sharding`);
    -1 infers it: world size / (dp_replicate * tp * pp)."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row splits); divides n_heads, n_kv_heads,
    the MLP width and the vocabulary."""
    pp: int = 1
    """Pipeline-parallel degree: ranks that each hold a contiguous group of layers."""
    sharding: Sharding = "none"
    """none: DDP (replicate over every data-parallel rank); optimizer: ZeRO-1, gradients:
    ZeRO-2, full: ZeRO-3, all three on FSDP2 over dp_shard (see raylm/parallel/fsdp.py). A run of
    one rank has no wrapper whatever this says, unless one_rank_fsdp or cpu_offload asks."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """Recompute blocks' activations in backward: none, every block (full), or every
    ac_every-th block (every_k); selective checkpoints every block but keeps its matmul and
    attention outputs, recomputing only the cheap ops between them (norms, RoPE, activations):
    about 2/3 of none's activation memory, and no matmul runs twice."""
    ac_every: int = 2
    """every_k: checkpoint blocks whose index is a multiple of this."""
    param_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Dtype the model computes in: FSDP2/replicate cast the parameters for forward/backward (the
    sharded master copy and the optimizer stay fp32); a run of one rank without FSDP2 (see
    one_rank_fsdp) runs the forward under autocast in this dtype over fp32 weights instead, as
    torchtitan does. fp16 adds dynamic loss scaling (train.loss_scale_*)."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of gradient reductions across data-parallel ranks."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 sharding only;
    on one rank it implies one_rank_fsdp)."""
    one_rank_fsdp: bool = False
    """Wrap the model in FSDP2 even when the run has one rank (needs sharding != none and a
    torch.distributed process group, which `raylm train` always has): the multi-GPU layout,
    measured on one GPU. Off, a one-rank run has no wrapper: FSDP2's hooks cost more host time per
    block than a small model's block takes on a GPU (GPT-2 124M on one H200: 0.40x nanoGPT's
    tokens/s with it, 0.89x without; benchmarks/RESULTS.md), and one rank has nothing to shard."""
    sequence_parallel: bool = False
    """With tp > 1: shard norms and the residual stream along the sequence (needs seq_len % tp == 0)."""
    loss_parallel: bool = False
    """With tp > 1: cross entropy on vocabulary-sharded logits, never gathering them."""
    pp_schedule: PipelineScheduleName = "1f1b"
    """torch.distributed.pipelining schedule. gpipe, 1f1b: one stage per rank; interleaved_1f1b,
    looped_bfs, interleaved_zero_bubble: pp_virtual_stages >= 2 per rank (looped);
    zbv_zero_bubble, dualpipev: exactly 2 per rank in a V."""
    pp_microbatches: Optional[int] = None
    """Micro-batches per pipeline step; None: local batch / train.micro_batch_size."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank (model chunks); total stages = pp * pp_virtual_stages."""
    pp_layer_split: list[int] = field(default_factory=list)
    """Layers per stage in order, e.g. [3, 5] (sums to model.n_layers); empty: by pp_balance."""
    pp_balance: Literal["params", "layers"] = "params"
    """Without pp_layer_split: contiguous stages with balanced parameter counts (the embedding
    counts on the first stage, norm and head on the last) or balanced layer counts."""
    fault_tolerance: Literal["checkpoint", "replica"] = "checkpoint"
    """What a lost worker costs. checkpoint: Ray Train restarts every worker from the latest
    checkpoint. replica: each of the dp_replicate data-parallel replicas is a torchft replica
    group (extra `ft`; Ray Train 2.60 makes each worker one, so dp_replicate = num_workers): the
    groups left finish the step without a lost one, Ray starts it again alone, and it heals from a
    live peer, no checkpoint read; a step that did not commit is trained again on the same samples.
    Whole-job failures still restart from the latest checkpoint."""
    replica_timeout_s: float = 30.0
    """replica: how long a group waits for a collective or a heal before it gives the step up
    (torchft's timeouts; at a new quorum's rendezvous, 10 s at most), and how long the others wait
    at the quorum for a live group that is late (the quorum's first group saving a checkpoint: a
    save longer than this leaves it out, and it heals); a group's own wait for the quorum is twice
    this. A lost group (its heartbeats stop) is left out after 2 s."""


@dataclass
class StorageConfig:
    endpoint_url: Optional[str] = None
    """S3-compatible endpoint (e.g. http://127.0.0.1:8333); None uses AWS's."""
    region: Optional[str] = None
    """Region; None takes AWS_REGION / AWS_DEFAULT_REGION / the profile, else us-east-1."""


@dataclass
class RunConfig:
    name: str = "raylm"
    """The run's directory under storage_path, e.g. demo or sweep/trials/a; never one that is or lies
    inside a checkpoint, a prepared dataset or another run's directory."""
    storage_path: str = "runs"
    """Where run directories live: a local directory or s3:// URI."""
    ray_address: Optional[str] = None
    """"local" starts a local Ray; "auto" or host:port (the GCS's) joins a running cluster; None
    joins the one RAY_ADDRESS names, else starts a local Ray."""
    ray_num_cpus: Optional[int] = None
    """Logical CPUs of a local Ray started by raylm (None: enough for the workers and data)."""
    dashboard: bool = False
    """Start Ray's dashboard (its address printed at start) and State API with a local Ray. Off,
    a local run starts about 2.5 s sooner and steps faster: the dashboard's processes take CPU
    from the training on a small machine. A joined cluster's dashboard is the cluster's."""
    max_failures: int = 3
    """Worker-group restarts from the latest checkpoint before the run fails (-1: unlimited). Only
    failures a restart can cure count (a dead worker or node, a network or storage hiccup): a
    deterministic error (config, data, guard stop, full disk) ends the run at once."""
    max_preemptions: int = -1
    """Restarts after a node reclaim (a spot instance taken back, announced by a drain with a
    deadline: the run saves at the next step boundary and restarts from there) before the run
    fails; -1 (Ray Train's default): unlimited. They do not count against max_failures."""
    lease_timeout_s: float = 120.0
    """A run holds a lease on its directory (run.lease) while it trains, so that a second run of
    the same name and storage is refused; a lease whose heartbeat is older than this is taken
    over (at once when its holder was a process on this machine that no longer runs)."""
    health_check: bool = True
    """Self-test each worker at start (allocation, matmul, all-reduce against known values)."""
    watchdog_startup_s: float = 600.0
    """Seconds a (re)started worker may take to its first step; also what the first checkpoint or
    evaluation may add."""
    watchdog_factor: float = 20.0
    """Fail a worker that makes no step within this × the median step time (at least
    watchdog_min_s), naming what is pending; 0 disables the watchdog."""
    watchdog_min_s: float = 120.0
    """The shortest limit between steps."""
    verbose: bool = False
    """Show Ray Train's and Ray Data's own progress logs (each report, dataset executions);
    off, the console holds raylm's progress lines, events and warnings."""
    straggler_factor: float = 3.0
    """Report ranks whose rank-local step time exceeds this × the median rank's; 0 disables."""


@dataclass
class GuardConfig:
    """The stability guard: what OPT's and PaLM's teams did by hand when the loss spiked, deciding
    by the model (the loss of a fixed canary batch) whether a strange step was hard data, a
    transient fault, an update too large for the LR, or data that damages the model."""

    enabled: bool = True
    window: int = 128
    """Recent healthy steps whose loss and grad norm give the rolling mean and deviation."""
    sigmas: float = 6.0
    """A step whose loss or grad norm exceeds the rolling mean by this many deviations is suspect:
    the canary judges it."""
    min_history: int = 20
    """Healthy steps seen before any step is judged suspect (the start of a run moves fast)."""
    canary_rows: int = 32
    """Sequences of the validation split (its first, in file order) whose loss judges the model."""
    damage: float = 0.02
    """A canary loss this fraction above its reference is damage: above the best snapshot's, or
    (after a suspect update) above the loss before the update."""
    snapshot_every: int = 0
    """Steps between canary checks; a check that finds the best model so far keeps an in-memory
    snapshot of it (model, optimizer, RNG) to roll back to. The start of each invocation is the
    first. 0: spaced by their cost, every 25 steps or further apart where the batch is small
    against the canary, so that the canary's passes cost at most 1% of the training compute
    (nanoGPT's 12-row batches: every 100 steps)."""
    quarantine: bool = True
    """The rows of a skipped batch are left out of the epochs after, not judged again each time they
    come round (their positions join the skip ranges as the run passes them; `samples_quarantined`
    events)."""
    lr_factor: float = 0.5
    """The LR's cut when an update at the current LR damaged the model, or a damaged model is rolled
    back (OPT lowered its LR mid-flight): the LR is capped at this fraction of the rate that did the
    damage; the schedule runs on beneath the cap. A run stalled at the unigram level (its training
    loss near that of token frequencies alone, no longer falling, past the warmup) is rolled back
    with its whole schedule scaled by this factor."""
    lr_recovery_steps: int = 0
    """Healthy steps over which the cap climbs back part of the way (to the geometric mean of the
    rates before and after the cut: never to one that damaged the model); 0 keeps it."""
    max_rollbacks: int = 5
    """This many rollbacks in a row to the same snapshot (the run never passed its next check), or
    this many stalls at the unigram level, stop the run with an error naming them."""
    norms_every: int = 100
    """Every N steps, per-layer activation and parameter norms as metrics (act_norm/*,
    param_norm/*); 0: never. Works with the guard on or off."""
    data_deviations: float = 8.0
    """The data check, before any model can judge: a row whose tokens' cross-entropy under the
    dataset's unigram lies this many median absolute deviations above its rows' median (and whose
    own token counts spread wide, as noise's do) is noise; a batch a third noise has them left out
    of the loss, and those of the rest of its chunk, from step 0, without the canary (a batch of
    noise alone is skipped; raylm.train.resilience.datacheck; the statistics are recorded by
    `raylm prepare`). 0: off; off, said once, on a dataset prepared before them, or a mixture."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    run: RunConfig = field(default_factory=RunConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
