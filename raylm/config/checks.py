"""Cross-field checks of a config: what the config alone can tell (ranges, fields that contradict
each other). The model's shape rules and the parallel layout's are checked against it when a run
is resolved (`raylm.train.spec`), which knows the model, the layout and the data."""

from __future__ import annotations

import os

from raylm.config.schema import Config
from raylm.errors import ConfigError


def validate(cfg: Config) -> None:
    """Cross-field checks that a single field's type cannot express (the config alone)."""
    m, t = cfg.model, cfg.train
    positive = {"train.steps": t.steps, "train.micro_batch_size": t.micro_batch_size,
                "parallel.num_workers": cfg.parallel.num_workers, "data.chunk_rows": cfg.data.chunk_rows}
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    ramp = t.batch_rampup
    if ramp is not None and min(ramp.start, ramp.increment, ramp.samples) <= 0:
        raise ConfigError(f"train.batch_rampup: start, increment and samples must be positive, got {ramp}")
    if t.profile is not None and not (1 <= t.profile.start_step <= t.steps and t.profile.steps >= 1):
        raise ConfigError(f"train.profile: start_step must be in [1, train.steps={t.steps}] and steps >= 1, "
                          f"got start_step={t.profile.start_step}, steps={t.profile.steps}")
    _check_eval_tasks(cfg)
    if (t.global_batch_size is None) == (t.global_batch_tokens is None):
        raise ConfigError("set exactly one of train.global_batch_size and train.global_batch_tokens "
                          "(set the other to null)")
    for key, value in (("train.global_batch_size", t.global_batch_size), ("train.global_batch_tokens",
                                                                          t.global_batch_tokens)):
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    check_run_name(cfg.run.name)
    if (cfg.run.ray_address or "").startswith(("http://", "https://")):
        raise ConfigError(f"run.ray_address={cfg.run.ray_address} is a job server's address (the dashboard's, for "
                          "`raylm submit --address` and `ray job submit`): give the cluster's GCS address, "
                          "HOST:6379 unless `ray start --port` chose another, or auto")
    if cfg.run.lease_timeout_s < 10:
        raise ConfigError(f"run.lease_timeout_s must be at least 10 (seconds), got {cfg.run.lease_timeout_s:g}")
    if t.seq_len is not None and t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    if cfg.data.path and cfg.data.mixture:
        raise ConfigError("set data.path or data.mixture, not both")
    if t.z_loss < 0 or (t.z_loss and cfg.parallel.loss_parallel):
        raise ConfigError(f"train.z_loss must be >= 0 and cannot be combined with parallel.loss_parallel "
                          f"(the logits stay sharded by vocabulary there), got {t.z_loss}")
    _check_guard(cfg)
    if cfg.data.shard_cache_mb < 0:
        raise ConfigError(f"data.shard_cache_mb must be >= 0, got {cfg.data.shard_cache_mb}")
    r = cfg.run
    if min(r.watchdog_startup_s, r.watchdog_factor, r.watchdog_min_s) < 0:
        raise ConfigError("run.watchdog_startup_s, run.watchdog_factor and run.watchdog_min_s must be >= 0")
    cpus = cfg.parallel.cpus_per_worker
    if cpus != "auto" and cpus <= 0:
        raise ConfigError(f"parallel.cpus_per_worker must be positive or auto, got {cpus}")
    for i, pair in enumerate(cfg.data.skip):
        if len(pair) != 2 or not 0 <= pair[0] < pair[1]:
            raise ConfigError(f"data.skip[{i}] must be [start, end) with 0 <= start < end")
    _check_schedule(cfg)
    _check_ranges(cfg)
    _check_float8(cfg)
    if t.eval_every < 0 or t.eval_batches <= 0 and t.eval_every > 0:
        raise ConfigError(f"train.eval_every must be >= 0 and train.eval_batches positive when evaluating, "
                          f"got {t.eval_every} and {t.eval_batches}")


def _check_eval_tasks(cfg: Config) -> None:
    tasks = cfg.train.eval_tasks
    if tasks is None:
        return
    if not tasks.tasks or tasks.every_steps < 1 or tasks.batch_size < 1:
        raise ConfigError(f"train.eval_tasks: tasks must name at least one task, every_steps and batch_size "
                          f"must be >= 1, got tasks={tasks.tasks}, every_steps={tasks.every_steps}, "
                          f"batch_size={tasks.batch_size}")
    if (tasks.limit is not None and not (tasks.limit > 0 and (tasks.limit < 1 or tasks.limit.is_integer()))) \
            or (tasks.num_fewshot is not None and tasks.num_fewshot < 0):
        raise ConfigError(f"train.eval_tasks: limit must be a whole number of documents or a fraction in (0, 1) "
                          f"and num_fewshot >= 0, got limit={tasks.limit}, num_fewshot={tasks.num_fewshot}")
    if cfg.parallel.pp > 1:
        # Its forwards run outside the pipeline schedule, on a whole model per rank.
        raise ConfigError("train.eval_tasks needs a layout without pipeline stages (parallel.pp=1); "
                          "score the run's checkpoints with `raylm eval CHECKPOINT --tasks ...` instead")


def _check_guard(cfg: Config) -> None:
    g = cfg.guard
    guard_positive = {"guard.window": g.window, "guard.sigmas": g.sigmas, "guard.canary_rows": g.canary_rows,
                      "guard.damage": g.damage, "guard.max_rollbacks": g.max_rollbacks}
    for key, value in guard_positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if not 0.0 < g.lr_factor <= 1.0:
        raise ConfigError(f"guard.lr_factor must be in (0, 1], got {g.lr_factor}")
    if g.norms_every < 0 or g.lr_recovery_steps < 0:
        raise ConfigError(f"guard.norms_every and guard.lr_recovery_steps must be >= 0, got {g.norms_every} and "
                          f"{g.lr_recovery_steps}")
    if g.data_deviations < 0:
        raise ConfigError(f"guard.data_deviations must be >= 0 (0: the data check off), got {g.data_deviations}")
    if g.min_history < 2 or g.snapshot_every < 0:
        raise ConfigError(f"guard.min_history must be >= 2 and guard.snapshot_every >= 0 (0: by cost), got "
                          f"{g.min_history} and {g.snapshot_every}")


def _check_schedule(cfg: Config) -> None:
    s, steps = cfg.schedule, cfg.train.steps
    if s.warmup_steps < 0 or s.warmup_steps > steps:
        raise ConfigError(f"schedule.warmup_steps ({s.warmup_steps}) must be in [0, train.steps={steps}]")
    if not 0.0 < s.decay_fraction <= 1.0:
        raise ConfigError(f"schedule.decay_fraction must be in (0, 1], got {s.decay_fraction}")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr must be positive, got {cfg.optim.lr}")
    if s.name in ("cosine", "wsd") and s.min_lr > cfg.optim.lr:
        raise ConfigError(f"schedule.min_lr ({s.min_lr}) is above optim.lr ({cfg.optim.lr}): the {s.name} "
                          "schedule would rise while it decays; lower schedule.min_lr or raise optim.lr")


def _check_ranges(cfg: Config) -> None:
    """Single fields whose type admits values no run can use: refused here, before Ray starts,
    rather than met by every rank (and each of Ray's restarts) or only at the first save."""
    t, o, c, p, r = cfg.train, cfg.optim, cfg.checkpoint, cfg.parallel, cfg.run
    at_least = {"train.log_every": (t.log_every, 1), "train.read_every": (t.read_every, 1),
                "data.prefetch_chunks": (cfg.data.prefetch_chunks, 1),
                "checkpoint.write_attempts": (c.write_attempts, 1), "checkpoint.every_steps": (c.every_steps, 0),
                "checkpoint.keep_last": (c.keep_last, 1), "checkpoint.keep_every": (c.keep_every, 1),
                "optim.weight_decay": (o.weight_decay, 0), "optim.grad_clip": (o.grad_clip, 0),
                "train.report_every_s": (t.report_every_s, 0), "schedule.min_lr": (cfg.schedule.min_lr, 0),
                "train.stop_at_step": (t.stop_at_step, 1),
                "train.loss_scale_growth_interval": (t.loss_scale_growth_interval, 1),
                "parallel.min_workers": (p.min_workers, 1), "run.ray_num_cpus": (r.ray_num_cpus, 1),
                "run.max_failures": (r.max_failures, -1), "run.max_preemptions": (r.max_preemptions, -1)}
    for key, (value, least) in at_least.items():
        if value is not None and not value >= least:
            raise ConfigError(f"{key} must be at least {least}, got {value}")
    # A drill step the run never reaches would never fire, and the drill would pass unexercised.
    if outside := [s for s in t.inject_nonfinite if not 1 <= s <= t.steps]:
        raise ConfigError(f"train.inject_nonfinite steps must be in [1, train.steps={t.steps}], got {outside}")
    above_zero = {"checkpoint.every_minutes": c.every_minutes, "optim.eps": o.eps,
                  "train.loss_scale_initial": t.loss_scale_initial, "train.loss_scale_min": t.loss_scale_min,
                  "train.peak_tflops": t.peak_tflops, "parallel.resize_check_s": p.resize_check_s}
    for key, value in above_zero.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    for key, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {value}")
    if not 0.0 <= cfg.schedule.final_lr_fraction <= 1.0:
        raise ConfigError(f"schedule.final_lr_fraction must be in [0, 1], got {cfg.schedule.final_lr_fraction}")
    if p.fault_tolerance == "replica":
        _check_replicas(cfg)
    if p.min_workers is not None and p.min_workers > p.num_workers:
        # Ray Train's ScalingConfig refused it with a traceback once Ray had started.
        raise ConfigError(f"parallel.min_workers ({p.min_workers}) must be at most parallel.num_workers "
                          f"({p.num_workers})")
    first_index: dict[str, int] = {}
    for i, component in enumerate(cfg.data.mixture):
        if not 0.0 < component.weight < float("inf"):
            raise ConfigError(f"data.mixture[{i}].weight must be positive, got {component.weight}")
        # Two components over one dataset each walk its samples in their own order, so an epoch
        # of the mixture would train some samples twice before others once.
        same = first_index.setdefault(_dataset_key(component.path), i)
        if same != i:
            raise ConfigError(f"data.mixture[{i}].path {component.path!r} is the dataset of data.mixture[{same}]: "
                              f"give it one component, with the sum of the weights")


def _check_replicas(cfg: Config) -> None:
    """parallel.fault_tolerance=replica on what Ray Train 2.60's replica groups can run: one worker
    per group (its TorchftConfig sizes every group so), so the layout inside a group is one rank."""
    p = cfg.parallel
    if p.dp_replicate != p.num_workers or p.dp_replicate < 2:
        raise ConfigError(f"parallel.fault_tolerance=replica needs parallel.dp_replicate = parallel.num_workers >= 2 "
                          f"(Ray Train makes each worker one replica group), got dp_replicate={p.dp_replicate}, "
                          f"num_workers={p.num_workers}")
    inside = {"parallel.dp_shard": (p.dp_shard, (-1, 1)), "parallel.tp": (p.tp, (1,)), "parallel.pp": (p.pp, (1,))}
    for key, (value, allowed) in inside.items():
        if value not in allowed:
            raise ConfigError(f"parallel.fault_tolerance=replica runs one worker per replica group: {key} must be 1, "
                              f"got {value}")
    refused = {"parallel.min_workers": p.min_workers is not None,  # Ray replaces groups only at a fixed size
               "checkpoint.async_save": cfg.checkpoint.async_save,  # one group saves, alone
               "train.trackers": bool(cfg.train.trackers),  # one tracker run per group
               "train.batch_rampup": cfg.train.batch_rampup is not None}
    if on := [key for key, set_ in refused.items() if set_]:
        raise ConfigError(f"parallel.fault_tolerance=replica does not support {', '.join(on)} yet; unset it")
    if not p.replica_timeout_s > 0:
        raise ConfigError(f"parallel.replica_timeout_s must be positive, got {p.replica_timeout_s}")


def _check_float8(cfg: Config) -> None:
    """What no worker could run with train.precision=float8 (the GPU's own compute capability and
    torchao are checked where the model is built: raylm.parallel.float8)."""
    if cfg.train.precision != "float8":
        return
    p = cfg.parallel
    if not p.use_gpu:
        raise ConfigError("train.precision=float8: float8 matmuls need an NVIDIA GPU of compute capability 8.9 or "
                          "newer (Ada, Hopper); this run is on CPU (parallel.use_gpu=false)")
    if p.tp > 1:
        raise ConfigError(f"train.precision=float8 with parallel.tp={p.tp}: float8 under tensor parallelism is not "
                          "wired in raylm (torchao's float8 TP styles): use parallel.tp=1, or train.precision=bf16")
    if p.param_dtype == "fp16":
        raise ConfigError("train.precision=float8 computes what its float8 linears leave in bf16, and "
                          "parallel.param_dtype=fp16 would cast it to fp16: use parallel.param_dtype=bf16 or fp32")


def _dataset_key(path: str) -> str:
    if path.startswith("s3://"):
        return path.rstrip("/")
    return os.path.normpath(os.path.abspath(path))


def global_batch_sequences(cfg: Config, seq_len: int) -> int:
    """The global batch in sequences, from whichever of the two settings is given."""
    t = cfg.train
    if t.global_batch_size is not None:
        return t.global_batch_size
    if t.global_batch_tokens % seq_len:
        raise ConfigError(f"train.global_batch_tokens ({t.global_batch_tokens}) is not a multiple "
                          f"of seq_len ({seq_len})")
    return t.global_batch_tokens // seq_len


def check_run_name(name: str) -> None:
    """run.name names a directory inside run.storage_path: `a` or `sweep/trials/a`, never empty,
    absolute or climbing out of it (`../x`), where it would mix with another run's files."""
    parts = name.replace("\\", "/").split("/")
    if not name.strip() or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"run.name={name!r} must name a directory inside run.storage_path: one or more "
                          "non-empty parts joined by '/', none of them '.' or '..' (e.g. 'demo', 'sweep/trials/a')")
