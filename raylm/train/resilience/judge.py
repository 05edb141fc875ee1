"""Each step's verdict, taken on the device so that a steady step never waits for its loss: the
skip decision is a mask on the update (OLMo-core's SkipStepOptimizer; the fused AdamW's found_inf
path, as torch.amp.GradScaler uses it), not a host branch.

The host reads the verdicts later, a window of steps at a time (`raylm.train.loop`). A step the
device does not apply for want of a judgement (a suspect or non-finite one) halts the device: the
steps queued after it are not applied either, so that the host finds the model exactly as that
step found it, decides as the guard always has (`raylm.train.resilience.guard`), and queues the
later batches again.

Verdicts, in order of precedence:
- OVERFLOW: fp16 gradients overflowed with a finite loss; no update (the host halves the scale).
- NONFINITE: the loss or the gradient norm is not finite; no update, the host computes it again.
- SUSPECT (with the guard on): a third of the batch's rows are noise by the dataset's own
  statistics (the data check, `raylm.train.resilience.datacheck`: from step 0, the model not
  asked), or, where the step masks them, all of its rows are; the batch is noise to a model past
  the unigram level (its loss above NOISE_LEVEL × the unigram loss), or, once `min_history` healthy steps are known, the loss
  or the gradient norm lies more than `sigmas` population deviations above the mean of the last
  `window`; no update until the guard's canary has judged it.
- OK: applied; its loss and gradient norm join the history.
- HALTED: queued behind a withheld step; not applied, queued again.
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

import torch

from raylm.config import GuardConfig
from raylm.train.resilience import datacheck

# Random printable bytes cost a model of Shakespeare 137-150% of the unigram loss; text of a new kind
# (Python sources to that model) stays near or below it: the model draws on what it knows.
NOISE_LEVEL = 1.2
UNIGRAM_MARGIN = 0.1  # a diverged nanoGPT run sits 3-7% below the unigram level; a healthy one falls past 10% early


class Verdict(enum.IntEnum):
    OK = 0
    OVERFLOW = 1
    SUSPECT = 2
    NONFINITE = 3
    HALTED = 4


# The fields of a step's record, the one tensor per step the host reads (with the data check on,
# followed by its flags of the step's rows, `raylm.train.loop`).
LOSS, GRAD_NORM, VERDICT, LOSS_SIGMAS, GRAD_NORM_SIGMAS, NOISE, NOISE_ROWS, OFF_DATA, MASKED = range(9)


def at_unigram_level(loss: float, unigram: Optional[float]) -> bool:
    """A loss within UNIGRAM_MARGIN of the loss of token frequencies alone: the model knows little
    more (a run at too high an LR stays there; a healthy one leaves it early)."""
    return bool(unigram) and loss > unigram * (1 - UNIGRAM_MARGIN)


class StepJudge:
    """The device-side judgement of every step, and the rolling history it judges against: the
    last `window` losses and gradient norms of the steps trained on as judged (`history`), and the
    healthy steps' losses alone (`healthy`), oldest first. Without the guard, only finiteness (and
    fp16's overflow) is judged."""

    def __init__(self, device: torch.device, guard: Optional[GuardConfig], unigram: Optional[float],
                 loss_scaling: bool, data_check: bool = False):
        self.guard, self.unigram, self.loss_scaling = guard, unigram, loss_scaling
        self.data_check = data_check and guard is not None  # judge the share of noise rows (datacheck)
        window = guard.window if guard is not None else 1
        f64 = dict(device=device, dtype=torch.float64)
        self.history = torch.zeros(2, window, **f64)  # (losses, grad norms)
        self.healthy = torch.zeros(window, **f64)
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # filled entries of history, healthy
        self.halted = torch.zeros((), dtype=torch.bool, device=device)
        self.positions = torch.arange(window, device=device)

    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor, past_unigram: bool,
              noise_share: Optional[torch.Tensor] = None, masked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's record (LOSS ... MASKED, float64) and whether its update applies (a bool
        tensor for `raylm.train.optim.step_where`); takes OK steps into the history and halts on a
        step the host must judge. `past_unigram`: the guard's snapshot says the model has learned
        more than token frequencies (the training losses may say so sooner). `noise_share`: the share
        of the batch's rows the data check finds noise (`datacheck.DataCheck.noise_rows`); `masked`:
        the step left them out of its loss, so only a batch of noise alone is off the data."""
        x = torch.stack([loss.detach().double().reshape(()), grad_norm.detach().double().reshape(())])
        finite = torch.isfinite(x)
        overflow = finite[0] & ~finite[1] if self.loss_scaling else torch.zeros_like(finite[0])
        nonfinite = ~(finite[0] & finite[1]) & ~overflow
        sigmas, noise = torch.zeros_like(x), torch.zeros_like(finite[0])
        suspect = torch.zeros_like(finite[0])
        share = torch.zeros((), dtype=torch.float64, device=x.device) if noise_share is None else \
            noise_share.detach().double().reshape(())
        off_data = share >= (1.0 if masked else datacheck.NOISE_SHARE) - 1e-9 if self.data_check \
            else torch.zeros_like(finite[0])
        if self.guard is not None:
            sigmas = self._sigmas(x)
            noise = self._noise(x[0], past_unigram)
            spike = (self.counts[0] >= self.guard.min_history) & (sigmas.max() > self.guard.sigmas)
            suspect = noise | spike | off_data
        verdict = torch.where(self.halted, Verdict.HALTED, torch.where(
            overflow, Verdict.OVERFLOW, torch.where(nonfinite, Verdict.NONFINITE, torch.where(
                suspect, Verdict.SUSPECT, Verdict.OK))))
        apply = verdict == Verdict.OK
        if self.guard is not None:
            self._remember(x, apply)
        self.halted |= verdict >= Verdict.SUSPECT
        masked_flag = torch.full((1,), float(masked), dtype=torch.float64, device=x.device)
        record = torch.cat([x, verdict.double().reshape(1), sigmas, noise.double().reshape(1), share.reshape(1),
                            off_data.double().reshape(1), masked_flag])
        return record, apply

    def _sigmas(self, x: torch.Tensor) -> torch.Tensor:
        """How many population deviations the loss and the grad norm lie above their history's mean."""
        n = self.counts[0]
        filled = self.positions >= self.positions.numel() - n  # the newest n entries: the last ones
        count = n.clamp(min=1).double()
        mean = (self.history * filled).sum(dim=1) / count
        deviation = (((self.history - mean[:, None]) * filled) ** 2).sum(dim=1).div(count).sqrt()
        return (x - mean) / torch.where(deviation > 0, deviation, 1e-12)

    def _noise(self, loss: torch.Tensor, past_unigram: bool) -> torch.Tensor:
        """Whether the batch is noise to the model: it predicts it far worse (NOISE_LEVEL) than token
        frequencies alone would (random bytes, a broken shard), though it has learned more than them:
        its snapshot says so, or, before a check has, the median of its last `min_history` healthy
        training losses (a median, so that batches of noise among them do not hide it)."""
        if not self.unigram:
            return torch.zeros((), dtype=torch.bool, device=loss.device)
        noise = loss > NOISE_LEVEL * self.unigram
        m = self.guard.min_history
        if past_unigram:
            return noise
        if m > self.positions.numel():  # a window shorter than min_history never holds m losses
            return torch.zeros_like(noise)
        recent = self.healthy[-m:].sort().values
        median = recent[m // 2] if m % 2 else (recent[m // 2 - 1] + recent[m // 2]) / 2
        return noise & (self.counts[1] >= m) & (median <= self.unigram * (1 - UNIGRAM_MARGIN))

    def _remember(self, x: torch.Tensor, apply: torch.Tensor) -> None:
        shifted = torch.cat([self.history[:, 1:], x[:, None]], dim=1)
        self.history = torch.where(apply, shifted, self.history)
        self.healthy = torch.where(apply, torch.cat([self.healthy[1:], x[:1]]), self.healthy)
        self.counts = (self.counts + apply.long()).clamp(max=self.positions.numel())

    def load(self, losses: Sequence[float], norms: Sequence[float], healthy: Sequence[float]) -> None:
        """Take the history from the host (the guard's, after it acted or at the start)."""
        window = self.positions.numel()
        losses, norms, healthy = list(losses)[-window:], list(norms)[-window:], list(healthy)[-window:]
        history = torch.zeros(2, window, dtype=torch.float64)
        if losses:
            history[0, window - len(losses):] = torch.tensor(losses, dtype=torch.float64)
            history[1, window - len(norms):] = torch.tensor(norms, dtype=torch.float64)
        kept = torch.zeros(window, dtype=torch.float64)
        if healthy:
            kept[window - len(healthy):] = torch.tensor(healthy, dtype=torch.float64)
        device = self.history.device
        self.history, self.healthy = history.to(device), kept.to(device)
        self.counts = torch.tensor([len(losses), len(healthy)], dtype=torch.int64).to(device)

    def resume(self) -> None:
        """The host has judged the withheld step: the next ones apply again."""
        self.halted.fill_(False)
