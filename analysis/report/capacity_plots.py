"""Figures of the capacity model: step-fit residuals and the backtest's predicted
vs measured speedup (PNG bytes via matplotlib's Agg canvas, no pyplot)."""

from __future__ import annotations

import numpy as np

from analysis.model import backtest as bt_mod
from analysis.report.plots import figure_axes, figure_png, strategy_color
from configs import metric_names as mn


def residual_plot(step_models: dict) -> bytes | None:
    """Residual (measured - predicted step ms) against predicted step ms, one panel
    per strategy; decode-only steps blue, steps with prefill orange; r² in the title."""
    models = [m for m in step_models.values() if m.residuals.size]
    if not models:
        return None
    fig, axes = figure_axes(len(models), width=3.4, height=3.0)
    for ax, m in zip(axes, models):
        pre = m.is_prefill.astype(bool)
        ax.scatter(m.fitted[~pre], m.residuals[~pre], s=4, alpha=0.4, label="decode")
        if pre.any():
            ax.scatter(m.fitted[pre], m.residuals[pre], s=4, alpha=0.4, color="tab:orange",
                       label="with prefill")
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_title(f"{m.strategy}: r² {m.r2_step:.2f}", fontsize=9)
        ax.set_xlabel("predicted step ms")
    axes[0].set_ylabel("residual ms (measured - predicted)")
    axes[0].legend(fontsize=7)
    return figure_png(fig)


def backtest_speedup(bt: dict, output_class: str) -> bytes | None:
    """Measured speedup per users level (markers) and the model fitted on the levels
    below the holdout (lines), for one output class; the holdout level shaded."""
    cells = bt["cells"]
    spec = cells[cells[mn.REQ_OUTPUT_CLASS].eq(output_class)
                 & ~cells[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE) & cells["speedup"].notna()]
    if spec.empty:
        return None
    fig, axes = figure_axes(1, width=6.0, height=4.0)
    ax = axes[0]
    top = bt["holdout_users"]
    grid = np.geomspace(1.0, top * 2.0, 200)
    for i, (strategy, g) in enumerate(spec.groupby(mn.REQ_STRATEGY, sort=True)):
        color = strategy_color(strategy)
        meas = g.groupby(mn.REQ_USERS)["speedup"].mean()
        ax.plot(meas.index, meas.to_numpy(), "o", color=color, label=f"{strategy} measured")
        pred = bt_mod.predicted_speedup(bt["models"], strategy, output_class, grid)
        if pred is not None:
            ax.plot(grid, pred, "-", color=color, alpha=0.7, label=f"{strategy} predicted")
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.axvspan(top / 1.15, top * 1.15, color="grey", alpha=0.15, label=f"held out ({top})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("users (concurrency)")
    ax.set_ylabel("speedup vs autoregressive")
    ax.set_title(f"{output_class} outputs: fit on users < {top}, predict {top}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    return figure_png(fig)
