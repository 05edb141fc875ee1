"""Run a function on N local processes joined by gloo: the harness of the multi-process tests.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, initialises
torch.distributed (gloo on 127.0.0.1, a free port) in each, calls `fn(*args)` and returns the
ranks' return values in rank order. A rank that raises fails the call with that rank's
traceback; the other ranks are then stopped rather than left waiting in a collective.

`fn` and its arguments must be picklable (a module-level function). The processes are forked
from a server process that has imported torch and raylm and run nothing else (multiprocessing's
forkserver): a rank starts in a fraction of a second instead of importing them anew, and none is
forked from a process that has run OpenMP or gloo threads, which can hang a forked child. Each
rank takes the caller's environment as it is at the call.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from raylm.ports import free_ports

COLLECTIVE_TIMEOUT_S = 120  # a rank stuck in a collective fails instead of hanging the suite
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "pyarrow.dataset", "raylm.train.loop"]


def _worker(fn: Callable, rank: int, world_size: int, port: int, results: Any, args: tuple,
            env: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        value = fn(*args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600) -> list:
    """`fn(*args)` on `world_size` gloo ranks; returns [rank 0's value, rank 1's, ...]."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: at the first call
    results = ctx.Queue()
    (port,) = free_ports(1)
    # The server reads the environment when it starts, before torch sizes its thread pools.
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        env = dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, port, results, args, env), daemon=True)
                 for rank in range(world_size)]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died without reporting (killed, crashed in C++) fails the run now.
                dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(procs)
                        if r not in values and p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"run_distributed({fn.__name__}, {world_size}): "
                                       f"{', '.join(dead) or f'no result within {timeout_s:.0f}s'}") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{value}")
            values[rank] = value
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return [values[r] for r in range(world_size)]
