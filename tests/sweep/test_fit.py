"""The scaling-law fits on synthetic results from known laws (no Ray, no training)."""

import math

import numpy as np
import pytest

from raylm.sweep import fit

TRUE = fit.Parametric(E=1.0, A=30.0, alpha=0.35, B=60.0, beta=0.3)


def ladder_points(noise: float, seed: int):
    """5 sizes x 4 tokens-per-parameter ratios, log-normal noise on the loss."""
    rng = np.random.default_rng(seed)
    n = np.repeat([1e4, 2e4, 4e4, 8e4, 1.6e5], 4)
    d = n * np.tile([10, 20, 40, 80], 5)
    return n, d, TRUE.loss(n, d) * np.exp(rng.normal(0, noise, len(n)))


def test_parametric_fit_recovers_known_constants_and_the_bootstrap_covers_them():
    n, d, loss = ladder_points(noise=0.005, seed=1)
    result = fit.fit_parametric(n, d, loss)
    got = result.fit
    assert got.alpha == pytest.approx(TRUE.alpha, abs=0.05)
    assert got.beta == pytest.approx(TRUE.beta, abs=0.05)
    assert got.E == pytest.approx(TRUE.E, rel=0.1)
    boots = fit.bootstrap_parametric(n, d, loss, result, resamples=100, seed=0)
    for name in fit.NAMES:
        lo, hi = fit.interval([getattr(b, name) for b in boots], 0.95)
        assert lo <= getattr(TRUE, name) <= hi, (name, lo, hi)
    # Extrapolation to a model 4x larger than the largest fitted one, at 20 tokens per parameter.
    big_n, big_d = 6.4e5, 1.28e7
    assert got.loss(big_n, big_d) == pytest.approx(TRUE.loss(big_n, big_d), rel=0.01)
    lo, hi = fit.interval([b.loss(big_n, big_d) for b in boots], 0.95)
    assert lo <= TRUE.loss(big_n, big_d) <= hi


def test_parametric_fit_is_exact_without_noise():
    n, d, loss = ladder_points(noise=0.0, seed=0)
    got = fit.fit_parametric(n, d, loss).fit
    for name in fit.NAMES:
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=2e-3), name


def test_parametric_fit_needs_five_points():
    with pytest.raises(ValueError, match="at least 5 points"):
        fit.fit_parametric([1e4, 2e4, 4e4, 8e4], [1e5, 2e5, 4e5, 8e5], [3.0, 2.9, 2.8, 2.7])


def test_compute_optimal_matches_the_closed_form_for_c_equal_6nd():
    # With F(N) = 6N the optimum has Chinchilla's closed form: N* = G (C/6)^(beta/(alpha+beta)).
    p = TRUE
    g = (p.alpha * p.A / (p.beta * p.B)) ** (1 / (p.alpha + p.beta))
    for c in (1e13, 1e15, 1e17):
        n, d, loss = fit.compute_optimal(p, c, lambda n: 6 * n)
        assert n == pytest.approx(g * (c / 6) ** (p.beta / (p.alpha + p.beta)), rel=1e-4)
        assert d == pytest.approx(c / (6 * n))
        assert loss == pytest.approx(float(p.loss(n, d)))
    # ... and the tokens at which a size is compute-optimal invert it.
    n, d, _ = fit.compute_optimal(p, 1e15, lambda n: 6 * n)
    assert fit.params_for_tokens_optimal(p, n, lambda n: 6 * n) == pytest.approx(d, rel=1e-3)


def test_best_lr_refines_between_grid_points_and_flags_the_edge():
    def loss(lr):
        return 2.0 + 0.1 * (math.log(lr) - math.log(2e-3)) ** 2
    grid = [1e-4, 1e-3, 3e-3, 1e-2]
    lr, best, at_edge = fit.best_lr(grid, [loss(v) for v in grid])
    assert lr == pytest.approx(2e-3, rel=1e-6) and best == pytest.approx(2.0) and not at_edge
    lr, _, at_edge = fit.best_lr([3e-3, 1e-2, 3e-2], [loss(v) for v in (3e-3, 1e-2, 3e-2)])
    assert lr == 3e-3 and at_edge  # the optimum lies below the tried values: widen the grid


def test_power_law_recovers_exponent():
    x = np.array([1e4, 3e4, 1e5, 3e5])
    law = fit.power_law(x, 0.5 * x ** -0.25)
    assert law["coef"] == pytest.approx(0.5) and law["exponent"] == pytest.approx(-0.25)
    with pytest.raises(ValueError):
        fit.power_law([1e4, 1e4], [1.0, 2.0])


def test_isoflop_fit_finds_the_optimum_of_each_budget():
    def flops_per_token(n):
        return 6 * n
    budgets = {}
    for c in (1e13, 1e14, 1e15):
        n_opt, _, _ = fit.compute_optimal(TRUE, c, flops_per_token)
        sizes = n_opt * np.geomspace(0.25, 4, 7)
        budgets[c] = [(n, float(TRUE.loss(n, c / flops_per_token(n)))) for n in sizes]
    result = fit.isoflop_fit(budgets, flops_per_token)
    for entry in result["budgets"]:
        n_opt = fit.compute_optimal(TRUE, entry["flops"], flops_per_token)[0]
        assert entry["params"] == pytest.approx(n_opt, rel=0.1) and entry["inside_sizes"]
    expected = TRUE.beta / (TRUE.alpha + TRUE.beta)
    assert result["params_vs_flops"]["exponent"] == pytest.approx(expected, abs=0.02)
    too_few = fit.isoflop_fit({1e13: budgets[1e13][:2]}, flops_per_token)
    assert "error" in too_few["budgets"][0] and "params_vs_flops" not in too_few


def test_the_local_power_law_is_exact_without_noise_and_predicts_along_a_single_ratio():
    law = fit.LocalPowerLaw(K=20.0, a=0.2, b=0.1)
    n = np.array([1e4, 2e4, 4e4, 1e4, 2e4, 4e4])
    d = np.concatenate([10 * n[:3], 40 * n[3:]])
    got = fit.fit_local(n, d, law.loss(n, d))
    assert (got.K, got.a, got.b) == pytest.approx((20.0, 0.2, 0.1), rel=1e-6)
    # One tokens-per-parameter ratio cannot split the slope between N and D; along it the
    # prediction is the law's all the same.
    one = fit.fit_local(n[:3], d[:3], law.loss(n[:3], d[:3]))
    assert float(one.loss(1.6e5, 1.6e6)) == pytest.approx(float(law.loss(1.6e5, 1.6e6)), rel=1e-9)
    boots = fit.bootstrap_local(n, d, law.loss(n, d) * np.exp(np.random.default_rng(0).normal(0, 0.01, 6)), 30)
    assert len(boots) == 30 and np.median([b.a for b in boots]) == pytest.approx(0.2, abs=0.03)
    with pytest.raises(ValueError, match="two sizes"):
        fit.fit_local([1e4, 1e4], [1e5, 2e5], [2.0, 1.9])
