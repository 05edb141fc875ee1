"""The guard's data check, on the device: each row of a batch against the dataset's own rows
(`raylm.data.rowstats`, recorded by `raylm prepare`). A model that has learned nothing cannot
judge data (at the unigram level the noise test does not apply and the canary cannot tell noise
from learning); the data itself can be judged, from step 0.

A row is noise when its cross-entropy under the dataset's unigram lies `guard.data_deviations`
median absolute deviations above the rows' median, and its own token-count entropy
ENTROPY_DEVIATIONS above theirs (noise spreads; odd text repeats its rare symbols). Read in chunks
of shuffled rows, a poisoned window comes as batches that mix it with the clean rows beside it.
A batch with NOISE_SHARE of its rows noise is suspect on the device
(`raylm.train.resilience.judge`): the host then masks the noise rows for the rest of the chunk
(`masking_steps`), and the step is computed again without them; a batch of noise alone is
skipped. Masked rows are left out of the loss (`raylm.train.step`), their samples recorded as the
guard's skips. Rows flagged in batches below the share are trained on outside that span: there they
are mostly the clean rows the limits misjudge (up to 1.4% of some corpora's), and nothing about
them depends on the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from raylm.data import rowstats
from raylm.data.manifest import Manifest

ENTROPY_DEVIATIONS = 2.5
"""Random printable characters' 64-token rows sit 4-5 deviations above English's; a list of
constants or a hex table below its median (benchmarks/RESULTS.md, issue 60)."""
NOISE_SHARE = 1 / 3
"""A batch with at least this share of noise rows arms the masking. Simulated on four corpora
(Shakespeare, the standard library's docstrings, its sources, Shakespeare and sources together)
in chunks of 4096 shuffled rows, batches of 12: a third skipped no clean batch and left about a
tenth of a 300 KB window's rows trained on (in batches holding fewer); a quarter skipped 1-3
clean batches of the docstrings' epoch."""
DEVIATION_FLOOR = 0.01
"""A deviation below this fraction of the median (a dataset of one text repeated) counts as this."""


@dataclass(frozen=True)
class DataLimit:
    """The limits a row's statistics must both pass to be noise, and the unigram's log-probs."""

    log_probs: np.ndarray
    cross_entropy: float
    entropy: float


def data_limit(manifests: Sequence[Manifest], names: Sequence[str],
               deviations: float) -> tuple[Optional[DataLimit], Optional[str]]:
    """The data check's limits, or None and why when that is not the user's choice
    (guard.data_deviations=0): a dataset prepared before the statistics, or a mixture."""
    if not deviations:
        return None, None
    if len(manifests) > 1:
        return None, "the data check is off: it judges one dataset's rows, not a mixture's"
    (manifest,), (name,) = manifests, names
    check = manifest.data_check
    if check is None:
        return None, (f"the data check is off: {name} was prepared before `raylm prepare` recorded the statistics "
                      "it judges by; prepare it again to have batches of noise skipped from step 0")

    def limit(median: float, deviation: float, k: float) -> float:
        return median + k * max(deviation, DEVIATION_FLOOR * median)

    return DataLimit(rowstats.log_probs(np.asarray(check.unigram)),
                     limit(check.cross_entropy.median, check.cross_entropy.deviation, deviations),
                     limit(check.entropy.median, check.entropy.deviation, ENTROPY_DEVIATIONS)), None


class DataCheck:
    """The check of one rank's rows on the device: no host sync."""

    def __init__(self, limit: DataLimit, device: torch.device):
        self.limit = limit
        self.log_probs = torch.as_tensor(limit.log_probs, dtype=torch.float32, device=device)  # (vocab,)

    def noise_rows(self, targets: torch.Tensor) -> torch.Tensor:
        """(rows,) bool: which of this rank's rows (`targets`: (rows, seq_len)) are noise."""
        cross_entropy = -self.log_probs[targets].mean(dim=1)  # (rows,)
        return (cross_entropy > self.limit.cross_entropy) & (row_entropy(targets) > self.limit.entropy)

    def noise_share(self, targets: torch.Tensor) -> torch.Tensor:
        """The share of the rows that are noise: what the judge weighs a batch by."""
        return self.noise_rows(targets).float().mean()


def masking_steps(chunk_rows: int, global_batch: int) -> int:
    """How long the masking lasts once armed: a chunk of `data.chunk_rows` shuffled rows is read
    over this many steps (one more where it straddles them), so a window met in a batch is spread
    over at most these after it. A window longer than a chunk arms it again at its next batch."""
    return -(-chunk_rows // global_batch) + 1


def row_entropy(targets: torch.Tensor) -> torch.Tensor:
    """(rows,) the entropy of each row's own token counts, as `raylm.data.rowstats.row_entropy`
    counts it; vectorised: each row sorted, its runs of equal tokens counted."""
    rows, width = targets.shape
    x = targets.sort(dim=1).values
    new = torch.ones_like(x, dtype=torch.bool)
    new[:, 1:] = x[:, 1:] != x[:, :-1]
    run = new.long().cumsum(dim=1) - 1  # each target's run, within its row
    ones = torch.ones(x.shape, dtype=torch.float32, device=x.device)
    p = torch.zeros_like(ones).scatter_add_(1, run, ones) / width
    return -(p * torch.log(torch.where(p > 0, p, 1.0))).sum(dim=1)
