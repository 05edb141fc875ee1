"""A progress watchdog: a run that makes no training step for too long fails, loudly, naming
what it waits for, so that the cluster's failure handling can act and the user sees why.

    hooks = (ProgressWatchdog(startup_s=600, factor=20, min_s=120, describe=..., fail=...), ...)

Each step's begin (its batch arrived) and end re-arm a deadline for what comes next:
- the first batch and the first step (start-up, first collectives, compilation): `startup_s`;
- after that, a wait for a batch or a step: max(`min_s`, `factor` × the median step time);
- plus, when a checkpoint or an evaluation falls in that wait: `startup_s` until one has been
  timed, then max(`min_s`, 3 × the longest one timed).

When a deadline passes, a background thread writes the reason to stderr, hands a
`ProgressTimeout` to `fail` (the Ray glue hands it to Ray Train, which fails the worker group
and records the cause), and raises it in the training thread. An exception raised into a thread
takes effect only when the thread runs Python again: one blocked in native code (a read that
never returns, a collective whose peer is gone) may never see it. If the training thread is still
inside the loop `exit_grace_s` later, the process exits with status `EXIT_STATUS`, so that
whatever supervises it (Ray, torchrun, a scheduler) sees a failure rather than a hang.

Nothing here imports Ray: the loop, its tests and local runs use it as it is.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import threading
import time
from collections import deque
from typing import Callable, Optional

from raylm.train.hooks import Hook, Run

EXIT_STATUS = 70  # EX_SOFTWARE: the process gave up on a run that made no progress
OCCASIONAL_FACTOR = 3.0  # a checkpoint or evaluation may take this × the longest one timed
STACK_FRAMES = 3  # innermost frames of the training thread quoted in the reason, then raylm's
DESCRIBE_TIMEOUT_S = 20.0  # for `describe`, which may itself wait on a sick cluster


_reasons: dict[int, str] = {}  # thread id -> why the watchdog raised ProgressTimeout in it


class ProgressTimeout(RuntimeError):
    """No training step within the watchdog's limit; the message says what was pending.

    Raised into the training thread by class (the interpreter instantiates it there, without
    arguments): the message is then the reason the watchdog left for that thread."""

    def __init__(self, *args):
        super().__init__(*(args or (_reasons.get(threading.get_ident(), "no training step in time"),)))


class ProgressWatchdog(Hook):
    """Fails the run when no step completes in time (see the module docstring).

    `describe()` returns what the cluster has pending (actors, resources); `fail(error)` hands
    the error to whatever supervises the workers. Both are optional; the watchdog itself only
    knows the loop. `startup_s`, `factor`, `min_s` come from run.watchdog_startup_s,
    run.watchdog_factor, run.watchdog_min_s."""

    def __init__(self, startup_s: float = 600.0, factor: float = 20.0, min_s: float = 120.0,
                 describe: Optional[Callable[[], str]] = None,
                 fail: Optional[Callable[[ProgressTimeout], None]] = None,
                 exit_grace_s: float = 60.0, window: int = 50):
        if startup_s <= 0 or factor <= 0 or min_s <= 0 or exit_grace_s <= 0 or window < 1:
            raise ValueError(f"startup_s={startup_s}, factor={factor}, min_s={min_s}, "
                             f"exit_grace_s={exit_grace_s}, window={window}: need all > 0 and window ≥ 1")
        self.startup_s, self.factor, self.min_s = startup_s, factor, min_s
        self.describe, self.fail, self.exit_grace_s = describe, fail, exit_grace_s
        self.step_times: deque[float] = deque(maxlen=window)
        self.longest_checkpoint: Optional[float] = None  # seconds, once one has been timed
        self.longest_eval: Optional[float] = None
        self.reason: Optional[str] = None  # set when the watchdog fired
        self._cond = threading.Condition()
        self._deadline = float("inf")
        self._wake_at = float("inf")  # when the watching thread wakes next without a notify
        self._limit, self._basis, self._phase = 0.0, "", ""
        self._phase_start = self._last_step = 0.0
        self._step_begin = 0.0
        self._stopped = False
        self._thread_id = 0
        self._loop_frame: tuple[int, object] = (0, None)  # (id, code) of the loop's outermost frame
        self._rank = 0

    # -- hook -----------------------------------------------------------------------------

    def on_train_start(self, run: Run) -> None:
        self._rank = run.world.rank
        self._last_step = time.monotonic()  # "no step for": since the start, until the first step
        self._thread_id = threading.get_ident()
        self._loop_frame = _outermost_caller_frame()
        self._arm(f"waiting for the first batch (step {run.state.step})", self.startup_s,
                  "start-up allowance, run.watchdog_startup_s")
        threading.Thread(target=self._watch, name=f"raylm-watchdog-rank{self._rank}", daemon=True).start()

    def on_step_begin(self, run: Run, step: int) -> None:
        self._step_begin = time.monotonic()
        if not self.step_times:
            limit, basis = self.startup_s, "start-up allowance for the first step, run.watchdog_startup_s"
        else:
            limit, basis = self._step_limit()
        phase = f"running step {step}"
        if self._evaluates_after(run, step + 1):  # run.state may lag: steps are queued ahead of reads
            limit, basis = self._with_occasional(limit, basis, self.longest_eval, "an evaluation")
            phase += " and the evaluation after it"
        self._arm(phase, limit, basis)

    def on_step_end(self, run: Run, step: int, metrics: dict) -> None:
        now = time.monotonic()
        self.step_times.append(float(metrics.get("step_time", now - self._step_begin)))
        if metrics.get("checkpoint_s"):  # the save that preceded this step (loop.py reports it here)
            self.longest_checkpoint = max(self.longest_checkpoint or 0.0, float(metrics["checkpoint_s"]))
        if "val_loss" in metrics:  # evaluated after the step's compute, outside its step_time
            compute = self.step_times[-1] - float(metrics.get("data_wait", 0.0))
            self.longest_eval = max(self.longest_eval or 0.0, now - self._step_begin - compute, 0.0)
        self._last_step = now
        limit, basis = self._step_limit()
        phase = f"waiting for the batch of step {run.state.step}"
        if self._checkpoints_after(run, run.state.step):
            limit, basis = self._with_occasional(limit, basis, self.longest_checkpoint, "a checkpoint")
            phase = f"saving the checkpoint of step {run.state.step} or {phase}"
        self._arm(phase, limit, basis)

    @property
    def limit(self) -> float:
        """Seconds allowed for what the run does now (the phase armed last)."""
        return self._limit

    def on_train_end(self, run: Run, metrics: dict) -> None:
        self.stop()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # -- limits -----------------------------------------------------------------------------

    def _step_limit(self) -> tuple[float, str]:
        median = statistics.median(self.step_times)
        if self.factor * median >= self.min_s:
            return self.factor * median, f"{self.factor:g} × the median step time {median:.3g} s, run.watchdog_factor"
        return self.min_s, (f"run.watchdog_min_s; {self.factor:g} × the median step time "
                            f"{median:.3g} s is less")

    def _with_occasional(self, limit: float, basis: str, longest: Optional[float], what: str) -> tuple[float, str]:
        if longest is None:
            return limit + self.startup_s, f"{basis}, plus the start-up allowance for the first time {what} may run"
        extra = max(self.min_s, OCCASIONAL_FACTOR * longest)
        return limit + extra, f"{basis}, plus {extra:.0f} s for {what} (the longest took {longest:.1f} s)"

    @staticmethod
    def _last_step_of(run: Run) -> int:
        t = run.cfg.train
        return min(t.steps, t.stop_at_step or t.steps)

    def _checkpoints_after(self, run: Run, completed: int) -> bool:
        """Whether the loop may save a checkpoint after step `completed` (Checkpointer.due)."""
        c = run.cfg.checkpoint
        return (completed == self._last_step_of(run) or (c.every_steps > 0 and completed % c.every_steps == 0)
                or c.every_minutes is not None)

    def _evaluates_after(self, run: Run, completed: int) -> bool:
        """Whether the loop evaluates once step `completed` is done (train.eval_every)."""
        every = run.cfg.train.eval_every
        return every > 0 and (completed == self._last_step_of(run) or completed % every == 0)

    def _arm(self, phase: str, limit: float, basis: str) -> None:
        with self._cond:
            now = time.monotonic()
            self._phase, self._phase_start = phase, now
            self._limit, self._basis, self._deadline = limit, basis, now + limit
            # The loop re-arms twice a step; waking the watcher each time made it take the GIL
            # from the training thread a hundred times a second on a small model. A later
            # deadline is seen when it wakes anyway (within a second); only an earlier one
            # than that needs it now.
            if self._deadline < self._wake_at:
                self._cond.notify_all()

    # -- the watching thread ----------------------------------------------------------------

    def _watch(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                left = self._deadline - now
                if left <= 0:
                    break
                self._wake_at = now + min(left, 1.0)
                self._cond.wait(min(left, 1.0))
                if not self._in_loop():  # the run ended by an exception: on_train_end never comes
                    return
            if self._stopped:
                return
            phase, since, limit, basis = self._phase, self._phase_start, self._limit, self._basis
        self._fire(phase, since, limit, basis)

    def _fire(self, phase: str, since: float, limit: float, basis: str) -> None:
        now = time.monotonic()
        reason = (f"rank {self._rank}: no training step for {now - self._last_step:.0f} s; "
                  f"{phase} for {now - since:.0f} s, past the limit of {limit:.0f} s ({basis})")
        pending = self._pending()
        if pending:
            reason += f". Pending: {pending}"
        reason += f". Training thread at: {self._training_stack()}"
        self.reason = reason
        print(f"raylm: watchdog: {reason}", file=sys.stderr, flush=True)
        error = ProgressTimeout(reason)
        if self.fail is not None:
            try:
                self.fail(error)
            except Exception as e:  # noqa: BLE001 - the thread raise and the exit below still act
                print(f"raylm: watchdog: could not report the failure ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)
        _reasons[self._thread_id] = reason
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), ctypes.py_object(ProgressTimeout))
        deadline = time.monotonic() + self.exit_grace_s
        while time.monotonic() < deadline:
            if not self._in_loop():
                return
            time.sleep(0.2)
        print(f"raylm: watchdog: rank {self._rank}'s training thread is still blocked "
              f"{self.exit_grace_s:.0f} s after the timeout; exiting the process (status {EXIT_STATUS})",
              file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)

    def _pending(self) -> str:
        """`describe()`, bounded in time: it may query a cluster that is itself in trouble."""
        if self.describe is None:
            return ""
        out: list[str] = []

        def run() -> None:
            try:
                out.append(self.describe())
            except Exception as e:  # noqa: BLE001 - a diagnosis must not prevent the failure
                out.append(f"(could not inspect the cluster: {type(e).__name__}: {e})")

        thread = threading.Thread(target=run, name="raylm-watchdog-describe", daemon=True)
        thread.start()
        thread.join(DESCRIBE_TIMEOUT_S)
        return out[0] if out else f"(the cluster did not answer within {DESCRIBE_TIMEOUT_S:.0f} s)"

    def _frame(self):
        return sys._current_frames().get(self._thread_id)

    def _in_loop(self) -> bool:
        """Whether the training thread is still inside the loop that called on_train_start."""
        frame, (loop_id, loop_code) = self._frame(), self._loop_frame
        while frame is not None:
            if id(frame) == loop_id and frame.f_code is loop_code:
                return True
            frame = frame.f_back
        return False

    def _training_stack(self) -> str:
        """The innermost frames (where it blocks, often inside a library), then the innermost
        frames of raylm's own code (which of its waits that is)."""
        frames, frame = [], self._frame()
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        ours = [f for f in frames[STACK_FRAMES:] if f.f_globals.get("__name__", "").startswith("raylm.")]
        shown = [_where(f) for f in frames[:STACK_FRAMES]]
        if ours:
            shown += ["..."] * (frames.index(ours[0]) > STACK_FRAMES) + [_where(f) for f in ours[:2]]
        return " <- ".join(shown) or "(thread gone)"


def _where(frame) -> str:
    module = frame.f_globals.get("__name__") or os.path.basename(frame.f_code.co_filename)
    return f"{frame.f_code.co_name} ({module}:{frame.f_lineno})"


def _outermost_caller_frame() -> tuple[int, object]:
    """(id, code) of the outermost consecutive frame of the module that called the hook: the
    loop function itself even if the loop calls its hooks through a helper of its own."""
    frame = sys._getframe(2)  # 0: this function, 1: on_train_start, 2: the loop (or its helper)
    module = frame.f_globals.get("__name__")
    while frame.f_back is not None and frame.f_back.f_globals.get("__name__") == module:
        frame = frame.f_back
    return id(frame), frame.f_code

