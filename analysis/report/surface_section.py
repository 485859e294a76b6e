"""The report's verification-cost surface: tables and the plot (``analysis.decide.surface``).

``surface_figure``: per line (strategy x output class x sampling) one row of panels, one
panel per k: speedup vs autoregressive coloured over forced acceptance length A (x) and
users (y, log scale), the 1.0 contour drawn (the break-even curve, linear interpolation in
A per users level, black), every real deployment of that k marked at its measured
acceptance length (where each drafter stands), and each (strategy, category) acceptance
length marked as a tick on the top edge (which traffic classes pay).
"""

from __future__ import annotations

import io
import math

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis.decide import surface as sf
from analysis.data.metrics import SPEEDUP
from configs import metric_names as mn

DPI = 80
TITLE = ("Verification-cost surface: speedup vs autoregressive over forced acceptance length "
         "and users, one panel per k (black: speedup 1.0, the break-even; markers: real "
         "deployments at their measured acceptance length; top ticks: acceptance per category)")


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def _surface_contour(ax, g: pd.DataFrame, norm):
    """One panel's speedup over acceptance length A (x) and users (y, log2): filled contours
    with the speedup-1.0 line where the grid has 2 x 2 points, the measured points annotated.
    Returns (the colour mappable, A values, users values)."""
    grid = g.pivot_table(index=mn.REQ_USERS, columns=sf.A, values=SPEEDUP, aggfunc="mean")
    a, u = grid.columns.to_numpy(dtype=float), grid.index.to_numpy(dtype=float)
    if a.size >= 2 and u.size >= 2:
        z = np.ma.masked_invalid(grid.to_numpy(dtype=float))
        ax.contourf(a, u, z, levels=12, cmap="RdBu", norm=norm)
        try:
            ax.contour(a, u, z, levels=[1.0], colors="black", linewidths=2)
        except ValueError:
            pass
    mappable = ax.scatter(g[sf.A], g[mn.REQ_USERS], c=g[SPEEDUP], cmap="RdBu", norm=norm,
                          edgecolors="black", s=30, zorder=3)
    for _, r in g.iterrows():
        if not math.isnan(r[SPEEDUP]):
            ax.annotate(f"{r[SPEEDUP]:.2f}", (r[sf.A], r[mn.REQ_USERS]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    return mappable, a, u


def _surface_marks(ax, line: tuple, k: int, be: pd.DataFrame, pts: pd.DataFrame,
                   cats: pd.DataFrame) -> None:
    """One panel's marks: the break-even line (dashed), A = k + 1 (dotted), the real
    deployments at their measured acceptance length (stars) and per prompt category (top ticks)."""
    from analysis.report.plots import strategy_color

    b = be[(be["k"] == k) & be["base_strategy"].eq(line[0])
           & be[mn.REQ_OUTPUT_CLASS].eq(line[1]) & be[mn.REQ_SAMPLING].eq(line[2])]
    b = b[b["break_even_acceptance_length"].notna()].sort_values(mn.REQ_USERS)
    if not b.empty:
        ax.plot(b["break_even_acceptance_length"], b[mn.REQ_USERS], "k--", lw=1.2,
                marker="x", label="break-even (speedup 1.0)")
    ax.axvline(k + 1, color="gray", lw=0.8, ls=":")
    p = pts[(pd.to_numeric(pts["k"], errors="coerce") == k)
            & pts[mn.REQ_OUTPUT_CLASS].eq(line[1])] if not pts.empty else pts
    for name, pg in (p.groupby("strategy") if not p.empty else []):
        ax.plot(pg[mn.ACCEPTANCE_LENGTH], pg[mn.REQ_USERS], marker="*", ms=12, ls="none",
                color=strategy_color(name), markeredgecolor="black", label=f"{name} (measured)")
    c = cats[pd.to_numeric(cats["k"], errors="coerce") == k] if not cats.empty else cats
    for _, r in (c.iterrows() if not c.empty else []):
        ax.axvline(r[mn.ACCEPTANCE_LENGTH], ymin=0.92, ymax=1.0,
                   color=strategy_color(r["strategy"]), lw=2)
        ax.annotate(f"{r['strategy']}/{r[mn.REQ_CATEGORY]}",
                    (r[mn.ACCEPTANCE_LENGTH], 1.0), xycoords=("data", "axes fraction"),
                    fontsize=6, rotation=90, va="top", ha="right")


def surface_figure(t: dict) -> bytes | None:
    """The surface plot (module docstring) from ``analysis.decide.surface.analyse_surface``'s
    dict: one panel per (base strategy, output class, sampling) line x k; None without a
    surface."""
    from matplotlib.colors import TwoSlopeNorm

    surf, be = t["surface"], t["break_even"]
    if surf.empty:
        return None
    lines = list(surf.groupby(sf.LINE, dropna=False).groups)
    ks = sorted(int(k) for k in surf["k"].unique())
    fig = Figure(figsize=(4.4 * len(ks), 3.6 * len(lines)), layout="constrained")
    axes = fig.subplots(len(lines), len(ks), squeeze=False)
    lo = float(np.nanmin(surf[SPEEDUP])) if surf[SPEEDUP].notna().any() else 0.5
    hi = float(np.nanmax(surf[SPEEDUP])) if surf[SPEEDUP].notna().any() else 1.5
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01))
    pts, cats = t.get("drafters", pd.DataFrame()), t.get("categories", pd.DataFrame())
    mappable = None
    for i, line in enumerate(lines):
        sel_line = surf.set_index(sf.LINE).loc[[line]].reset_index() if len(sf.LINE) else surf
        for j, k in enumerate(ks):
            ax = axes[i][j]
            g = sel_line[sel_line["k"].eq(k)]
            ax.set(title=f"{line[0]} k={k} ({line[1]}, {line[2]})", xlabel="acceptance length A",
                   ylabel="users")
            ax.set_yscale("log", base=2)
            if g.empty:
                continue
            mappable, a, u = _surface_contour(ax, g, norm)
            _surface_marks(ax, line, k, be, pts, cats)
            ax.set_ylim(float(u.min()) / 1.4, float(u.max()) * 1.4)   # edge markers visible
            ax.set_xlim(float(a.min()) - 0.15, max(float(a.max()), k + 1.0) + 0.15)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="lower right")
    if mappable is not None:
        fig.colorbar(mappable, ax=axes, label="speedup vs autoregressive (x)", shrink=0.8)
    return _png(fig)


def surface_section(results) -> dict:
    """{"tables": [(title, explanation, rows)], "figures": {"surface": png}, "flags": [str]};
    empty when the run has no forced-acceptance deployments and no categories."""
    from analysis.report.render import records

    t = sf.analyse_surface(results)
    tables, figures = [], {}
    if not t["surface"].empty:
        over = ", ".join(sorted(t["surface"]["interval_over"].unique()))
        tables.append(("Verification-cost surface (synthetic acceptance)",
                       "SYNTHETIC deployments (python -m loadgen --acceptance-length): the accept "
                       "decision is forced, drafter and verify real; their text is not the "
                       "target's, so they are never recommended and never consistency-checked. "
                       f"Speedup = tokens/s / autoregressive's in the same cell, with a "
                       f"{sf.DEFAULT_CONFIDENCE:.0%} interval over {over}.",
                       records(t["surface"])))
        tables.append(("Break-even acceptance length",
                       "Per users level and k: the acceptance length A* where the speedup "
                       "crosses 1.0 (linear interpolation between the measured A around it); "
                       "break_even_lo / _hi: the same from the interval's upper / lower ends.",
                       records(t["break_even"])))
        tables.append(("Best k per users and acceptance length", "The k with the highest "
                       "speedup among the k measured at that A.", records(t["best_k"])))
        figures["surface"] = surface_figure(t)
    if not t["stand"].empty and t["stand"]["break_even_acceptance_length"].notna().any():
        tables.append(("Where each drafter stands", "Real deployments: measured acceptance "
                       "length minus the break-even of its k at its users level (gap > 0: it "
                       "pays).", records(t["stand"])))
    if not t["categories"].empty:
        tables.append(("Acceptance length per category",
                       "Per real deployment x sampling x prompt category (prompts JSONL "
                       "`category`; built-in sets: humaneval / stdlib = code, docs = prose): "
                       "1 + accepted / drafts pooled over requests, "
                       f"{sf.DEFAULT_CONFIDENCE:.0%} bootstrap interval over requests.",
                       records(t["categories"])))
    return {"tables": tables, "figures": {k: v for k, v in figures.items() if v}, "data": t}
