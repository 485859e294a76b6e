"""Report sections for the dimensions besides tier and output class
(``analysis.data.dimensions``): speedup and acceptance length tau against the draft length
k (and dflash2's candidate count) per tier, the diminishing-returns curve of
``python -m loadgen --k 2,4,7``, and acceptance / speedup against the sampling
temperature per strategy (``samplings`` in the tier file, ``--temperature``).

Numbers are the per-cell table's (``analysis.data.metrics.cell_table``): speedup =
tokens/s over autoregressive's in the same run, tier, output class, sampling label and
users; tau = 1 + accepted / drafts pooled over the cell's ok requests. Cells of one
(tier, output class, sampling, deployment) measured in several runs or repeats are
averaged (mean); ``n_cells`` says how many.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.data.dimensions import BASE_STRATEGY, CANDIDATES, K, sampling_labels
from analysis.data.metrics import GOODPUT_TOKENS_PER_S, OUTPUT_TOKENS_PER_S, SPEEDUP
from configs import metric_names as mn
from configs.tiers import OUTPUT_CLASSES, TIER_NAMES

TAU = mn.ACCEPTANCE_LENGTH
_METRICS = [SPEEDUP, TAU, OUTPUT_TOKENS_PER_S, GOODPUT_TOKENS_PER_S]


def _tier_key(t: str) -> tuple:
    return (TIER_NAMES.index(t) if t in TIER_NAMES else len(TIER_NAMES), t)


def _oc_key(o: str) -> tuple:
    return (OUTPUT_CLASSES.index(o) if o in OUTPUT_CLASSES else len(OUTPUT_CLASSES), o)


def k_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Speedup, tau, tokens/s and goodput per tier x output class x sampling x base strategy x
    candidates x k, for every base strategy measured at more than one k (or candidate count).

    ``gain_vs_prev_k`` = speedup at this k - speedup at the next smaller k of the same line
    (the marginal return of drafting more; NaN at the smallest k); ``best_k`` marks the k
    with the highest speedup of its line. Empty when no strategy was varied."""
    cols = [mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING, BASE_STRATEGY, CANDIDATES, K,
            mn.REQ_STRATEGY, "n_cells", *_METRICS, "gain_vs_prev_k", "best_k"]
    need = {BASE_STRATEGY, K, mn.REQ_SAMPLING}
    if cells.empty or not need <= set(cells.columns):
        return pd.DataFrame(columns=cols)
    from analysis.data.dimensions import real_only

    cells = real_only(cells)   # forced acceptance (--acceptance-length): the surface's own section
    spec = cells[~cells[BASE_STRATEGY].eq(mn.AUTOREGRESSIVE) & cells[K].notna()].copy()
    spec[CANDIDATES] = spec[CANDIDATES] if CANDIDATES in spec else np.nan
    varied = spec.groupby(BASE_STRATEGY)[[K, CANDIDATES]].nunique(dropna=True)
    varied = varied[(varied[K] > 1) | (varied[CANDIDATES] > 1)].index
    spec = spec[spec[BASE_STRATEGY].isin(varied)]
    if spec.empty:
        return pd.DataFrame(columns=cols)
    keys = [mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING, BASE_STRATEGY, CANDIDATES, K]
    agg = (spec.groupby(keys, dropna=False)
           .agg(strategy=(mn.REQ_STRATEGY, "first"), n_cells=(mn.REQ_STRATEGY, "size"),
                **{m: (m, "mean") for m in _METRICS})
           .reset_index())
    line = keys[:-1]
    agg = agg.sort_values(line + [K], key=lambda s: s.map(_tier_key) if s.name == mn.REQ_TIER
                          else s.map(_oc_key) if s.name == mn.REQ_OUTPUT_CLASS else s)
    agg["gain_vs_prev_k"] = agg.groupby(line, dropna=False)[SPEEDUP].diff()
    best = agg.groupby(line, dropna=False)[SPEEDUP].transform("max")
    agg["best_k"] = agg[SPEEDUP].eq(best) & agg[SPEEDUP].notna()
    agg[K] = agg[K].astype(int)
    agg[CANDIDATES] = pd.Series([None if pd.isna(v) else int(v) for v in agg[CANDIDATES]],
                                index=agg.index, dtype=object)
    return agg[cols].reset_index(drop=True)


def temperature_table(cells: pd.DataFrame) -> pd.DataFrame:
    """tau, speedup and tokens/s per strategy x tier x output class x sampling label (with
    its temperature), for runs with more than one sampling label; ``tau_vs_first`` = tau /
    the same strategy's tau at the first label (greedy first). Empty otherwise."""
    cols = [mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING, mn.REQ_TEMPERATURE,
            "n_cells", *_METRICS, "tau_vs_first"]
    if cells.empty or mn.REQ_SAMPLING not in cells or cells[mn.REQ_SAMPLING].nunique() < 2:
        return pd.DataFrame(columns=cols)
    labels = sampling_labels(cells)
    df = cells.copy()
    if mn.REQ_TEMPERATURE not in df:
        df[mn.REQ_TEMPERATURE] = np.nan
    keys = [mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING]
    agg = (df.groupby(keys, dropna=False)
           .agg(temperature=(mn.REQ_TEMPERATURE, "first"), n_cells=(mn.REQ_STRATEGY, "size"),
                **{m: (m, "mean") for m in _METRICS})
           .reset_index())
    agg["_o"] = agg[mn.REQ_SAMPLING].map({s: i for i, s in enumerate(labels)})
    strat_order = {s: i for i, s in enumerate(mn.STRATEGIES)}
    agg = agg.sort_values([mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, "_o"],
                          key=lambda s: s.map(lambda v: (strat_order.get(str(v).split("-")[0], 99), v))
                          if s.name == mn.REQ_STRATEGY else s.map(_tier_key) if s.name == mn.REQ_TIER
                          else s.map(_oc_key) if s.name == mn.REQ_OUTPUT_CLASS else s)
    first = agg.groupby(keys[:-1])[TAU].transform("first")
    agg["tau_vs_first"] = agg[TAU] / first
    return agg[cols].reset_index(drop=True)


def _png(fig) -> bytes:
    from analysis.report.plots import figure_png as png

    return png(fig)


def k_curve_figure(table: pd.DataFrame) -> bytes | None:
    """Speedup (top row) and tau (bottom row) against k, one column per tier x output class
    (x sampling when several), one line per base strategy (x candidate count)."""
    if table.empty:
        return None
    from matplotlib.figure import Figure

    from analysis.report.plots import strategy_color

    panels = list(dict.fromkeys(zip(table[mn.REQ_TIER], table[mn.REQ_OUTPUT_CLASS],
                                    table[mn.REQ_SAMPLING])))
    several = table[mn.REQ_SAMPLING].nunique() > 1
    fig = Figure(figsize=(4.2 * len(panels), 6.4), layout="constrained")
    axes = fig.subplots(2, len(panels), squeeze=False)
    styles = ("-", "--", ":", "-.")
    for j, (tier, oc, samp) in enumerate(panels):
        sel = table[table[mn.REQ_TIER].eq(tier) & table[mn.REQ_OUTPUT_CLASS].eq(oc)
                    & table[mn.REQ_SAMPLING].eq(samp)]
        for (base, cands), g in sel.groupby([BASE_STRATEGY, CANDIDATES], dropna=False, sort=True):
            cands_all = sorted(table.loc[table[BASE_STRATEGY].eq(base), CANDIDATES].dropna().unique())
            ls = styles[cands_all.index(cands) % len(styles)] if pd.notna(cands) else "-"
            label = base + (f" c{int(cands)}" if pd.notna(cands) else "")
            g = g.sort_values(K)
            for i, metric in enumerate((SPEEDUP, TAU)):
                axes[i][j].plot(g[K], g[metric], marker="o", ls=ls, label=label,
                                color=strategy_color(base))
        title = f"{tier} / {oc}" + (f" / {samp}" if several else "")
        axes[0][j].axhline(1.0, color="black", lw=1)
        axes[0][j].set(title=title, xlabel="k (num_speculative_tokens)",
                       ylabel="speedup vs autoregressive (x)")
        axes[1][j].set(xlabel="k (num_speculative_tokens)", ylabel="tau (tokens per step)")
        ks = sorted(table[K].unique())
        for i in range(2):
            axes[i][j].set_xticks(ks)
            axes[i][j].legend(fontsize=8)
    return _png(fig)


def temperature_figure(table: pd.DataFrame) -> bytes | None:
    """tau (top row) and speedup (bottom row) against temperature, one column per tier x
    output class, one line per speculative strategy (deployment)."""
    spec = table[~table[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE) & table[mn.REQ_TEMPERATURE].notna()]
    if spec.empty:
        return None
    from matplotlib.figure import Figure

    from analysis.report.plots import strategy_color

    panels = list(dict.fromkeys(zip(spec[mn.REQ_TIER], spec[mn.REQ_OUTPUT_CLASS])))
    fig = Figure(figsize=(4.8 * len(panels), 6.8), layout="constrained")
    axes = fig.subplots(2, len(panels), squeeze=False)
    # variants of one strategy share its colour; line style and marker tell them apart
    names = sorted(spec[mn.REQ_STRATEGY].unique())
    rank = {n: [m for m in names if strategy_color(m) == strategy_color(n)].index(n) for n in names}
    styles, markers = ("-", "--", ":", "-."), ("o", "s", "^", "D", "v", "P")
    for j, (tier, oc) in enumerate(panels):
        sel = spec[spec[mn.REQ_TIER].eq(tier) & spec[mn.REQ_OUTPUT_CLASS].eq(oc)]
        for strategy, g in sel.groupby(mn.REQ_STRATEGY, sort=True):
            g = g.sort_values(mn.REQ_TEMPERATURE)
            r = rank[strategy]
            for i, metric in enumerate((TAU, SPEEDUP)):
                axes[i][j].plot(g[mn.REQ_TEMPERATURE], g[metric], label=strategy,
                                color=strategy_color(strategy), ls=styles[r % len(styles)],
                                marker=markers[r % len(markers)])
        axes[0][j].set(title=f"{tier} / {oc}", xlabel="temperature",
                       ylabel="tau (tokens per step)")
        axes[1][j].axhline(1.0, color="black", lw=1)
        axes[1][j].set(xlabel="temperature", ylabel="speedup vs autoregressive (x)")
        for i in range(2):
            axes[i][j].legend(fontsize=8)
    return _png(fig)


def dimensions_section(cells: pd.DataFrame) -> dict:
    """{"tables": [(title, explanation, rows)], "figures": {name: png}, "k": DataFrame,
    "temperature": DataFrame} for the report; empty lists / dicts when nothing was varied."""
    from analysis.report.render import records

    kt, tt = k_table(cells), temperature_table(cells)
    tables, figures = [], {}
    if not kt.empty:
        tables.append(("Speedup and acceptance vs draft length k",
                       "Per tier x output class x sampling: each variant deployment "
                       "(python -m loadgen --k / --top-k-candidates) of a strategy; speedup = "
                       "tokens/s / autoregressive's in the same cell, tau = 1 + accepted / drafts; "
                       "gain_vs_prev_k = speedup minus the next smaller k's (the diminishing "
                       "return); best_k = the line's highest speedup. Mean over n_cells runs / "
                       "repeats / users levels.", records(kt)))
        figures["k_curve"] = k_curve_figure(kt)
    if not tt.empty:
        tables.append(("Acceptance and speedup vs temperature",
                       "Per strategy x tier x output class x sampling setting (tier file "
                       "`samplings` or --temperature; greedy = temperature 0): tau = tokens per "
                       "verification step, tau_vs_first = tau / the strategy's tau at the first "
                       "setting, speedup vs autoregressive at the same temperature.",
                       records(tt)))
        figures["temperature"] = temperature_figure(tt)
    return {"tables": tables, "figures": figures, "k": kt, "temperature": tt}
