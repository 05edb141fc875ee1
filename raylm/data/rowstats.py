"""The data's own statistics for the guard's model-free data check, row by row: a model that has
learned nothing cannot judge data, but the data can be judged against itself.

Of each row's targets (a row holds seq_len + 1 tokens; its targets are the last seq_len):
- its cross-entropy under the train split's unigram (token counts, plus one: nats per token):
  how improbable its tokens are in this dataset;
- the entropy of its own token counts (nats): how widely it spreads over its alphabet.

Noise (random printable characters, random bytes, a broken shard) is far out on both: rare tokens,
spread as chance spreads them. Clean text that is odd for its dataset is out on one at most: a
list of upper-case constants, a hex table, Python source among prose are improbable under the
unigram but repeat their few symbols (their own entropy is low). On the standard library's
docstrings, 2.8% of clean 64-token rows lie 8 deviations above the median cross-entropy; requiring
the own entropy too leaves 1.4% (0.06% beside a poisoned window, which widens the deviations),
and every row of random printable characters or random bytes still passes both (issue 60,
benchmarks/RESULTS.md). A row is too little to judge by: the check judges a batch by the share of
its rows that pass both.

`raylm prepare` records the unigram and, for each statistic, the median and the median absolute
deviation over the train split's rows (`Manifest.data_check`): a median and its deviation, not a
mean and a standard deviation, so that a poisoned window of a tenth of the data moves them little.
"""

from __future__ import annotations

import numpy as np

BINS = 8192
CE_RANGE = 32.0  # nats: -ln of a token seen once among 1e13 still fits
"""Histograms of the two statistics over [0, CE_RANGE] and [0, ln(seq_len)]: shards' histograms add
up to the split's, so a dataset of any size is summarised in one pass over its rows."""


def log_probs(counts: np.ndarray) -> np.ndarray:
    """The unigram's log-probabilities, every token counted once more (one never seen is rare, not impossible)."""
    smoothed = counts.astype(np.float64) + 1.0
    return np.log(smoothed / smoothed.sum())


def row_cross_entropy(targets: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """(rows,) the mean -log p of each row's targets, `targets` (rows, seq_len)."""
    return -logp[targets].mean(axis=1)


def row_entropy(targets: np.ndarray) -> np.ndarray:
    """(rows,) the entropy (nats) of each row's own token counts, `targets` (rows, seq_len)."""
    rows, width = targets.shape
    x = np.sort(targets, axis=1)
    new = np.ones_like(x, dtype=bool)
    new[:, 1:] = x[:, 1:] != x[:, :-1]
    starts = np.flatnonzero(new)  # each run of one token; every row begins one
    p = np.diff(np.append(starts, rows * width)) / width
    return np.bincount(starts // width, weights=-p * np.log(p), minlength=rows)


def histograms(targets: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """(2, BINS) counts of the rows' cross-entropies and own entropies."""
    width = targets.shape[1]
    out = np.zeros((2, BINS), dtype=np.int64)
    for i, (values, top) in enumerate(((row_cross_entropy(targets, logp), CE_RANGE),
                                       (row_entropy(targets), np.log(width)))):
        out[i] = np.bincount(np.clip((values / top * BINS).astype(np.int64), 0, BINS - 1), minlength=BINS)
    return out


def median_and_deviation(counts: np.ndarray, top: float) -> tuple[float, float]:
    """The median and the median absolute deviation of the values a histogram over [0, top] counts."""
    centres = (np.arange(BINS) + 0.5) * top / BINS
    median = _weighted_median(centres, counts)
    return median, _weighted_median(np.abs(centres - median), counts)


def _weighted_median(values: np.ndarray, counts: np.ndarray) -> float:
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(counts[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])
