"""Report figures, rendered with matplotlib's Agg canvas to PNG bytes.

``matplotlib.figure.Figure`` is used directly (no ``pyplot``), so no global
figure state is created and no display backend is touched. Every function
returns PNG bytes, or None when the data for that plot is absent.
"""

from __future__ import annotations

import io

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis.model.capacity import BATCH_TOKENS, step_table
from analysis.data.dimensions import primary_sampling
from analysis.data.metrics import OUTPUT_TOKENS_PER_S, SPEEDUP
from configs import metric_names as mn

DPI = 80
# One colour per strategy in every figure (matplotlib's tab10, in the canonical strategy order);
# other names (third-party models) get the remaining colours by a stable hash of the name.
STRATEGY_COLORS = dict(zip(mn.STRATEGIES, ("tab:gray", "tab:blue", "tab:orange", "tab:green",
                                           "tab:red", "tab:purple")))
_SPARE_COLORS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def strategy_color(strategy: str) -> str:
    """The colour of ``strategy`` in every figure of the report."""
    if strategy in STRATEGY_COLORS:
        return STRATEGY_COLORS[strategy]
    parsed = mn.parse_variant_name(strategy)   # a variant (dflash2-k4) has its strategy's colour
    if parsed:
        return STRATEGY_COLORS[parsed[0]]
    return _SPARE_COLORS[sum(map(ord, str(strategy))) % len(_SPARE_COLORS)]


def figure_png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def figure_axes(n: int, width: float = 5.0, height: float = 3.6):
    # constrained layout keeps tick labels, titles and legends from overlapping
    fig = Figure(figsize=(width * max(n, 1), height), layout="constrained")
    axes = fig.subplots(1, max(n, 1), squeeze=False)[0]
    return fig, axes


def speedup_vs_users(cells: pd.DataFrame, crossover: pd.DataFrame) -> bytes | None:
    """Speedup (strategy / autoregressive tokens/s) against requested users, per output class."""
    cells = primary_sampling(cells)   # one sampling setting's curves (greedy first)
    spec = cells[~cells[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE) & cells[SPEEDUP].notna()]
    if spec.empty:
        return None
    classes = sorted(spec[mn.REQ_OUTPUT_CLASS].unique())
    fig, axes = figure_axes(len(classes))
    for ax, oc in zip(axes, classes):
        for strategy, g in spec[spec[mn.REQ_OUTPUT_CLASS].eq(oc)].groupby(mn.REQ_STRATEGY):
            curve = g.groupby(mn.REQ_USERS)[SPEEDUP].mean().sort_index()
            line, = ax.plot(curve.index, curve.values, marker="o", label=strategy,
                            color=strategy_color(strategy))
            x = crossover[(crossover[mn.REQ_STRATEGY] == strategy)
                          & (crossover[mn.REQ_OUTPUT_CLASS] == oc)]["crossover_users"]
            if len(x) and pd.notna(x.iloc[0]):
                ax.axvline(x.iloc[0], color=line.get_color(), ls=":", lw=1)
        ax.axhline(1.0, color="black", lw=1)
        ax.set_xscale("log", base=2)
        ax.set(title=f"speedup vs concurrency ({oc} outputs)", xlabel="users (requested concurrency)",
               ylabel="speedup vs autoregressive (x)")
        ax.legend(fontsize=8)
    return figure_png(fig)


def throughput_latency(cells: pd.DataFrame, knees: pd.DataFrame) -> bytes | None:
    """Output tokens/s against p50 end-to-end latency, one point per users level; knee starred."""
    if cells.empty:
        return None
    cells = primary_sampling(cells)
    classes = sorted(cells[mn.REQ_OUTPUT_CLASS].unique())
    fig, axes = figure_axes(len(classes))
    for ax, oc in zip(axes, classes):
        for strategy, g in cells[cells[mn.REQ_OUTPUT_CLASS].eq(oc)].groupby(mn.REQ_STRATEGY):
            curve = g.groupby(mn.REQ_USERS)[[OUTPUT_TOKENS_PER_S, "e2e_ms_p50"]].mean().sort_index()
            line, = ax.plot(curve[OUTPUT_TOKENS_PER_S], curve["e2e_ms_p50"], marker="o", label=strategy,
                            color=strategy_color(strategy))
            k = knees[(knees[mn.REQ_STRATEGY] == strategy) & (knees[mn.REQ_OUTPUT_CLASS] == oc)]
            if len(k):
                ax.plot(k["knee_tokens_per_s"], k["knee_e2e_ms_p50"], marker="*", ms=14,
                        color=line.get_color())
        ax.set(title=f"throughput vs latency ({oc}); * = knee", xlabel="output tokens/s",
               ylabel="e2e latency p50 (ms)")
        ax.legend(fontsize=8)
    return figure_png(fig)


def latency_ecdf(flagged: pd.DataFrame) -> bytes | None:
    """The distribution of per-request TTFT and TPOT per strategy (empirical CDFs over the ok
    requests of the primary sampling setting, every cell pooled), one row per output class:
    a bimodal TPOT shows as two steps, which one percentile hides (docs/metrics.md)."""
    import numpy as np

    ok = primary_sampling(flagged) if mn.REQ_SAMPLING in flagged else flagged
    ok = ok[ok[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    if ok.empty or ok[mn.REQ_TPOT_MS].notna().sum() == 0:
        return None
    classes = sorted(ok[mn.REQ_OUTPUT_CLASS].unique())
    fig = Figure(figsize=(10.0, 3.4 * len(classes)), layout="constrained")
    axes = fig.subplots(len(classes), 2, squeeze=False)
    for row, oc in zip(axes, classes):
        sub = ok[ok[mn.REQ_OUTPUT_CLASS].eq(oc)]
        for ax, col, label in ((row[0], mn.REQ_TTFT_MS, "TTFT (ms)"), (row[1], mn.REQ_TPOT_MS, "TPOT (ms)")):
            for strategy, g in sub.groupby(mn.REQ_STRATEGY):
                v = np.sort(g[col].dropna().to_numpy(dtype=float))
                if v.size:
                    ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=strategy,
                            color=strategy_color(strategy))
            ax.set(title=f"{label.split()[0]} distribution ({oc} outputs)", xlabel=label,
                   ylabel="share of requests <= x")
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    return figure_png(fig)


def goodput_bars(rec_rows: list[dict], rec: dict) -> bytes | None:
    """Goodput (tokens/s meeting the SLOs) per strategy for every tier x output class."""
    if not rec_rows:
        return None
    fig, axes = figure_axes(len(rec_rows), width=3.6)
    for ax, row in zip(axes, rec_rows):
        r = rec[row["tier"]][row["output_class"]]
        if row.get("sampling") and r.get("sampling") not in (None, row["sampling"]):
            r = r["by_sampling"][row["sampling"]]
        by = r["goodput_by_strategy"]
        names = list(by)
        ax.bar(range(len(names)), [by[n] for n in names],
               color=[strategy_color(n) for n in names],
               edgecolor=["black" if n == row["strategy"] else "none" for n in names],
               linewidth=2, hatch=None)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        samp = f" / {row['sampling']}" if row.get("sampling") not in (None, mn.GREEDY) else ""
        ax.set(title=f"{row['tier']} / {row['output_class']}{samp}", ylabel="goodput (tokens/s)")
    return figure_png(fig)


def acceptance_hist(flagged: pd.DataFrame) -> bytes | None:
    """Distribution of per-request acceptance length tau (tokens per verification step)."""
    taus = flagged[flagged[mn.REQ_STATUS].eq("ok") & flagged[mn.NUM_DRAFTS].gt(0)]
    if taus.empty:
        return None
    fig, axes = figure_axes(1, width=6.0)
    ax = axes[0]
    for strategy, g in taus.groupby(mn.REQ_STRATEGY):
        ax.hist(g[mn.ACCEPTANCE_LENGTH].dropna(), bins=20, alpha=0.5, label=strategy,
                color=strategy_color(strategy))
    ax.set(title="acceptance length per request", xlabel="tau = 1 + accepted / drafts",
           ylabel="requests")
    ax.legend(fontsize=8)
    return figure_png(fig)


def per_position_plot(pos: pd.DataFrame) -> bytes | None:
    """Per-position acceptance, unconditional (vLLM) and conditional (DFlash 2 / DSpark)."""
    pos = pos[pos["accepted"].notna()]
    if pos.empty:
        return None
    fig, axes = figure_axes(2)
    for strategy, g in pos.groupby(mn.REQ_STRATEGY):
        axes[0].plot(g["position"], g["uncond"], marker="o", label=strategy, color=strategy_color(strategy))
        axes[1].plot(g["position"], g["cond"], marker="o", label=strategy, color=strategy_color(strategy))
    axes[0].set(title="UNCONDITIONAL: accepted at i / drafts", xlabel="draft position i",
                ylabel="acceptance rate", ylim=(0, 1.05))
    axes[1].set(title="CONDITIONAL: accepted at i / accepted at i-1", xlabel="draft position i",
                ylabel="acceptance rate", ylim=(0, 1.05))
    for ax in axes:
        ax.legend(fontsize=8)
    return figure_png(fig)


def verification_vs_batch(steps: pd.DataFrame) -> bytes | None:
    """Mean verification tokens per step against batch size, per strategy."""
    df = step_table(steps)
    if df.empty:
        return None
    fig, axes = figure_axes(1, width=6.0)
    ax = axes[0]
    for strategy, g in df.groupby(mn.STEP_STRATEGY):
        curve = g.groupby(mn.STEP_BATCH_SIZE)[mn.STEP_VERIFICATION_TOKENS].mean()
        ax.plot(curve.index, curve.values, marker=".", label=strategy, color=strategy_color(strategy))
    ax.set(title="verification tokens per step vs batch size", xlabel="batch size (requests)",
           ylabel="verification tokens / step")
    ax.legend(fontsize=8)
    return figure_png(fig)


def step_cost(steps: pd.DataFrame) -> bytes | None:
    """Step time against batch tokens (scatter, per strategy). The fitted step cost model
    is judged on its residuals (``analysis.report.capacity_plots.residual_plot``)."""
    df = step_table(steps, decode_only=False)
    if df.empty:
        return None
    fig, axes = figure_axes(1, width=6.0)
    ax = axes[0]
    for strategy, g in df.groupby(mn.STEP_STRATEGY):
        g = g.sample(min(len(g), 2000), random_state=0)
        ax.scatter(g[BATCH_TOKENS], g[mn.STEP_MS], s=6, alpha=0.4, label=strategy,
                   color=strategy_color(strategy))
    ax.set(title="step time vs batch tokens (verification + prefill)", xlabel="batch tokens",
           ylabel="step time (ms)")
    ax.legend(fontsize=8)
    return figure_png(fig)


def outage_timeline(timeline: pd.DataFrame | None, outages: pd.DataFrame | None) -> bytes | None:
    """Output tokens/s and error rate over the run, one panel per strategy; outage windows shaded.

    Drawn only when some request failed or was rejected (a clean run needs no time line).
    """
    if timeline is None or timeline.empty or outages is None or outages.empty:
        return None
    t0 = timeline.attrs.get("t0", 0.0)
    strategies = sorted(timeline[mn.REQ_STRATEGY].unique())
    fig = Figure(figsize=(6.0, 2.6 * len(strategies)))
    axes = fig.subplots(len(strategies), 1, squeeze=False, sharex=True)[:, 0]
    for ax, strategy in zip(axes, strategies):
        g = timeline[timeline[mn.REQ_STRATEGY].eq(strategy)]
        ax.plot(g["t_s"], g["output_tokens_per_s"], color="tab:blue", drawstyle="steps-post",
                label="output tokens/s (ok)")
        ax.set_ylabel("tokens/s", color="tab:blue")
        err = ax.twinx()
        err.plot(g["t_s"], g["error_rate"], color="tab:red", drawstyle="steps-post", label="error rate")
        if g["n_rejected"].any():
            rej = g["n_rejected"] / g["n_ended"].where(g["n_ended"] > 0)
            err.plot(g["t_s"], rej.fillna(0), color="tab:orange", ls="--", drawstyle="steps-post",
                     label="rejected (429) share")
        err.set_ylim(-0.02, 1.05)
        err.set_ylabel("share of requests ended", color="tab:red")
        o = outages[outages[mn.REQ_STRATEGY].eq(strategy) & outages["outage_s"].notna()]
        for _, r in o.iterrows():
            ax.axvspan(r["outage_start_ts"] - t0, r["outage_end_ts"] - t0, color="tab:red", alpha=0.15)
            ax.text(r["outage_start_ts"] - t0, 0, f" outage {r['outage_s']:.1f} s", fontsize=8,
                    va="bottom", color="tab:red")
        ax.set_title(f"{strategy}: throughput and errors over time (1 s bins, by request end)", fontsize=9)
        lines = ax.get_legend_handles_labels()
        lines2 = err.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper right")
    axes[-1].set_xlabel("seconds since the run's first request")
    return figure_png(fig)


def server_timeline(ts: pd.DataFrame) -> bytes | None:
    """Running batch and queue (sampled gauges) over the run, one line per served model."""
    if ts.empty:
        return None
    gauges = ts[ts["metric"].isin([mn.SRV_RUNNING, mn.SRV_WAITING])]
    if gauges.empty:
        return None
    t0 = float(ts["ts"].min())
    fig, axes = figure_axes(2)
    for ax, metric, title in ((axes[0], mn.SRV_RUNNING, "running requests (server gauge)"),
                              (axes[1], mn.SRV_WAITING, "waiting requests (server gauge)")):
        for model, g in gauges[gauges["metric"].eq(metric)].groupby("model"):
            g = g.sort_values("ts")
            ax.plot(g["ts"] - t0, g["value"], drawstyle="steps-post", label=str(model),
                    color=strategy_color(str(model)))
        ax.set(title=title, xlabel="seconds since the first scrape", ylabel="requests")
        if ax.lines:
            ax.legend(fontsize=8)
    cells = ts.dropna(subset=[mn.REQ_TIER]).groupby([mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS,
                                                     mn.REQ_USERS])["ts"].agg(["min", "max"])
    for (_, row) in cells.iterrows():
        for ax in axes:
            ax.axvspan(row["min"] - t0, row["max"] - t0, color="#888", alpha=0.08)
    return figure_png(fig)
