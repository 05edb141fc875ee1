"""Worker health: a self-test at start that fails fast naming the node, and straggler reports.

    self_test(device, node_id)                    # every rank, before building the model
    hooks = (StragglerMonitor(node_id, k=3.0), ...)  # train(spec, env, hooks)

The node id comes from outside (the Ray glue knows `ray.get_runtime_context().get_node_id()`);
nothing here imports Ray, so the loop and the tests run without it. The checks call torch.sum,
torch.matmul and the torch.distributed collectives through their modules, so a test can fault
one rank by replacing those calls there.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from raylm.train.hooks import Hook, Run

log = logging.getLogger(__name__)

class WorkerHealthError(RuntimeError):
    """A worker failed its self-test; `node_id` and `rank` name the failing worker (the first,
    if several failed), `check` what failed. Every rank raises it, not only the sick one."""

    def __init__(self, node_id: str, rank: int, check: str, detail: str):
        self.node_id, self.rank, self.check = node_id, rank, check
        super().__init__(f"worker health check '{check}' failed on node {node_id} (rank {rank}): {detail}")


def _mismatch(got: torch.Tensor, expected: torch.Tensor) -> Optional[str]:
    """None if equal, else how they differ (exact comparison: every value here is an integer
    small enough to be exact in fp32, so any difference is a fault, not rounding)."""
    got, expected = got.detach().cpu(), expected.detach().cpu().to(got.dtype)
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    wrong = (got != expected).nonzero()
    if len(wrong) == 0:
        return None
    at = tuple(wrong[0].tolist())
    return (f"{len(wrong)} of {got.numel()} values differ; first at {list(at)}: "
            f"expected {expected[at].item():g}, got {got[at].item():g}")


def _local_checks(device: torch.device, alloc_mb: int, n: int) -> Optional[tuple[str, str]]:
    """(check, detail) of the first failing on-device check, or None."""
    count = alloc_mb * 2 ** 20 // 8
    # Distinct values (a stuck address line shows) whose int64 sum is exact and known.
    values = torch.arange(count, dtype=torch.int64, device=device)
    if (total := int(torch.sum(values))) != count * (count - 1) // 2:
        return "alloc", f"{alloc_mb} MiB of 0..{count - 1} summed to {total}, expected {count * (count - 1) // 2}"
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    a, b = (i * 3 + j * 5) % 7 - 3, (i * 2 + j * 7) % 5 - 2  # |entries| ≤ 3, |sums| ≤ 6n < 2^24
    product = torch.matmul(a.to(device, torch.float32), b.to(device, torch.float32))
    detail = _mismatch(product, a @ b)  # int64 on the CPU: the known result, whatever the device
    return ("matmul", f"{n}×{n} fp32 product: {detail}") if detail else None


def _exchange(failure: Optional[tuple[str, str]], node_id: str) -> list[tuple[str, Optional[tuple[str, str]]]]:
    """Every rank's (node id, failure): all ranks then agree on whether to go on."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (node_id, failure))
    return gathered


def _raise_first(results: list[tuple[str, Optional[tuple[str, str]]]]) -> None:
    failed = [(rank, node, failure) for rank, (node, failure) in enumerate(results) if failure]
    if failed:
        rank, node, (check, detail) = failed[0]
        others = "".join(f"; also rank {r} on node {n}: {c}" for r, n, (c, _) in failed[1:])
        raise WorkerHealthError(node, rank, check, detail + others)


def _collective_checks(device: torch.device, nodes: list[str], m: int = 1024) -> Optional[tuple[str, str]]:
    rank, size = dist.get_rank(), dist.get_world_size()
    # Rank r sends base × (r % 7 + 1) with base in 1..8: every partial sum is an integer below
    # 2^24 for up to ~300k ranks, so exact in fp32 whatever order the reduction takes.
    base = (torch.arange(m, device=device) % 8 + 1).to(torch.float32)
    factor = [r % 7 + 1 for r in range(size)]
    mine = base * factor[rank]
    total = mine.clone()
    dist.all_reduce(total)
    # Everyone's contribution as well, so that a wrong sum names the rank that caused it.
    each = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(each, mine)
    if detail := _mismatch(total, base * sum(factor)):
        culprits = [r for r in range(size) if _mismatch(each[r], base * factor[r])]
        if culprits:
            r = culprits[0]
            raise WorkerHealthError(nodes[r], r, "all_reduce", f"rank {r} contributed wrong values "
                                    f"({_mismatch(each[r], base * factor[r])}), so the sum is wrong: {detail}")
        return "all_reduce", f"sum over {size} ranks (every contribution was right): {detail}"
    sent = base * 7 + size
    received = sent.clone() if rank == 0 else torch.zeros_like(sent)
    dist.broadcast(received, src=0)
    detail = _mismatch(received, sent)
    return ("broadcast", f"from rank 0: {detail}") if detail else None


def self_test(device: torch.device, node_id: str, *, timeout_s: float = 60.0, alloc_mb: int = 64) -> None:
    """Check this worker before it trains; raise WorkerHealthError naming the bad node.

    On the device: allocate `alloc_mb` MiB and read it back; a 256×256 fp32 matmul of integer
    matrices against the exact product. Then, if torch.distributed is initialised, on every
    rank together: an all-reduce of rank-dependent values against the closed-form sum (and an
    all-gather that names the rank whose contribution was wrong) and a broadcast. Ranks share
    their results after each phase, so a failure on one rank stops all of them at once,
    all naming the failing rank's node, instead of leaving the others waiting in a collective.

    Bounded time: the checks run in a daemon thread and the caller gets a WorkerHealthError
    after `timeout_s` whatever happens inside (a peer that never arrives, a hung device, a
    dead network); the process group's own timeout (30 min under Ray Train) is far too long.
    A thread rather than a short-timeout process group: creating a group is itself a
    collective that can hang, and it works the same for gloo and NCCL. After a timeout the
    thread stays blocked: the process is expected to fail, which is the point.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            failure = _local_checks(device, alloc_mb, n=256)
            if not distributed:
                _raise_first([(node_id, failure)])
                return
            results = _exchange(failure, node_id)
            _raise_first(results)
            failure = _collective_checks(device, [node for node, _ in results])
            _raise_first(_exchange(failure, node_id))
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name=f"raylm-self-test-rank{rank}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise WorkerHealthError(node_id, rank, "timeout", f"the self-test did not finish within "
                                f"{timeout_s:g} s: a peer is missing or hung, or the device or network is")
    if "error" in outcome:
        error = outcome["error"]
        if isinstance(error, WorkerHealthError):
            raise error
        raise WorkerHealthError(node_id, rank, "error", f"{type(error).__name__}: {error}") from error


class StragglerMonitor(Hook):
    """Report ranks whose step time exceeds `k` × the median over ranks, with their node.

    Every rank keeps its own times (`metrics[time_key]`); every `window` steps the ranks gather
    them in one tensor, one collective and, on rank 0, one host sync, and rank 0 takes each rank's
    median over those steps (one slow step, e.g. a GC pause, is not a straggler) and compares it
    with the median over ranks: the lower median, so that with two ranks the reference is the
    faster one rather than their mean. A flagged rank goes into `metrics["stragglers"]` on rank 0
    (a list of events: rank, node_id, step, seconds, median, ratio) and a warning; it is not
    reported again for `repeat_after` steps. A rank is reported only when its excess over the
    reference is also at least `min_share` of the run's step time (rank 0's median step_time over
    the window): a 15 ms gap is a large ratio of a small rank-local time, and costs a step of
    seconds nothing.

    What `time_key` should measure: the loop's "step_time" is wall-clock from step to step,
    and in synchronous data parallel training the gradient collectives make every rank wait
    for the slowest, so those times converge. A per-rank time that excludes collective waits
    (data wait, host compute before the first collective, device compute) shows the culprit.
    """

    def __init__(self, node_id: str, k: float, window: int = 5, repeat_after: int = 100,
                 time_key: str = "local_time", min_share: float = 0.1):
        if k <= 1 or window < 1 or repeat_after < 1:
            raise ValueError(f"k={k}, window={window}, repeat_after={repeat_after}: need k > 1, "
                             "window ≥ 1 and repeat_after ≥ 1")
        self.node_id, self.k, self.window = node_id, k, window
        self.repeat_after, self.time_key, self.min_share = repeat_after, time_key, min_share
        self.node_ids: list[str] = [node_id]
        self.mine: list[float] = []  # this rank's times since the last gather
        self.step_times: list[float] = []  # rank 0's step_time over the same steps
        self.reported: dict[int, int] = {}  # rank -> step of its last report
        self.events: list[dict] = []  # everything reported (rank 0), for tests and summaries
        self.active = False

    def on_train_start(self, run: Run) -> None:
        self.active = dist.is_available() and dist.is_initialized() and run.world.world_size > 1
        if self.active:
            self.node_ids = [""] * run.world.world_size
            dist.all_gather_object(self.node_ids, self.node_id)  # once: node ids do not change

    def on_step_end(self, run: Run, step: int, metrics: dict) -> None:
        if not self.active:
            return
        self.mine.append(float(metrics[self.time_key]))
        self.step_times.append(float(metrics.get("step_time", 0.0)))
        if len(self.mine) < self.window:
            return
        mine = torch.tensor(self.mine, device=run.world.device)
        times = [torch.empty_like(mine) for _ in range(run.world.world_size)]
        dist.all_gather(times, mine)
        step_times, self.mine, self.step_times = self.step_times, [], []
        if run.world.rank != 0:
            return
        typical = [statistics.median(rank_times) for rank_times in torch.stack(times).tolist()]
        reference = statistics.median_low(typical)
        if reference <= 0:
            return
        matters = self.min_share * statistics.median(step_times)
        found = []
        for rank, seconds in enumerate(typical):
            if seconds > self.k * reference and seconds - reference >= matters \
                    and step - self.reported.get(rank, -self.repeat_after) >= self.repeat_after:
                self.reported[rank] = step
                found.append({"rank": rank, "node_id": self.node_ids[rank], "step": step, "seconds": seconds,
                              "median_seconds": reference, "ratio": seconds / reference})
                log.warning("straggler: rank %d on node %s takes %.3f s per step (median of its last %d "
                            "steps), %.1f× the median rank's %.3f s", rank, self.node_ids[rank], seconds,
                            self.window, seconds / reference, reference)
        if found:
            self.events.extend(found)
            metrics["stragglers"] = found


class LocalTimeProbe(Hook):
    """Puts `metrics["local_time"]`: what this rank alone spends per step, free of the waits
    that synchronous training imposes on every rank.

    It adds the time the rank waited for its batch (`metrics["data_wait"]`: slow storage or
    network) to the time a fixed amount of matmul work takes on its device (slow or contended
    hardware), timed every `every` steps: on a CPU the probe costs a few ms, a tenth of a small
    model's step. Install it before `StragglerMonitor`, which compares these times across ranks;
    alone (one rank) there is nothing to compare, and it does nothing.
    """

    def __init__(self, size: int = 256, repeats: int = 4, every: int = 10):
        if every < 1:
            raise ValueError(f"every={every}: need every ≥ 1")
        self.size, self.repeats, self.every = size, repeats, every
        self.a: Optional[torch.Tensor] = None
        self.probe_s = 0.0  # the latest probe

    def on_train_start(self, run: Run) -> None:
        if run.world.world_size > 1:
            g = torch.Generator().manual_seed(0)  # not the training RNG
            self.a = torch.randn(self.size, self.size, generator=g).to(run.world.device)

    def _probe_seconds(self, device: torch.device) -> float:
        start = time.perf_counter()
        x = self.a
        for _ in range(self.repeats):
            x = torch.tanh(x @ self.a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def on_step_end(self, run: Run, step: int, metrics: dict) -> None:
        if self.a is None:
            return
        if step % self.every == 0:
            self.probe_s = self._probe_seconds(run.world.device)
        metrics["local_time"] = metrics.get("data_wait", 0.0) + self.probe_s
