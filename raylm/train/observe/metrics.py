"""Step metrics: throughput and MFU, a progress line, metrics.jsonl and TensorBoard (rank 0); the
trackers' names and units: `raylm.train.observe.names`."""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from raylm.config import Config
from raylm.hardware import gpu_peak_flops
from raylm.model.sizes import count_params
from raylm.parallel.world import World
from raylm.progress import format_duration
from raylm.train.hooks import Hook, Run
from raylm.train.observe.records import (EVENTS_FILE, METRICS_FILE, TENSORBOARD_DIR, append_event, append_line,
                                        read_records, rewrite_records, write_unwritten)
from raylm.train.observe.names import tracker_scalars
from raylm.train.observe.trackers import open_trackers


def _measured_cpu_flops(n: int = 512, repeats: int = 20) -> float:
    """What this CPU's fp32 matmul achieves with this process's threads: the honest denominator
    for CPU MFU. The best of many short timings, so a moment of contention does not count."""
    g = torch.Generator().manual_seed(0)  # the global RNG belongs to training (dropout, resume)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def peak_flops(device: torch.device, override_tflops: Optional[float] = None) -> Optional[float]:
    """MFU's denominator: `override_tflops` (train.peak_tflops), the table's peak for this GPU
    model (raylm.hardware), or a CPU's measured matmul rate; None for a GPU not in the table."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return gpu_peak_flops(props.name, props.multi_processor_count)
    return _measured_cpu_flops()


class MetricsLogger(Hook):
    """The always-on hook, run after every hook that adds to the metrics: writes each step's
    metrics out on rank 0."""

    def __init__(self, cfg: Config, run_dir: str, world: World):
        self.cfg, self.world = cfg, world
        # The progress line smooths throughput and MFU alike: a step's own MFU beside the smoothed
        # tokens/s read 33% and 59% at one steady 9.5k tok/s on a busy CPU.
        self.tokens_per_s_ema: Optional[float] = None
        self.mfu_ema: Optional[float] = None
        self.step_time_ema: Optional[float] = None
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.last_step: Optional[int] = None  # the last step written: one again or before it is trained again
        self.writer = None
        self.trackers: list = []
        self.closed = False
        if self.rank0:
            os.makedirs(run_dir, exist_ok=True)
            if cfg.train.tensorboard:
                from tensorboard.compat.proto.event_pb2 import Event, SessionLog
                from tensorboard.compat.proto.summary_pb2 import Summary
                from torch.utils.tensorboard.writer import FileWriter

                self.writer = FileWriter(os.path.join(run_dir, TENSORBOARD_DIR))
                self.summary, self.event, self.session_log = Summary, Event, SessionLog
            self.trackers = open_trackers(cfg, run_dir)

    @property
    def rank0(self) -> bool:
        # Read at each step: under parallel.fault_tolerance=replica the writer is the quorum's first group.
        return self.world.rank == 0

    def on_train_start(self, run: Run) -> None:
        # Earlier rows at step 0 mean a restart before the first checkpoint: they are redone too.
        if self.rank0 and (run.state.step > 0 or os.path.exists(self.path) and os.path.getsize(self.path) > 0):
            self.record_resume(run.state.step, run.restored_world_size, run.restore_read_bytes)
            self._purge_board(run.state.step + 1)
        if self.rank0:
            n = count_params(run.cfg.model)  # the whole model: under pipelining a rank holds a part
            print(f"raylm: {n / 1e6:.2f}M parameters, {self._workers()}, "
                  f"global batch {run.global_batch} × {run.seq_len} tokens, "
                  f"steps {run.state.step}→{self.cfg.train.steps}", flush=True)

    def _workers(self) -> str:
        p = self.cfg.parallel  # under replica groups a rank's world is its group's
        return f"{p.dp_replicate} replica groups of 1 worker" if p.fault_tolerance == "replica" else \
            f"{self.world.world_size} worker(s)"

    def record_resume(self, restored_step: int, restored_world_size: Optional[int], read_bytes: list[int]) -> None:
        """Drop the metrics of steps that will be trained again, and log how many were lost,
        whether the worker group changed size (an elastic shrink or grow-back) and what each rank
        read of the checkpoint."""
        path = self.path
        events = os.path.join(os.path.dirname(path), EVENTS_FILE)
        rows, dropped = read_records(path)
        for line in dropped:  # a line a kill or a full disk cut short: the step is trained again anyway
            append_event(events, {"event": "record_dropped", "time": time.time(), "line": line})
            print(f"raylm: dropped {line}", flush=True)
        kept = [r for r in rows if isinstance(r.get("step"), int) and r["step"] <= restored_step]
        try:
            rewrite_records(path, kept)
        except OSError as e:  # a full disk: the rows of the steps trained again follow them (the last counts)
            print(f"WARNING: {path}: could not drop the rows of the steps trained again ({e})", flush=True)
        lost = len(rows) - len(kept)
        world_size = self.world.world_size
        append_event(events, {"event": "resumed", "time": time.time(), "from_step": restored_step,
                              "steps_lost": lost, "world_size": world_size,
                              "from_world_size": restored_world_size, "read_bytes_per_rank": read_bytes})
        resized = f" (resized from {restored_world_size})" if restored_world_size not in (None, world_size) else ""
        read = f"; read {max(read_bytes) / 2**20:.1f} MiB of the checkpoint per rank at most" if read_bytes else ""
        print(f"raylm: resumed at step {restored_step} on {self._workers()}{resized}; "
              f"{lost} step(s) of work lost{read}", flush=True)

    def _purge_board(self, step: int) -> None:
        """TensorBoard drops what the run wrote at `step` and after, before now: the steps a
        resume or a guard rollback trains again, which it would otherwise draw beside their
        successors (a SessionLog START at the step: what SummaryWriter's purge_step writes)."""
        if self.writer is not None:
            self.writer.add_event(self.event(step=step, session_log=self.session_log(status=self.session_log.START)))

    def on_step_end(self, run: Run, step: int, metrics: dict) -> None:
        if not self.rank0:
            return
        ema = lambda old, new: new if old is None else 0.9 * old + 0.1 * new  # noqa: E731
        self.tokens_per_s_ema = ema(self.tokens_per_s_ema, metrics["tokens_per_s"])
        if "mfu" in metrics:  # absent on a GPU model without a known peak
            self.mfu_ema = ema(self.mfu_ema, metrics["mfu"])
        self.step_time_ema = ema(self.step_time_ema, metrics["step_time"])
        append_line(self.path, metrics)
        if self.last_step is not None and metrics["step"] <= self.last_step:  # a guard rollback
            self._purge_board(metrics["step"])
        self.last_step = metrics["step"]
        scalars = tracker_scalars(metrics)
        if self.writer is not None:
            # One event per step holding every scalar, as TensorFlow's merged summaries do:
            # SummaryWriter.add_scalar makes one event per scalar, each waking the writer's
            # thread, which then takes the GIL from the training thread: 12 a step cost
            # nanoGPT's run 1 ms of its 42 ms step in the caller alone.
            values = [self.summary.Value(tag=name, simple_value=value) for name, value in scalars.items()]
            self.writer.add_summary(self.summary(value=values), metrics["step"], metrics["time"])
        for tracker in self.trackers:
            tracker.log(scalars, metrics["step"])
        steps = self.cfg.train.steps
        if metrics["step"] % self.cfg.train.log_every == 0 or metrics["step"] == steps or "val_loss" in metrics:
            eta = format_duration(self.step_time_ema * (steps - metrics["step"]))
            val = f" | val {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
            mfu = "mfu n/a (train.peak_tflops)" if self.mfu_ema is None else f"mfu {100 * self.mfu_ema:.2f}%"
            print(f"step {metrics['step']:>6}/{steps} | loss {metrics['loss']:.4f}{val} | "
                  f"lr {metrics['lr']:.2e} | gnorm {metrics['grad_norm']:.3f} | "
                  f"{self.tokens_per_s_ema:,.0f} tok/s | {mfu} | eta {eta}",
                  flush=True)

    def on_train_end(self, run: Run, metrics: dict) -> None:
        self.close()

    def close(self) -> None:
        """Also called when training fails, so that no file stays open and no row a full disk
        refused is left unwritten if there is space now."""
        if self.closed:
            return
        self.closed = True
        if self.rank0:
            for path in (self.path, os.path.join(os.path.dirname(self.path), EVENTS_FILE)):
                if not write_unwritten(path):
                    print(f"WARNING: {path}: the disk is still full; rows of this run are lost", flush=True)
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            tracker.close()
