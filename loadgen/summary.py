"""Per-cell numbers for the live summary: achieved concurrency, throughput, latency percentiles.

Pure Python over request rows (dicts keyed by metric_names); the full analysis
lives in ``analysis/``. Throughput = output tokens of ``ok`` requests / (last
end - first send) of the cell, tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from configs import metric_names as M
from configs.tiers import Slo

CONCURRENCY_WARN_FRACTION = 0.9   # warn when achieved < 90% of requested users
CPU_WARN_PERCENT = 90.0           # warn when the generator's process CPU passes this


def achieved_concurrency(rows: Iterable[dict[str, Any]], t0: float, t1: float) -> float:
    """Time-weighted mean of requests in flight over [t0, t1] (unix s): sum of overlaps / (t1 - t0).

    A request is in flight from its actual send time to its end (cancelled
    requests end when stopped). NaN for an empty window.
    """
    if t1 <= t0:
        return math.nan
    busy = 0.0
    for r in rows:
        s, e = r.get(M.REQ_SENT_TS), r.get(M.REQ_END_TS)
        if s is None or e is None:
            continue
        busy += max(0.0, min(e, t1) - max(s, t0))
    return busy / (t1 - t0)


def _pct(vals: list[float], q: float) -> float:
    vals = sorted(v for v in vals if v is not None and not math.isnan(v))
    if not vals:
        return math.nan
    k = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


@dataclass
class CellSummary:
    """What the summary table and the manifest show for one strategy x cell."""

    strategy: str
    tier: str
    output_class: str
    arrival: str
    users: int
    rate_rps: float | None
    requests: int = 0
    ok: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    achieved_concurrency: float = math.nan
    output_tok_s: float = math.nan
    goodput_rps: float = math.nan
    slo_attainment: float = math.nan        # fraction of ok requests meeting both SLOs
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    tpot_p50_ms: float = math.nan
    tpot_p99_ms: float = math.nan
    itl_p50_ms: float = math.nan
    send_lag_p99_ms: float = math.nan       # open loop: actual - scheduled send time
    acceptance_length: float = math.nan
    cpu_mean_percent: float = math.nan
    cpu_max_percent: float = math.nan
    speedup: float = math.nan               # output_tok_s / autoregressive's, same cell
    repeat: int = 0                         # 0-based repeat (--repeats)
    warnings: list[str] = field(default_factory=list)


def summarize_cell(rows: list[dict[str, Any]], *, strategy: str, tier: str, output_class: str, arrival: str,
                   users: int, rate_rps: float | None, slo: Slo, window: tuple[float, float],
                   cpu_samples: list[float]) -> CellSummary:
    """Summarise one cell's rows; adds concurrency and CPU warnings (the issue's 90% rules)."""
    s = CellSummary(strategy, tier, output_class, arrival, users, rate_rps)
    s.requests = len(rows)
    for r in rows:
        s.by_status[r[M.REQ_STATUS]] = s.by_status.get(r[M.REQ_STATUS], 0) + 1
    ok = [r for r in rows if r[M.REQ_STATUS] == M.STATUS_OK]
    s.ok = len(ok)
    s.achieved_concurrency = achieved_concurrency(rows, *window)
    sent = [r[M.REQ_SENT_TS] for r in rows if r.get(M.REQ_SENT_TS) is not None]
    ends = [r[M.REQ_END_TS] for r in ok]
    if ok and sent:
        span = max(ends) - min(sent)
        if span > 0:
            s.output_tok_s = sum(r.get(M.REQ_OUTPUT_TOKENS) or 0 for r in ok) / span
            good = [r for r in ok if (r.get(M.REQ_TTFT_MS) or math.inf) <= slo.ttft_ms
                    and (r.get(M.REQ_TPOT_MS) if r.get(M.REQ_TPOT_MS) is not None else 0.0) <= slo.tpot_ms]
            s.goodput_rps = len(good) / span
            s.slo_attainment = len(good) / len(ok)
    s.ttft_p50_ms = _pct([r.get(M.REQ_TTFT_MS) for r in ok], 50)
    s.ttft_p99_ms = _pct([r.get(M.REQ_TTFT_MS) for r in ok], 99)
    s.tpot_p50_ms = _pct([r.get(M.REQ_TPOT_MS) for r in ok], 50)
    s.tpot_p99_ms = _pct([r.get(M.REQ_TPOT_MS) for r in ok], 99)
    s.itl_p50_ms = _pct([r.get(M.REQ_ITL_P50_MS) for r in ok], 50)
    lags = [(r[M.REQ_SENT_TS] - r[M.REQ_SCHEDULED_TS]) * 1000 for r in rows
            if r.get(M.REQ_SENT_TS) is not None and r.get(M.REQ_SCHEDULED_TS) is not None]
    s.send_lag_p99_ms = _pct(lags, 99)
    drafts = sum(r.get(M.NUM_DRAFTS) or 0 for r in ok)
    if drafts:
        s.acceptance_length = M.acceptance_length(drafts, sum(r.get(M.NUM_ACCEPTED_TOKENS) or 0 for r in ok))
    if cpu_samples:
        s.cpu_mean_percent = sum(cpu_samples) / len(cpu_samples)
        s.cpu_max_percent = max(cpu_samples)
    if arrival == "closed" and not math.isnan(s.achieved_concurrency) and \
            s.achieved_concurrency < CONCURRENCY_WARN_FRACTION * users:
        s.warnings.append(f"achieved concurrency {s.achieved_concurrency:.1f} < 90% of the requested {users} users "
                          "(server rejecting/slow to accept, generator saturated, or too short a cell)")
    if arrival == "open" and not math.isnan(s.send_lag_p99_ms) and s.send_lag_p99_ms > 50:
        s.warnings.append(f"open loop: p99 send lag {s.send_lag_p99_ms:.0f} ms behind schedule "
                          f"(all {users} users busy or generator saturated; latencies include the lag)")
    if not math.isnan(s.cpu_mean_percent) and s.cpu_mean_percent > CPU_WARN_PERCENT:
        s.warnings.append(f"load generator CPU {s.cpu_mean_percent:.0f}% > {CPU_WARN_PERCENT:.0f}%: timings may be "
                          "inflated; use --workers N to spread the load")
    return s


def add_speedups(summaries: list[CellSummary], baseline: str = M.AUTOREGRESSIVE) -> None:
    """Set ``speedup`` = tokens/s / the baseline strategy's tokens/s in the same tier x output cell."""
    base = {(s.tier, s.output_class, s.users, s.repeat): s.output_tok_s
            for s in summaries if s.strategy == baseline}
    for s in summaries:
        b = base.get((s.tier, s.output_class, s.users, s.repeat))
        if b and not math.isnan(b) and b > 0 and not math.isnan(s.output_tok_s):
            s.speedup = s.output_tok_s / b


def render_table(summaries: list[CellSummary]):
    """A rich Table: one row per strategy x cell."""
    from rich.table import Table

    def f(v: float, fmt: str = "{:.1f}") -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    t = Table(title="specload: per strategy x cell (latencies in ms; tokens/s over the cell)")
    for col in ("strategy", "tier", "output", "users", "conc.", "ok/total", "tok/s", "speedup", "TTFT p50",
                "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "SLO ok", "tau", "CPU%"):
        t.add_column(col, justify="left" if col in ("strategy", "tier", "output") else "right")
    for s in summaries:
        users = f"{s.users}" if s.arrival == "closed" else f"{s.rate_rps:g}/s"
        t.add_row(s.strategy, s.tier, s.output_class, users, f(s.achieved_concurrency), f"{s.ok}/{s.requests}",
                  f(s.output_tok_s), f(s.speedup, "{:.2f}x"), f(s.ttft_p50_ms), f(s.ttft_p99_ms), f(s.tpot_p50_ms),
                  f(s.tpot_p99_ms), f(s.itl_p50_ms), f(s.slo_attainment * 100 if not math.isnan(s.slo_attainment)
                                                      else math.nan, "{:.0f}%"),
                  f(s.acceptance_length, "{:.2f}"), f(s.cpu_mean_percent, "{:.0f}"))
    return t
