"""Render an ``Analysis`` to markdown and to one self-contained HTML page.

The HTML has no scripts and no external resources: CSS is inline and every
figure is a ``data:image/png;base64`` URI, so it opens offline.
"""

from __future__ import annotations

import base64
import html as _html
import math
import time
from typing import TYPE_CHECKING

import pandas as pd

from analysis.data.scope import scope_line
from analysis.decide.checks import R2_MIN
from analysis.decide.claims import claim_lines
from analysis.decide.recommend import cell_order, headline_lines, percent, recommendation_rows
from configs import metric_names as mn
from configs.tiers import DEFAULT_TPOT_MS, DEFAULT_TTFT_MS

if TYPE_CHECKING:
    from analysis.data.analysis import Analysis

CELL_COLUMNS = ["run_id", "strategy", "tier", "output_class", "sampling", "users", "k",
                "n_requests", "n_ok",
                "output_tokens_per_s", "speedup", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
                "tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99", "tpot_mode_low_ms",
                "tpot_mode_high_ms", "itl_kind", "itl_ms_mean", "itl_ms_p50", "itl_ms_p90",
                "itl_ms_p99", "tokens_per_chunk", "goodput_tokens_per_s", "goodput_rps", "slo_attainment",
                mn.ACCEPTANCE_LENGTH, "acceptance_source", "tau_p10", "tau_p50", "tau_p90"]
FIGURE_TITLES = {
    "surface": ("Verification-cost surface: speedup over forced acceptance length and users, one "
                "panel per k (black: speedup 1.0; stars: real deployments at their measured "
                "acceptance length; top ticks: acceptance per prompt category)"),
    "goodput": "Goodput per strategy (black outline = recommended; one colour per strategy in every figure)",
    "speedup": "Speedup vs concurrency (dotted: measured crossover)",
    "throughput_latency": "Throughput-latency curve and knee",
    "latency_ecdf": ("Latency distributions: TTFT and TPOT per request, per strategy (empirical "
                     "CDF; two steps = bimodal, where one percentile misleads)"),
    "acceptance": "Acceptance length distribution",
    "per_position": "Per-position acceptance (unconditional and conditional, labelled)",
    "verification": "Verification tokens per step vs batch size",
    "step_cost": "Step time vs batch tokens (measured, per strategy)",
    "step_residuals": "Step cost model residuals per strategy (decode / with prefill)",
    "backtest_speedup_short": "Backtest, short outputs: predicted vs measured speedup",
    "backtest_speedup_long": "Backtest, long outputs: predicted vs measured speedup",
    "timeline": "Outage window: output tokens/s and error rate over time, one panel per strategy "
                "(shaded: outage)",
    "throughput_over_time": "Throughput over time per cell (one line per repeat; dashed: warm-up cut)",
    "acceptance_by_source": "Per-request acceptance length by prompt source",
    "server_timeline": "Server gauges over the run: running and waiting requests per served model "
                       "(shaded: cells)",
    "k_curve": "Speedup and acceptance length vs draft length k, per tier (one line per strategy; "
               "dashed / dotted: other candidate counts)",
    "temperature": "Acceptance length and speedup vs sampling temperature, per strategy",
}


def fmt(v) -> str:
    """Human formatting for tables: ints as is, floats rounded by magnitude, NaN as "-"."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 100):
        return str(int(v))
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}" if abs(v) >= 0.01 or v == 0 else f"{v:.2g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    return str(v)


def records(df: pd.DataFrame | None) -> list[dict]:
    """JSON-safe rows (NaN -> None)."""
    if df is None:
        return []
    return [{k: (None if isinstance(v, float) and math.isnan(v) else
                 (v.item() if hasattr(v, "item") else v)) for k, v in row.items()}
            for row in df.to_dict(orient="records")]


def _started(m: dict):
    """A manifest's start time: ``started``, else ``started_ts`` (epoch s) as UTC text, else None."""
    ts = m.get("started_ts")
    return m.get("started") or (time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + " UTC"
                                if isinstance(ts, (int, float)) else None)


def _routes(m: dict):
    """A manifest's routes as ``strategy: route, ...`` (None when it records none)."""
    routes = m.get("routes")
    if not isinstance(routes, dict):
        return None
    return ", ".join(f"{k}: {v.get('route') if isinstance(v, dict) else v}"
                     for k, v in routes.items())


def _sha(m: dict):
    """A manifest's git commit (``git_sha`` or ``git.sha``; None when absent)."""
    git = m.get("git")
    return m.get("git_sha") or (git.get("sha") if isinstance(git, dict) else None)


def _runs_table(a: Analysis) -> tuple[str, str, list[dict]]:
    """The "Runs" table: one row per run directory read (id, path, start, commit, sizes, routes)."""
    runs = [{"run_id": r.run_id, "path": str(r.path), "started": _started(r.manifest),
             "git_sha": _sha(r.manifest), "schema_version": r.manifest.get("schema_version"),
             "requests": len(r.requests),
             "steps": len(r.steps), "versions": r.manifest.get("versions"),
             "machine": r.manifest.get("machine"), "routes": _routes(r.manifest)}
            for r in a.results.runs]
    return ("Runs", "Run directories read. routes: the HTTP route each strategy was measured "
            "on (strategy: its own one-hop route, <target>/strategies/<name>/v1/...; "
            "model-field: <target>/v1/... with the model field, through the ingress; "
            "direct: the one-hop route on the strategy replica's own listener, Ray Serve's "
            "direct ingress, no Serve proxy in the path).", runs)


CELL_TEXT = (
    "Per run x strategy x tier x output class x users. tokens/s over "
    "the cell's wall time (first scheduled send to last end). Mean and p50 / p90 / p99 of "
    "TTFT and TPOT over ok requests. ITL is per token (itl_kind per_token: a chunk of n "
    "tokens g ms after the previous one counts n intervals of g / n ms; itl_ms_mean "
    "token-weighted, p50 / p90 / p99 the median over requests of their own); itl_kind "
    "chunk: the server sent no per-chunk token count, so no per-token ITL is given "
    "(tokens_per_chunk on average). tpot_mode_low_ms / tpot_mode_high_ms: the two modes "
    "of a TPOT flagged bimodal (Sarle's coefficient > 5/9 and Ashman's D >= 2; "
    "docs/metrics.md): read the mean and both modes, not p50. Runs before schema 9: ITL "
    "p50/p90 over requests' median ITL, p99 over requests' p99 ITL.")
CLAIMS_TEXT = (
    "The source evaluations' conditional claim, checked on this run's "
    "numbers: dflash2 (parallel drafting with path selection) wins at low concurrency with "
    "long outputs; dspark (the confidence-scheduled hybrid) wins at high concurrency. "
    "held = decided for the claimed strategy; did not hold = another won, no single winner "
    "(equivalent), or the claimed strategy was dropped; undecided; not measured = the "
    "strategy or cell is absent. claimed_vs_winner = the claimed strategy's goodput "
    "relative to the cell's leader.")
OUTAGE_TEXT = (
    "Cells with failed requests (the service accepted them "
    "and did not finish: error, timeout, disconnected) or rejected ones (HTTP 429, "
    "load shed on purpose). Outage: from the first failure to the first token of a "
    "successful request after the last failure (recovered = that token came within "
    "the cell). A recommendation over such a cell rests on a degraded run.")


def _recommendation_text(a: Analysis) -> str:
    """The "Recommendation" table's explanation (the run's equivalence margin and level)."""
    return ("Per tier x output class: the strategy with the highest goodput "
            "(output tokens/s of requests meeting both SLOs), margin = relative lead over the "
            "runner-up; status: decided (every other strategy's interval of goodput relative to "
            "the winner lies below 0; confidence = the smallest P(winner ahead)), equivalent (the "
            "contenders left are within +-max("
            f"{_pct0(a.race.get('equivalence_margin', 0.03))}, the run's cell-to-cell noise) of the "
            "leader, TOST) or undecided (confidence = the smallest P(leader ahead) of a contender "
            "left). The unit is the replicate (one cell run): t intervals of ln(goodput) with the "
            "run's pooled cell-to-cell noise (the baseline's A/A included), level "
            f"{_pct0(a.race.get('confidence', 0.9))} spent over the racing looks; repeats = most "
            "repeats of a strategy in the cell, looks = evaluations, noise = one replicate's "
            "relative deviation, time_s = the wall time of every repeat of the cell.")


def _decision_tables(a: Analysis) -> list[tuple[str, str, list[dict]]]:
    """The decision's tables: recommendation, race, claims, SLOs."""
    slo_rows = [{"tier": t, "ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms, "source": s.source}
                for t, s in sorted(a.slos.items(), key=lambda kv: cell_order((kv[0], "")))]
    return [
        ("Recommendation", _recommendation_text(a), recommendation_rows(a.recommendation)),
        ("Race to a decision", _race_text(a), _race_rows(a)),
        ("Claims check", CLAIMS_TEXT, a.claims),
        ("SLOs", "A request meets the SLO when TTFT <= ttft_ms and TPOT <= tpot_ms. Source: "
         f"flags > run manifest (config.slo) > defaults (TTFT {DEFAULT_TTFT_MS:g} ms, "
         f"TPOT {DEFAULT_TPOT_MS:g} ms).", slo_rows),
    ]


def _model_tables(a: Analysis) -> list[tuple[str, str, list[dict]]]:
    """The capacity model's tables: crossover, the capacity model's own, knee, batch capacity,
    the server's counters."""
    return [
        ("Crossover concurrency", "Measured: users level where speedup first drops below 1, "
         "linearly interpolated between measured levels. Predicted: where the step cost model "
         "(per strategy, fitted on every users level, calibrated per output class; see "
         "\"Step cost model\" below) predicts a speedup below 1; tau = acceptance length, "
         "verification_per_request = tokens the decode forward computes per row.",
         records(a.crossover)),
        *a.capacity_model.get("tables", []),
        ("Throughput-latency knee", "Users level maximising throughput / p50 e2e latency "
         "(Kleinrock's power).", records(a.knees)),
        ("Batch capacity (step log or server counters)", "wasted_share = (verification - emitted) / verification "
         "tokens; verification_per_emitted = batch tokens spent per emitted token; "
         "ms_per_emitted_token = engine time per emitted token. source: the engine's step log, "
         "or the target's own Prometheus counters (server /metrics) where there is no step log.",
         records(a.capacity)),
        *a.server.get("tables", []),
    ]


def _measurement_tables(a: Analysis) -> list[tuple[str, str, list[dict]]]:
    """The measurements' tables: per cell, per position, and the questions (output
    consistency, memory, stability, k / temperature, surface)."""
    return [
        ("Per-cell metrics", CELL_TEXT,
         records(_tier_sorted(a.cells[[c for c in CELL_COLUMNS if c in a.cells.columns]]))),
        ("Per-position acceptance", "uncond = accepted at i / drafts (vLLM); cond = accepted at "
         "i / accepted at i-1 (DFlash 2, DSpark). source: the requests' own speculative stats, "
         "or the server's per-position counters. Drafter top-k coverage is measured "
         "offline (`python -m bench.acceptance`).",
         records(a.positions)),
        *a.questions.get("tables", []),   # output consistency, memory, stability
    ]


def _tables(a: Analysis) -> list[tuple[str, str, list[dict]]]:
    """(section title, explanation, rows) for every table of the report, in report order."""
    out = [*_decision_tables(a), *_model_tables(a), *_measurement_tables(a)]
    outage_rows = records(a.outages) if a.outages is not None else []
    out.insert(1, ("Faults and outages", OUTAGE_TEXT, outage_rows))
    if a.degradation is not None:
        out.insert(1, ("Degradation vs baseline", f"Baseline {a.baseline_root}: flagged when "
                       "acceptance length or goodput dropped by more than 10 %.",
                       records(a.degradation)))
    out.append(_runs_table(a))
    return out


def _pct0(frac) -> str:
    return f"{100 * float(frac):.0f}%"


def _race_text(a: Analysis) -> str:
    r = a.race or {}
    if not r.get("raced"):
        return (f"Not raced ({r.get('undecided_reason', 'no racing')}): one evaluation over every "
                "replicate. `python -m loadgen --budget 15m` repeats the undecided cells' "
                "contenders after the first pass.")
    return (f"The run raced (budget {fmt(r.get('budget_s'))} s, confidence {_pct0(r['confidence'])}, "
            f"margin +-{_pct0(r['equivalence_margin'])}; {r.get('rounds')} round(s) after a "
            f"{r.get('first_pass_repeats')}-repeat first pass; stopped: {r.get('stopped')}). "
            "Replayed here look by look (manifest `race.looks`) from the request rows, as the load "
            "generator decided: dropped = the strategies the leader beat, with the look at which "
            "each was dropped; interval = each contender's goodput relative to the leader at the "
            "look's level (alpha spent per look: (1 - c) / (k (k + 1))).")


def _race_rows(a: Analysis) -> list[dict]:
    rows = []
    reason = (a.race or {}).get("undecided_reason")
    for tier, oc in sorted(((t, o) for t, by in a.recommendation.items() for o in by), key=cell_order):
        r = a.recommendation[tier][oc]
        status = r.get("status")
        iv = r.get("relative_interval") or {}
        rows.append({"tier": tier, "output_class": oc,
                     "status": f"{status} ({reason})" if status == "undecided" and reason else status,
                     "leader": r.get("leader"), "contenders": r.get("contenders"),
                     "equivalent": r.get("equivalent"),
                     "dropped": ", ".join(f"{s} (look {k})" for s, k in (r.get("dropped") or {}).items()),
                     "confidence": percent(r.get("confidence"), 0), "repeats": r.get("repeats"),
                     "looks": r.get("looks"),
                     "noise": percent((r.get("noise") or {}).get("relative"), 0),
                     "variance": (f"{(r.get('noise') or {}).get('source')} (df "
                                  f"{(r.get('noise') or {}).get('df')})" if r.get("noise") else None),
                     "why": r.get("reason") or None,
                     "time_s": r.get("time_s"),
                     "interval": "; ".join(f"{s} {100 * v[0]:+.1f}..{100 * v[1]:+.1f}%"
                                           for s, v in iv.items())})
    return rows


def _empty(v) -> bool:
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v)) or (
        isinstance(v, (list, tuple)) and not v)


def _tier_sorted(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in low / mid / high order (then output class short / long) within each strategy."""
    if df.empty or "tier" not in df:
        return df
    key = df.apply(lambda r: cell_order((r["tier"], r.get("output_class", ""))), axis=1)
    lead = [c for c in ("run_id", "strategy") if c in df]
    order = sorted(range(len(df)), key=lambda i: (*[str(df.iloc[i][c]) for c in lead], key.iloc[i],
                                                   df.iloc[i].get("users", 0)))
    return df.iloc[order]


def shown_columns(rows: list[dict]) -> list[str]:
    """The columns of ``rows`` that hold a value in at least one row (always-empty ones go)."""
    cols = list(rows[0]) if rows else []
    return [c for c in cols if any(not _empty(r.get(c)) for r in rows)]


def _checks(a: Analysis) -> list[str]:
    return [line for lines in a.checks.values() for line in lines]


ANSWER_INTRO = ("Per tier: the strategy to run, how sure we are (the confidence of intervals over "
                "repeats, against the run's own cell-to-cell noise) and by how much it wins "
                "(goodput margin over the runner-up), ")
CHECKS_INTRO = ("Where a prediction of the capacity model contradicts a measurement, or a fit "
                f"explains little (r² < {R2_MIN}). The recommendation above rests on the measured "
                "goodput, not on these predictions.")


def checks_summary(a: Analysis, where: str = " (details below)") -> str:
    """One line for the first screen: ``model checks: 3 of 16 fail (details below)``; every
    check passing, or none run, says so. ``where`` ends a failing line."""
    failed, run = len(_checks(a)), max(a.checks_run, len(_checks(a)))
    if not run:
        return "model checks: none run (no step cost model or backtest on this run)"
    if not failed:
        return f"model checks: all {run} pass"
    return f"model checks: {failed} of {run} fail{where}"


def server_metrics_line(a: Analysis) -> str | None:
    """The target's Prometheus page, when a run could not read it, in the console's words
    (``python -m loadgen``): ``server metrics: not available (not needed: <why>)`` for
    specload's own service (its step log is read instead), ``server metrics: not available
    (<error>)`` for another target; None when every run read it or none tried."""
    from analysis.data.server import server_facts

    lines = []
    for f in server_facts(a.results):
        if f.get("skipped"):
            lines.append(f"not available (not needed: {f['skipped']})")
        elif f.get("error"):
            lines.append(f"not available ({f['error']}; the target's own counters are absent)")
    if not lines:
        return None
    return "server metrics: " + "; ".join(dict.fromkeys(lines))


def answer_lines(a: Analysis) -> tuple[str, list[str], list[str], list[str]]:
    """The first screen, shared by markdown and HTML: (intro with the scope, the
    recommendation per tier, the claims, status lines: model checks and server metrics)."""
    intro = ANSWER_INTRO + scope_line((a.race or {}).get("scope") or {}) + "."
    heads = headline_lines(a.recommendation, (a.race or {}).get("undecided_reason"))
    status = [checks_summary(a)] + [x for x in [server_metrics_line(a)] if x]
    return intro, heads, claim_lines(a.claims), status


def _md_table(rows: list[dict]) -> str:
    if not rows:
        return "_no data_\n"
    cols = shown_columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)).replace("|", "/") for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def markdown(a: Analysis) -> str:
    """The report as markdown (tables only; the figures are in report.html). First screen: the
    answer per tier with its scope, the claims, a one-line model-check summary; then warnings,
    the model checks folded (``<details>``), then every table."""
    intro, heads, claims, status = answer_lines(a)
    parts = ["# specload capacity report\n", "## Answer\n", intro + "\n",
             "\n".join(f"- {line}" for line in heads) + "\n",
             "Claims check, on this deployment (see below):\n",
             "\n".join(f"- {line}" for line in claims) + "\n",
             "\n".join(f"- {line}" for line in status) + "\n",
             f"Results: `{a.results.root}` ({len(a.results.runs)} run(s), "
             f"{len(a.results.requests)} requests, {len(a.results.steps)} engine steps). "
             "Figures: see report.html.\n"]
    flags = a.questions.get("flags", [])
    if flags:   # before every table: a diverging strategy is never silently ranked
        parts += ["## Warnings\n", "\n".join(f"- **{f}**" for f in flags) + "\n"]
    checks = _checks(a)
    if checks:
        parts += ["## Model checks\n", CHECKS_INTRO + "\n",
                  f"<details><summary>{_html.escape(checks_summary(a, where=''))}</summary>\n",
                  "\n".join(f"- {c}" for c in checks) + "\n", "</details>\n"]
    for title, text, rows in _tables(a):
        parts += [f"## {title}\n", text + "\n", _md_table(rows)]
    return "\n".join(parts)


def _html_table(rows: list[dict], table_id: str) -> str:
    if not rows:
        return "<p><em>no data</em></p>"
    cols = shown_columns(rows)
    head = "".join(f"<th>{_html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_html.escape(fmt(r.get(c)))}</td>" for c in cols)
                   + "</tr>" for r in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


CSS = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;"
       "font-size:12px;margin-bottom:1em}td,th{border:1px solid #ccc;padding:3px 6px;"
       "text-align:right}th{background:#eee}section{overflow-x:auto}img{max-width:100%}"
       ".warn{color:#8a4b00;font-weight:bold}summary{cursor:pointer;font-weight:bold}")


def _html_answer(a: Analysis) -> str:
    """The HTML first screen: the answer per tier with its scope, the claims, the status lines."""
    intro, heads, claims, status = answer_lines(a)
    return ("<section id=\"answer\"><h2>Answer</h2><p>" + _html.escape(intro) + "</p><ul>"
            + "".join(f"<li>{_html.escape(line)}</li>" for line in heads)
            + "</ul><p>Claims check, on this deployment (see below):</p><ul>"
            + "".join(f"<li>{_html.escape(line)}</li>" for line in claims)
            + "</ul><ul class=\"status\">"
            + "".join(f"<li>{_html.escape(line)}</li>" for line in status)
            + "</ul></section>")


def _html_checks(a: Analysis) -> str:
    """The model checks, folded: a ``<details>`` whose summary is the one-line count."""
    checks = _checks(a)
    if not checks:
        return ""
    return ("<section id=\"checks\"><h2>Model checks</h2><p>" + _html.escape(CHECKS_INTRO)
            + f"</p><details><summary>{_html.escape(checks_summary(a, where=''))}</summary><ul>"
            + "".join(f"<li class=\"warn\">{_html.escape(c)}</li>" for c in checks)
            + "</ul></details></section>")


def _html_figures(a: Analysis) -> str:
    """Every figure as an inline PNG with its caption and the model checks about it."""
    parts = ["<section><h2>Figures</h2>"]
    for key, png in a.figures.items():
        if png:
            b64 = base64.b64encode(png).decode("ascii")
            notes = "".join(f"<p class=\"warn\">{_html.escape(n)}</p>"
                            for n in a.checks.get(key, []))
            parts.append(f"<figure><figcaption>{_html.escape(FIGURE_TITLES.get(key, key))}"
                         f"</figcaption><img id=\"fig-{key}\" alt=\"{key}\" "
                         f"src=\"data:image/png;base64,{b64}\">{notes}</figure>")
    parts.append("</section>")
    return "\n".join(parts)


def html(a: Analysis) -> str:
    """The report as one self-contained HTML page (inline CSS, base64 PNG figures), in the
    markdown's order; the figures follow the recommendation table."""
    parts = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
             "<title>specload capacity report</title>",
             f"<style>{CSS}</style></head><body><h1>specload capacity report</h1>",
             _html_answer(a),
             f"<p>Results: <code>{_html.escape(str(a.results.root))}</code>, "
             f"{len(a.results.runs)} run(s), {len(a.results.requests)} requests, "
             f"{len(a.results.steps)} engine steps.</p>"]
    flags = a.questions.get("flags", [])
    if flags:   # before every table: a diverging strategy is never silently ranked
        parts.append('<section id="warnings"><h2>Warnings</h2><ul>'
                     + "".join(f"<li><strong>{_html.escape(f)}</strong></li>" for f in flags)
                     + "</ul></section>")
    parts.append(_html_checks(a))
    for title, text, rows in _tables(a):
        table_id = title.split(" ")[0].lower().replace("-", "_")
        parts.append(f"<section><h2>{_html.escape(title)}</h2><p>{_html.escape(text)}</p>"
                     f"{_html_table(rows, table_id)}</section>")
        if title == "Recommendation":
            parts.append(_html_figures(a))
    parts.append("</body></html>")
    return "\n".join(parts)
