"""Scaling-law fits: pure functions from a table of results to fitted constants (numpy, scipy).

- `fit_parametric`: Chinchilla's L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022,
  approach 3), fitted as they did and as Besiroglu et al. 2024 showed it must be: the Huber loss
  of log-loss residuals, L-BFGS from a grid of initializations, the log-sum-exp form for
  stability, and optimizer tolerances tight enough to converge. `bootstrap_parametric` refits on
  resampled points for confidence intervals.
- `fit_local`: L(N, D) = K / (N^a D^b), log-log least squares on the ladder's upper sizes: a
  near-extrapolation form that, unlike the sum above, is not forced to flatten along a budget.
  `bootstrap_local` refits it on resampled points.
- `best_lr`: a rung's best learning rate, refined by a parabola through the best grid point and
  its neighbours in log lr; `power_law`: log-log least squares (LR*(N), LR*(C), N*(C)).
- `isoflop_fit`: Chinchilla approach 2, a parabola in log N per compute budget.
- `compute_optimal`: the N that minimizes L(N, C / F(N)) for the real FLOPs per token F(N).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
from scipy.optimize import brentq, minimize, minimize_scalar

NAMES = ("E", "A", "alpha", "B", "beta")
SMALLEST_PARAMS = 1e2  # compute_optimal searches N from here to 1e13
# Hoffmann et al.'s initialization grid (appendix D.2), on theta = (log A, log B, log E, alpha, beta).
INIT_GRID = {"a": np.arange(0, 30, 5.0), "b": np.arange(0, 30, 5.0), "e": np.arange(-1, 1.5, 0.5),
             "alpha": np.arange(0, 2.5, 0.5), "beta": np.arange(0, 2.5, 0.5)}


@dataclass(frozen=True)
class Parametric:
    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, params, tokens) -> np.ndarray:
        log_n, log_d = np.log(np.asarray(params, float)), np.log(np.asarray(tokens, float))
        # exp(-alpha log N) rather than 1 / N^alpha: an extreme bootstrap fit underflows to 0, not inf.
        return self.E + self.A * np.exp(-self.alpha * log_n) + self.B * np.exp(-self.beta * log_d)

    def to_dict(self) -> dict:
        return {k: float(getattr(self, k)) for k in NAMES}

    @staticmethod
    def from_theta(theta: np.ndarray) -> "Parametric":
        a, b, e, alpha, beta = theta
        return Parametric(float(np.exp(e)), float(np.exp(a)), float(alpha), float(np.exp(b)), float(beta))


def _objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, delta: float,
               weights: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean Huber loss of log L_hat - log L over the points (x = log N, y = log D), and its gradient.
    Scaled by 1/delta so that L-BFGS's relative tolerances see numbers near 1."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * x, b - beta * y, np.full_like(x, e)])  # (3, n)
    top = terms.max(axis=0)
    lse = top + np.log(np.exp(terms - top).sum(axis=0))
    r = lse - log_loss
    small = np.abs(r) <= delta
    huber = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)) / delta
    dr = np.clip(r, -delta, delta) / delta * weights  # d huber / d r, weighted
    w = np.exp(terms - lse)  # softmax: d lse / d term
    grad = np.array([np.sum(dr * w[0]), np.sum(dr * w[1]), np.sum(dr * w[2]),
                     np.sum(dr * w[0] * -x), np.sum(dr * w[1] * -y)])
    total = weights.sum()
    return float(np.sum(huber * weights) / total), grad / total


def _minimize(theta0: np.ndarray, args: tuple) -> tuple[float, np.ndarray]:
    res = minimize(_objective, theta0, args=args, jac=True, method="L-BFGS-B",
                   options={"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-8})
    return float(res.fun), res.x


def _grid() -> np.ndarray:
    g = INIT_GRID
    return np.array(list(itertools.product(g["a"], g["b"], g["e"], g["alpha"], g["beta"])))


@dataclass(frozen=True)
class ParametricFit:
    fit: Parametric
    theta: np.ndarray
    objective: float
    starts: np.ndarray  # the two best solutions found: the warm starts of bootstrap refits


def fit_parametric(params: Sequence[float], tokens: Sequence[float], losses: Sequence[float],
                   delta: float = 1e-3, top_inits: int = 32, weights: Optional[np.ndarray] = None) -> ParametricFit:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta to observed losses.

    Every point of Hoffmann et al.'s 4500-point initialization grid is scored; L-BFGS runs from the
    `top_inits` best of them, and the lowest objective wins.
    """
    x, y = np.log(np.asarray(params, float)), np.log(np.asarray(tokens, float))
    log_loss = np.log(np.asarray(losses, float))
    if len(x) < 5:
        raise ValueError(f"the parametric fit has 5 constants and needs at least 5 points, got {len(x)}")
    weights = np.ones_like(x) if weights is None else np.asarray(weights, float)
    args = (x, y, log_loss, delta, weights)
    grid = _grid()
    scores = np.array([_objective(t, *args)[0] for t in grid])
    runs = [_minimize(grid[i], args) for i in np.argsort(scores)[:top_inits]]
    runs.sort(key=lambda r: r[0])
    starts = np.array([theta for _, theta in runs[:2]])
    objective, theta = runs[0]
    return ParametricFit(Parametric.from_theta(theta), theta, objective, starts)


def bootstrap_parametric(params: Sequence[float], tokens: Sequence[float], losses: Sequence[float],
                         base: ParametricFit, resamples: int, seed: int = 0, delta: float = 1e-3,
                         progress: Optional[Callable[[int], None]] = None) -> list[Parametric]:
    """Refits on `resamples` resamplings of the points (with replacement), each from the full fit's
    best solutions. Resampling is by multiplicity weights: the same points, counted 0..k times.
    `progress` is told the number of refits done after each (hundreds of L-BFGS runs: minutes)."""
    x, y = np.log(np.asarray(params, float)), np.log(np.asarray(tokens, float))
    log_loss = np.log(np.asarray(losses, float))
    rng = np.random.default_rng(seed)
    fits = []
    n = len(x)
    for _ in range(resamples):
        counts = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)
        args = (x, y, log_loss, delta, counts)
        best = min((_minimize(s, args) for s in base.starts), key=lambda r: r[0])
        fits.append(Parametric.from_theta(best[1]))
        if progress is not None:
            progress(len(fits))
    return fits


@dataclass(frozen=True)
class LocalPowerLaw:
    """L(N, D) = K * N^-a * D^-b: a straight plane in log-log space."""

    K: float
    a: float
    b: float

    def loss(self, params, tokens) -> np.ndarray:
        log_n, log_d = np.log(np.asarray(params, float)), np.log(np.asarray(tokens, float))
        return self.K * np.exp(-self.a * log_n - self.b * log_d)

    def to_dict(self) -> dict:
        return {"K": self.K, "a": self.a, "b": self.b}


def fit_local(params: Sequence[float], tokens: Sequence[float], losses: Sequence[float],
              weights: Optional[np.ndarray] = None) -> LocalPowerLaw:
    """Least squares of log L on (1, log N, log D). With one tokens-per-parameter ratio log N and
    log D move together: the minimum-norm solution splits the slope between them, and predictions
    along that ratio are the same whatever the split."""
    x, y = np.log(np.asarray(params, float)), np.log(np.asarray(tokens, float))
    if len(set(np.round(x, 9))) < 2:
        raise ValueError("the local power law needs at least two sizes")
    w = np.sqrt(np.ones_like(x) if weights is None else np.asarray(weights, float))
    design = np.stack([np.ones_like(x), -x, -y], axis=1) * w[:, None]
    (log_k, a, b), *_ = np.linalg.lstsq(design, np.log(np.asarray(losses, float)) * w, rcond=None)
    return LocalPowerLaw(float(np.exp(log_k)), float(a), float(b))


def bootstrap_local(params: Sequence[float], tokens: Sequence[float], losses: Sequence[float],
                    resamples: int, seed: int = 0) -> list[LocalPowerLaw]:
    """Refits on `resamples` resamplings of the points by multiplicity weights, as
    `bootstrap_parametric`; a resample with a single size is drawn again."""
    rng = np.random.default_rng(seed)
    n, fits = len(params), []
    while len(fits) < resamples:
        counts = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)
        if len({p for p, c in zip(params, counts) if c}) < 2:
            continue
        fits.append(fit_local(params, tokens, losses, counts))
    return fits


def interval(samples: Sequence[float], confidence: float) -> list[float]:
    """The central `confidence` percentile interval of bootstrap samples."""
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(np.asarray(samples, float), [tail, 100 - tail])
    return [float(lo), float(hi)]


def power_law(x: Sequence[float], y: Sequence[float]) -> dict:
    """y = coef * x^exponent by least squares in log-log space."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    if len(lx) < 2 or np.ptp(lx) == 0:
        raise ValueError("a power law needs at least two distinct x values")
    exponent, intercept = np.polyfit(lx, ly, 1)
    return {"coef": float(np.exp(intercept)), "exponent": float(exponent)}


def eval_power_law(fit: dict, x: float) -> float:
    return fit["coef"] * x ** fit["exponent"]


def best_lr(lrs: Sequence[float], losses: Sequence[float]) -> tuple[float, float, bool]:
    """(best lr, its loss, whether the best is at the edge of the tried values). An interior best
    is refined by the vertex of the parabola through it and its two neighbours in log lr."""
    order = np.argsort(np.asarray(lrs, float))
    lr, loss = np.asarray(lrs, float)[order], np.asarray(losses, float)[order]
    lx = np.log(lr)
    i = int(np.argmin(loss))
    if i == 0 or i == len(lx) - 1:
        return float(lr[i]), float(loss[i]), len(lx) > 1
    a, b, c = np.polyfit(lx[i - 1:i + 2], loss[i - 1:i + 2], 2)
    if a <= 0:
        return float(lr[i]), float(loss[i]), False
    vertex = float(np.clip(-b / (2 * a), lx[i - 1], lx[i + 1]))
    return float(np.exp(vertex)), float(a * vertex ** 2 + b * vertex + c), False


def flops_per_token_law(params: Sequence[float], flops_per_token: Sequence[float]) -> Callable[[float], float]:
    """F(N) between (and beyond) the ladder's sizes: a power law through their real FLOPs per token."""
    if len(set(params)) < 2:
        ratio = flops_per_token[0] / params[0]
        return lambda n: ratio * n
    law = power_law(params, flops_per_token)
    return lambda n: eval_power_law(law, n)


def compute_optimal(fit: Parametric, flops: float,
                    flops_per_token: Callable[[float], float]) -> tuple[float, float, float]:
    """(N*, D*, L*) for compute `flops`: N* minimizes L(N, flops / F(N))."""
    def loss_at(log_n: float) -> float:
        n = np.exp(log_n)
        return float(fit.loss(n, flops / flops_per_token(n)))
    res = minimize_scalar(loss_at, bounds=(np.log(SMALLEST_PARAMS), np.log(1e13)), method="bounded",
                          options={"xatol": 1e-6})
    n = float(np.exp(res.x))
    return n, flops / flops_per_token(n), float(res.fun)


def params_for_tokens_per_param(flops: float, tokens_per_param: float,
                                flops_per_token: Callable[[float], float]) -> float:
    """N whose run of `flops` trains `tokens_per_param` tokens per parameter."""
    def gap(log_n: float) -> float:  # falls as N grows: fewer tokens, each costing more
        n = np.exp(log_n)
        return np.log(flops / flops_per_token(n) / n) - np.log(tokens_per_param)
    return float(np.exp(brentq(gap, np.log(SMALLEST_PARAMS), np.log(1e13))))


def params_for_tokens_optimal(fit: Parametric, params: float, flops_per_token: Callable[[float], float]) -> float:
    """D for a given N: the tokens at which N is compute-optimal (N*(C) inverted)."""
    def gap(log_c: float) -> float:
        return (np.log(compute_optimal(fit, np.exp(log_c), flops_per_token)[0]) - np.log(params)) ** 2
    f = flops_per_token(params)
    low, high = np.log(f * params), np.log(f * params * 1e5)
    res = minimize_scalar(gap, bounds=(low, high), method="bounded", options={"xatol": 1e-7})
    if res.fun > 1e-4:
        raise ValueError(f"the fit makes {params:,.0f} parameters compute-optimal at no budget from 1 to 1e5 tokens "
                         "per parameter; give the target as flops instead")
    return float(np.exp(res.x)) / f


def isoflop_fit(budget_points: dict[float, list[tuple[float, float]]],
                flops_per_token: Callable[[float], float]) -> dict:
    """Chinchilla approach 2. budget_points: C -> [(N, best loss)] of the sizes trained at C. Per
    budget a parabola in log N gives N_opt(C); across budgets, power laws N_opt ∝ C^a, D_opt ∝ C^b."""
    budgets = []
    for flops, points in sorted(budget_points.items()):
        if len(points) < 3:
            budgets.append({"flops": flops, "error": f"{len(points)} sizes trained; a parabola needs 3"})
            continue
        lx = np.log([n for n, _ in points])
        loss = np.array([l for _, l in points])
        a, b, c = np.polyfit(lx, loss, 2)
        if a <= 0:
            budgets.append({"flops": flops, "error": "loss is not convex in log N at this budget"})
            continue
        vertex = -b / (2 * a)
        n_opt = float(np.exp(vertex))
        budgets.append({"flops": flops, "params": n_opt, "tokens": flops / flops_per_token(n_opt),
                        "loss": float(a * vertex ** 2 + b * vertex + c),
                        "inside_sizes": bool(lx.min() <= vertex <= lx.max())})
    good = [b for b in budgets if "params" in b]
    out: dict = {"budgets": budgets}
    if len(good) >= 2:
        out["params_vs_flops"] = power_law([b["flops"] for b in good], [b["params"] for b in good])
        out["tokens_vs_flops"] = power_law([b["flops"] for b in good], [b["tokens"] for b in good])
    return out
