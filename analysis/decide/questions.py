"""The report's answers to three of the six questions a team asks of a speculative
strategy (speed, acceptance and latency are the other sections): output
consistency with plain decoding, memory cost, and stability across runs and
inputs. ``questions_section`` returns tables, figures and the warnings that go
at the top of the report (a diverging strategy is never silently ranked).
"""

from __future__ import annotations

import io
import math

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis.data import consistency as cons
from analysis.data import memory as mem
from analysis.data import stability as st
from analysis.data.load import Results
from configs import metric_names as mn

FIGURE_TITLES = {
    "throughput_over_time": "Throughput over time per cell (one line per repeat; dashed: warm-up cut)",
    "acceptance_by_source": "Per-request acceptance length by prompt source",
}
DPI = 80


def _clean(df: pd.DataFrame | None) -> list[dict]:
    if df is None or df.empty:
        return []
    return [{k: (None if isinstance(v, float) and math.isnan(v) else
                 (v.item() if hasattr(v, "item") else v)) for k, v in r.items()}
            for r in df.to_dict("records")]


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def throughput_panels(over_time: pd.DataFrame, warmup_s: float = 0.0,
                      max_panels: int = 48) -> bytes | None:
    """One small panel per cell (strategy x tier x output class x users): tokens/s over
    seconds since the cell's first send, one line per replicate."""
    if over_time.empty:
        return None
    cells = list(over_time.groupby(st.CELL, sort=True))[:max_panels]
    cols = min(6, len(cells))
    rows = math.ceil(len(cells) / cols)
    fig = Figure(figsize=(2.6 * cols, 2.0 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    for ax, (key, g) in zip(axes.flat, cells):
        for _, rep in g.groupby([mn.REQ_RUN_ID, st.REPEAT], sort=True):
            ax.plot(rep["t_s"] + rep["bin_s"] / 2, rep["tokens_per_s"], lw=1)
        if warmup_s:
            ax.axvline(warmup_s, color="grey", ls="--", lw=1)
        ax.set_title(f"{key[0]} {key[1]} {key[2]} u{key[3]}", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.supxlabel("seconds since the cell's first send", fontsize=8)
    fig.supylabel("output tokens/s", fontsize=8)
    return _png(fig)


def acceptance_boxes(flagged: pd.DataFrame) -> bytes | None:
    """Box plots of per-request tau per strategy, one box per prompt source."""
    df = flagged[flagged[mn.REQ_STATUS].eq(mn.STATUS_OK) & flagged[mn.NUM_DRAFTS].gt(0)].copy()
    if df.empty:
        return None
    df["source"] = st.prompt_source(df)
    df["tau"] = 1.0 + df[mn.NUM_ACCEPTED_TOKENS] / df[mn.NUM_DRAFTS]
    strategies = sorted(df[mn.REQ_STRATEGY].unique())
    fig = Figure(figsize=(4.0 * len(strategies), 3.2))
    axes = fig.subplots(1, len(strategies), squeeze=False)[0]
    for ax, s in zip(axes, strategies):
        g = df[df[mn.REQ_STRATEGY].eq(s)]
        sources = sorted(g["source"].unique())
        ax.boxplot([g.loc[g["source"].eq(src), "tau"].to_numpy() for src in sources])
        ax.set_xticks(range(1, len(sources) + 1), sources, fontsize=7)
        ax.set(title=s, ylabel="tau per request")
    return _png(fig)


def _memory_reports(results: Results) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for run in results.runs:
        out.update(run.manifest.get("memory") or {})
    return out


def _consistency(results: Results, out: dict) -> None:
    """Add the output-consistency table (and a top flag naming diverging strategies) to ``out``."""
    c = cons.load_consistency([r.path for r in results.runs])
    bad = cons.diverging(c)
    out["consistency"], out["diverging"] = c, bad
    if bad:
        out["flags"].append(
            f"OUTPUT CONSISTENCY: {', '.join(bad)} produced output that differs from "
            "autoregressive (see Output consistency); their speed and goodput are not "
            "comparable and any recommendation naming them is marked.")
    text = ("Greedy: the run's first N prompts sent to every strategy at temperature 0 with "
            "the cells' max_tokens, each output compared token by token (token ids, or text "
            "when the target returns none) with the baseline's; a lossless strategy is "
            "identical on every request, up to numerical ties. earliest_divergence = first "
            "differing token index. Each first divergence is classified from the baseline's "
            "own top-5 logprobs at that position (the prefix up to it is shared): a tie when "
            "the strategy's token lies within tie_tolerance nats of the baseline's best (both "
            "are correct greedy choices; tolerance by dtype: fp32 1e-3, fp16 0.05, bf16 0.25), "
            "a violation otherwise; only violations flag a strategy. "
            "Sampled (opt-in, --consistency-sampled N): chi-square test of the token "
            "distribution at output positions 0 and 1 over N seeded requests vs the baseline, "
            "Bonferroni over positions at alpha 0.01; max TV = total variation distance.")
    tols = sorted({e["tolerance"] for e in c.values() if e.get("tolerance") is not None})
    if tols:
        text += f" This run's tie tolerance: {', '.join(f'{t:g}' for t in tols)} nats."
    elif c:
        text += (" This run's divergences are NOT classified (the baseline returned no "
                 "token-id logprobs): every divergence counts against the strategy.")
    if not c:
        text += (" This run has no consistency.json (run without the check, or an older "
                 "load generator): output consistency was NOT measured.")
    out["tables"].append(("Output consistency", text, _clean(cons.consistency_table(c))))


def _memory(results: Results, out: dict) -> None:
    """Add the memory-per-strategy table (the replicas' reports, bytes shown as MiB) to ``out``."""
    reports = _memory_reports(results)
    mt = mem.memory_table(reports, results.requests) if reports else pd.DataFrame()
    if not mt.empty:
        for col in [c_ for c_ in mt.columns if c_.endswith("_bytes")]:
            mt[col.replace("_bytes", "_mib")] = pd.to_numeric(mt[col], errors="coerce") / 2 ** 20
            mt = mt.drop(columns=col)
    out["tables"].append((
        "Memory per strategy",
        "Reported by one replica of each strategy (GET /specload/memory) at the end of its "
        "cells, MiB: weights (target; drafter or draft model, tensors shared with the target "
        "counted once), KV cache allocated and peak used during the run (target cache; the "
        "draft model's own cache), process RSS (CPU) or torch.cuda.max_memory_allocated (GPU). "
        "kv_mib_per_seq_<class> = (target + draft KV bytes per token) x the mean context "
        "(prompt + output tokens) of that output class: what each concurrent sequence costs."
        + ("" if reports else " No replica reported memory (a non-specload target, or an "
           "older run)."), _clean(mt)))


def _stability(flagged: pd.DataFrame, out: dict, warmup_s: float, warmup_dropped: int) -> None:
    """Add the stability-across-repeats table and its flags (unstable cells, warm-up cut) to ``out``."""
    stab = st.stability_table(flagged)
    out["stability"] = stab
    max_reps = int(stab["replicates"].max()) if not stab.empty else 0
    unstable = stab[stab["flagged"]] if not stab.empty else stab
    if len(unstable):
        out["flags"].append(
            f"STABILITY: {len(unstable)} cell(s) vary by more than "
            f"{st.CV_THRESHOLD:.0%} (CV) across repeats: "
            + ", ".join(f"{r[mn.REQ_STRATEGY]}/{r[mn.REQ_TIER]}/{r[mn.REQ_OUTPUT_CLASS]}"
                        for _, r in unstable.head(8).iterrows())
            + (" ..." if len(unstable) > 8 else "") + " (see Stability across repeats).")
    if warmup_s:
        out["flags"].append(f"WARM-UP: the first {warmup_s:g} s of every cell (each repeat) are "
                            f"excluded from every figure and table ({warmup_dropped} requests "
                            "dropped; --warmup-s).")
    stab_text = ("Per cell, across replicates (the --repeats of a run, and runs loaded "
                 "together): mean and 95 % confidence half-width (Student t, n - 1 d.o.f.) "
                 "of output tokens/s, TPOT p50 (ms) and pooled acceptance length; CV = "
                 f"sample std / mean; flagged when a CV exceeds {st.CV_THRESHOLD:.0%}.")
    if max_reps < 2:
        stab_text += (" Only one replicate per cell here: no interval. Run "
                      "`python -m loadgen --repeats K` for K >= 2 (or load several runs).")
    out["tables"].append(("Stability across repeats", stab_text, _clean(stab)))


def _drift_and_sources(flagged: pd.DataFrame, out: dict, warmup_s: float) -> None:
    """Add the within-cell drift and acceptance-by-source tables and both figures (PNG) to ``out``."""
    over_time = st.throughput_over_time(flagged)
    drift = st.drift_table(over_time)
    out["tables"].append((
        "Throughput drift within a cell",
        "Output tokens/s of the first and second half of each replicate's time bins "
        "(bins: the replicate's wall time / 20): drift = (second - first) / first; a large "
        "positive drift is warm-up (exclude it with --warmup-s), a negative one slow-down."
        + (f" Warm-up cut: {warmup_s:g} s." if warmup_s else " No warm-up cut."),
        _clean(drift)))
    out["tables"].append((
        "Acceptance length by prompt source",
        "Per strategy x prompt source (the prompt id's dataset: humaneval, docs, stdlib): "
        "per-request acceptance length tau = 1 + accepted / drafts, its spread (std, CV) and "
        "percentiles: which inputs make a strategy unstable.",
        _clean(st.acceptance_by_dataset(flagged))))
    out["figures"] = {"throughput_over_time": throughput_panels(over_time, warmup_s),
                      "acceptance_by_source": acceptance_boxes(flagged)}


def _degraded(flagged: pd.DataFrame, out: dict) -> None:
    """Requests whose drafter failed and that went on autoregressively (specload's
    degrade-instead-of-fail, ``spec_decode.degraded_reason``): a table per strategy x
    reason, and a flag at the top, since their speed is not the strategy's."""
    if mn.DEGRADED_REASON not in flagged:
        return
    reason = flagged[mn.DEGRADED_REASON].fillna("").astype(str)
    deg = flagged[reason.ne("")]
    if deg.empty:
        return
    table = (deg.assign(reason=reason[reason.ne("")])
             .groupby([mn.REQ_STRATEGY, "reason"]).size().rename("requests").reset_index())
    total = flagged.groupby(mn.REQ_STRATEGY).size()
    table["share"] = table["requests"] / table[mn.REQ_STRATEGY].map(total)
    out["degraded"] = table
    names = ", ".join(f"{r[mn.REQ_STRATEGY]} {r['requests']} ({r['reason']})"
                      for _, r in table.iterrows())
    out["flags"].append(f"DEGRADED SPECULATION: requests whose drafter failed went on "
                        f"autoregressively (they succeeded): {names}; those strategies' speed "
                        "is partly autoregressive's (see Degraded speculation).")
    out["tables"].append(("Degraded speculation",
                          "Requests whose drafter raised, returned an invalid draft or missed "
                          "its deadline: the engine dropped speculation for the rest of that "
                          "request (it succeeded), counted by reason (share of the strategy's "
                          "requests).", _clean(table)))


def _step_log_loss(results: Results, out: dict) -> None:
    """A flag and a table naming every cell whose step log was lost or partial (the
    manifest's ``step_log_loss``, ``loadgen.results.step_loss``; a run older than it
    that recorded only ``step_log_errors`` is named by strategy and time)."""
    rows: list[dict] = []
    for run in results.runs:
        m = run.manifest
        for e in m.get("step_log_loss") or []:
            rows.append({"run_id": run.run_id, **{k: e.get(k) for k in (
                "strategy", "tier", "output_class", "users", "repeat", "sampling", "rows",
                "missing_rows")}, "reason": "; ".join(e.get("reasons") or [])})
        if "step_log_loss" not in m:
            for e in m.get("step_log_errors") or []:
                rows.append({"run_id": run.run_id, "strategy": e.get("strategy"),
                             "reason": f"step_log fetch failed (rows since {e.get('since')}): "
                                       f"{str(e.get('error', ''))[:200]}"})
    if not rows:
        return
    cells = sorted({"/".join(str(r.get(k)) for k in ("strategy", "tier", "output_class", "users",
                                                      "repeat") if r.get(k) is not None)
                    for r in rows})
    out["flags"].append(f"STEP LOG LOST OR PARTIAL in {len(cells)} cell(s): {', '.join(cells)}. "
                        "Their step-log figures (acceptance from steps, batch capacity, step "
                        "cost) rest on the rows kept; see Step log losses.")
    out["tables"].append(("Step log losses", "Cells whose engine step rows were not all "
                          "received: rows = step rows kept for the cell, missing_rows = replica "
                          "step numbers skipped inside it (empty: unknown, the fetch failed).",
                          rows))


def questions_section(results: Results, flagged: pd.DataFrame, warmup_s: float = 0.0,
                      warmup_dropped: int = 0) -> dict:
    """{"tables": [(title, text, rows)], "flags": [str] (top-of-report warnings),
    "figures": {key: png or None}, "consistency": {strategy: entry},
    "diverging": [strategy], "stability": DataFrame}."""
    out: dict = {"tables": [], "flags": [], "figures": {}}
    _step_log_loss(results, out)
    _consistency(results, out)
    _degraded(flagged, out)
    _memory(results, out)
    _stability(flagged, out, warmup_s, warmup_dropped)
    _drift_and_sources(flagged, out, warmup_s)
    return out
