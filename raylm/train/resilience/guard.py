"""The stability guard: what OPT's and PaLM's teams did by hand when a run diverged.

Every step, the loss and the gradient norm (already on the host for the metrics, and equal on
every rank, so every rank takes the same decision without a collective) are compared with the
rolling mean and deviation of recent healthy steps:

- one outlier: the step is skipped (no optimizer update; its samples count as consumed);
- `rollback_after` outliers within `rollback_window` steps, or a non-finite loss or gradient:
  the run rolls back to its last healthy in-memory snapshot (model, optimizer, RNG), adds the
  global samples consumed since then to its skip ranges, optionally scales the LR, and goes on;
- `max_rollbacks` rollbacks within `stop_window` steps: the run stops with an error naming the
  steps, the data windows and what was tried, and leaves a marker in the run directory so that
  neither Ray's restarts nor a plain resume replay the divergence; a resume with changed
  settings (LR, skip ranges, clipping, schedule, guard) clears it.

Skip ranges, the LR scale, the rollback steps and the rolling history are run state: checkpoints
carry them, so they survive restarts, resizes and resumes, and a resumed run takes the decisions
the uninterrupted one would have taken. Every action is an event in events.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from raylm.config import Config
from raylm.data import storage
from raylm.parallel.world import World
from raylm.train.resilience.guard_stop import STOP_MARKER, GuardStopped, intervention_settings
from raylm.train.optim import unique_parameters
from raylm.train.observe.records import append_event
from raylm.train.state import TrainState
from raylm.train.step import ParallelModel


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Snapshot:
    """A healthy point to roll back to: this rank's shards of the weights and optimizer state,
    copied to host memory, the RNG, and the train state."""

    state: TrainState
    params: list[torch.Tensor]
    optim: list[dict]
    rng: torch.Tensor
    cuda_rng: Optional[torch.Tensor]

    @classmethod
    def take(cls, state: TrainState, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> "Snapshot":
        copy = lambda t: _local(t).detach().to("cpu", copy=True) if torch.is_tensor(t) else t  # noqa: E731
        return cls(dataclasses.replace(state, skip=[list(r) for r in state.skip], rollbacks=list(state.rollbacks)),
                   [copy(p) for p in params],
                   [{k: copy(v) for k, v in optimizer.state[p].items()} for p in params],
                   torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)

    def restore(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for p, saved in zip(params, self.params):
                _local(p).copy_(saved)
            for p, saved in zip(params, self.optim):
                state = optimizer.state[p]
                if not saved:  # taken before the first step: the optimizer starts afresh
                    state.clear()
                for k, v in saved.items():  # in place: the state keeps its types (DTensor or plain)
                    if torch.is_tensor(v):
                        _local(state[k]).copy_(v)
                    else:
                        state[k] = v
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng)


class Guard:
    """Judges each step and acts on the verdict (see the module docstring)."""

    def __init__(self, run_cfg: Config, model: ParallelModel, optimizer: torch.optim.Optimizer, world: World,
                 events_path: str, run_uri: str):
        self.run_cfg, self.cfg, self.optimizer, self.world = run_cfg, run_cfg.guard, optimizer, world
        self.events_path, self.run_uri = events_path, run_uri
        self.params = unique_parameters(model.parts)
        self.losses: deque = deque(maxlen=self.cfg.window)
        self.norms: deque = deque(maxlen=self.cfg.window)
        self.outliers: deque = deque()  # steps of recent outliers
        self.snapshot: Optional[Snapshot] = None
        self.skipped = 0
        self.trigger: dict = {}  # why the last verdict was not "ok"

    def start(self, state: TrainState) -> None:
        """Take up the history a resumed run saved, and keep the starting point as the first snapshot."""
        saved = state.guard
        self.losses.extend(saved.get("losses", []))
        self.norms.extend(saved.get("norms", []))
        self.outliers.extend(saved.get("outliers", []))
        self.skipped = saved.get("skipped", 0)
        self.snapshot = Snapshot.take(state, self.params, self.optimizer)

    def save_history(self, state: TrainState) -> None:
        """Put the rolling history into `state`, for a checkpoint."""
        state.guard = {"losses": list(self.losses), "norms": list(self.norms), "outliers": list(self.outliers),
                       "skipped": self.skipped}

    def judge(self, step: int, loss: float, grad_norm: float) -> str:
        """"ok", "skip" or "rollback" for a step whose loss and gradient norm are given."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.trigger = {"reason": "non-finite", "loss": loss, "grad_norm": grad_norm}
            return "rollback"
        if len(self.losses) >= self.cfg.min_history:
            scores = {name: _sigmas(value, history)
                      for name, value, history in (("loss", loss, self.losses), ("grad_norm", grad_norm, self.norms))}
            worst = max(scores, key=scores.get)
            if scores[worst] > self.cfg.sigmas:
                while self.outliers and self.outliers[0] <= step - self.cfg.rollback_window:
                    self.outliers.popleft()
                self.outliers.append(step)
                self.trigger = {"reason": f"{worst} spike", "loss": loss, "grad_norm": grad_norm,
                                "sigmas": round(scores[worst], 2),
                                "loss_mean": math.fsum(self.losses) / len(self.losses),
                                "grad_norm_mean": math.fsum(self.norms) / len(self.norms),
                                "outliers_in_window": len(self.outliers)}
                return "rollback" if len(self.outliers) >= self.cfg.rollback_after else "skip"
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return "ok"

    def loss_scale_floor(self, loss: float, scale: float, minimum: float) -> str:
        """fp16's scale fell below its floor: overflow after overflow is a divergence."""
        self.trigger = {"reason": "loss-scale floor", "loss": loss, "loss_scale": scale, "loss_scale_min": minimum}
        return "rollback"

    def skipped_step(self, step: int, sample_range: list[int]) -> None:
        self.skipped += 1
        self._event("spike_skipped", step=step, samples=sample_range, **self.trigger)

    def after_healthy_step(self, state: TrainState) -> None:
        """Keep a snapshot every `snapshot_every` steps while no outlier is recent."""
        if state.step % self.cfg.snapshot_every == 0 and not self.outliers:
            self.snapshot = Snapshot.take(state, self.params, self.optimizer)

    def roll_back(self, step: int, state: TrainState, consumed_until: int) -> None:
        """Restore the snapshot into `state` (in place) and the model, skip the samples consumed
        since it, scale the LR; or stop when rollbacks keep coming."""
        snap = self.snapshot
        window = [snap.state.position, consumed_until]
        recent = [s for s in state.rollbacks if s > step - self.cfg.stop_window]
        if len(recent) + 1 > self.cfg.max_rollbacks:
            self._stop(step, state, window, recent)
        lr_scale = snap.state.lr_scale * self.cfg.lr_factor
        restored = dataclasses.replace(snap.state, skip=[*state.skip, window], lr_scale=lr_scale,
                                       rollbacks=[*state.rollbacks, step])
        snap.restore(self.params, self.optimizer)
        for name, value in vars(restored).items():
            setattr(state, name, value)
        self.snapshot = dataclasses.replace(snap, state=dataclasses.replace(
            restored, skip=[list(r) for r in restored.skip], rollbacks=list(restored.rollbacks)))
        self.outliers.clear()
        self._event("rollback", step=step, to_step=restored.step, samples=window, **self.trigger)
        self._event("data_skipped", step=step, samples=window, skip=restored.skip)
        if self.cfg.lr_factor != 1.0:
            self._event("lr_scaled", step=step, lr_scale=lr_scale, factor=self.cfg.lr_factor)
        if self.world.rank == 0:
            print(f"raylm: guard: {self.trigger.get('reason')} at step {step}; rolled back to step "
                  f"{restored.step}, skipping samples [{window[0]}, {window[1]}), LR scale {lr_scale:g}", flush=True)

    def _stop(self, step: int, state: TrainState, window: list[int], recent: list[int]) -> None:
        message = (f"the stability guard stopped the run at step {step} ({self.trigger.get('reason')}: loss "
                   f"{self.trigger.get('loss')}, grad norm {self.trigger.get('grad_norm')}) after "
                   f"{len(recent)} rollback(s) within {self.cfg.stop_window} steps (at steps {recent}); skipped "
                   f"sample ranges {state.skip + [window]}, LR scale {state.lr_scale:g} "
                   f"(guard.lr_factor={self.cfg.lr_factor}). Tried: skipping outlier steps, rolling back to a "
                   "healthy snapshot and skipping the data since. Resume with a lower optim.lr, other "
                   "data.skip ranges, a tighter optim.grad_clip or other guard settings; the run directory "
                   f"holds {STOP_MARKER} until then")
        self._event("guard_stopped", step=step, samples=window, rollbacks=recent, skip=state.skip + [window],
                    message=message, **self.trigger)
        if self.world.rank == 0:
            marker = {"step": step, "message": message, "settings": intervention_settings(self.run_cfg)}
            storage.write_bytes(storage.join(self.run_uri, STOP_MARKER), json.dumps(marker).encode(),
                                self.run_cfg.storage)
        raise GuardStopped(message)

    def _event(self, name: str, **fields) -> None:
        if self.world.rank == 0:
            append_event(self.events_path, {"event": name, "time": time.time(), **fields})


def _sigmas(value: float, history: deque) -> float:
    """How many population standard deviations `value` lies above the mean of `history`.
    Two passes of fsum: statistics.pstdev computes exactly in fractions, 0.2 ms a step."""
    mean = math.fsum(history) / len(history)
    deviation = math.sqrt(math.fsum((x - mean) ** 2 for x in history) / len(history))
    return (value - mean) / (deviation or 1e-12)
