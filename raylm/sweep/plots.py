"""The sweep's figures (PNG, matplotlib without a display): loss against compute with the fitted
frontier, loss against learning rate per size, and the parametric fit's residuals."""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from raylm.sweep import fit
from raylm.sweep.analysis import COMPLETED, LR_SEARCH, STOPPED, Laws


def _save(plt, fig, directory: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(directory, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    return plt


def write_all(directory: str, rows: list[dict], result: dict, laws: Laws) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    plt = _pyplot()
    written = [_loss_vs_compute(plt, directory, rows, result, laws), _lr_curves(plt, directory, rows)]
    if "residuals" in result.get("parametric", {}):
        written.append(_residuals(plt, directory, result["parametric"]["residuals"]))
    return written


def _colors(plt, n: int) -> list:
    return [plt.get_cmap("viridis")(i / max(1, n - 1)) for i in range(n)]


def _loss_vs_compute(plt, directory: str, rows: list[dict], result: dict, laws: Laws) -> str:
    fig, ax = plt.subplots(figsize=(7, 5))
    sizes = sorted({r["size"] for r in rows})
    colors = dict(zip(sizes, _colors(plt, len(sizes))))
    for size in sizes:
        done = [r for r in rows if r["size"] == size and r["status"] == COMPLETED and r["phase"] == "ladder"]
        if done:
            ax.scatter([r["flops"] for r in done], [r["val_loss"] for r in done], s=14, alpha=0.5, color=colors[size],
                       label=f"N={done[0]['params']:,}")
    bests = result.get("rungs", [])
    ax.scatter([b["flops"] for b in bests], [b["loss"] for b in bests], s=40, facecolors="none", edgecolors="k",
               label="best per rung")
    if laws.parametric is not None and bests:
        flops = np.geomspace(min(b["flops"] for b in bests) / 2, max(b["flops"] for b in bests) * 30, 40)
        frontier = [fit.compute_optimal(laws.parametric, c, laws.flops_per_token)[2] for c in flops]
        ax.plot(flops, frontier, "k--", lw=1, label="fitted compute-optimal frontier")
    check = result.get("check")
    if check:
        lo, hi = check["interval"]
        c = check["tokens"] * next(r["flops_per_token"] for r in rows if r["phase"] == "check")
        predicted = check["predicted_loss"]
        ax.errorbar([c], [predicted], yerr=[[predicted - lo], [hi - predicted]],
                    fmt="s", color="tab:red", capsize=4, label="held-out: predicted")
        if check.get("measured_loss") is not None:
            ax.scatter([c], [check["measured_loss"]], marker="*", s=120, color="tab:red", label="held-out: measured")
    ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs, the model's real FLOPs per token)",
           ylabel="final validation loss", title="Loss against compute")
    ax.legend(fontsize=7)
    return _save(plt, fig, directory, "loss_vs_compute.png")


def _lr_curves(plt, directory: str, rows: list[dict]) -> str:
    ladder = [r for r in rows if r["phase"] in ("ladder", LR_SEARCH)]  # µP's learning rates are the search's
    sizes = sorted({r["size"] for r in ladder})
    fig, axes = plt.subplots(1, len(sizes), figsize=(3.2 * len(sizes), 3.4), squeeze=False, sharey=True)
    for ax, size in zip(axes[0], sizes):
        by_rung: dict[str, list[dict]] = defaultdict(list)
        for r in ladder:
            if r["size"] == size:
                by_rung[r["budget"]].append(r)
        for (budget, trials), color in zip(sorted(by_rung.items()), _colors(plt, len(by_rung))):
            done = sorted((r for r in trials if r["status"] == COMPLETED), key=lambda r: r["lr"])
            ax.plot([r["lr"] for r in done], [r["val_loss"] for r in done], "o-", ms=3, color=color, label=budget)
            stopped = [r for r in trials if r["status"] == STOPPED and np.isfinite(r["val_loss"])]
            ax.scatter([r["lr"] for r in stopped], [r["val_loss"] for r in stopped], marker="x", color=color)
        ax.set(xscale="log", xlabel="learning rate", title=f"N={trials[0]['params']:,}")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("val loss (x: stopped early, at stop)")
    return _save(plt, fig, directory, "lr_curves.png")


def _residuals(plt, directory: str, residuals: list[dict]) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
    rel = [100 * r["relative"] for r in residuals]
    for ax, key, label in ((axes[0], "params", "parameters N"), (axes[1], "tokens", "tokens D")):
        ax.scatter([r[key] for r in residuals], rel, s=18)
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xscale="log", xlabel=label)
    axes[0].set_ylabel("(measured - fitted) / fitted, %")
    fig.suptitle("Parametric fit residuals")
    return _save(plt, fig, directory, "residuals.png")
