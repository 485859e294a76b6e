"""Per-cell numbers for the live summary: achieved concurrency, throughput, latency percentiles.

Pure Python over request rows (dicts keyed by metric_names); the full analysis
lives in ``analysis/``. The definitions are the report's (analysis/data/metrics.py), so a
figure reads the same on the console, in summary.csv, the manifest and the report:
throughput = output tokens of ``ok`` requests / (last end - first scheduled send) of
the cell, tokens/s; SLO attainment = requests meeting both SLOs / all requests.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from configs import metric_names as M
from configs.tiers import Slo

CONCURRENCY_WARN_FRACTION = 0.9   # warn when achieved < 90% of requested users
STREAM_BATCHING_SHARE = 0.05     # speculation off and >= 5% multi-token chunks: the server batches its stream
CPU_WARN_PERCENT = 90.0           # warn when the generator's process CPU passes this
SUMMARY_CSV = "summary.csv"       # the full per-cell table, beside manifest.json


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
    """Percentile ``q`` (0..100) of the non-null values, NaN for none (one rule: ``analysis.data.distribution.percentile``)."""
    from analysis.data.distribution import percentile

    return percentile(vals, q)


@dataclass
class CellSummary:
    """What the summary table, ``summary.csv`` and the manifest show for one strategy x cell.

    Field names are the per-cell names of ``configs/metric_names.py`` (``CELL_*``),
    the same as the report's per-cell table. NaN means undefined (no ok request,
    no speculative statistics) and is written as ``null`` / an empty CSV cell.
    """

    strategy: str
    tier: str
    output_class: str
    arrival: str
    users: int
    rate_rps: float | None
    n_requests: int = 0
    n_ok: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    achieved_concurrency: float = math.nan
    output_tokens_per_s: float = math.nan
    goodput_rps: float = math.nan
    slo_attainment: float = math.nan        # share of all requests meeting both SLOs
    ttft_ms_p50: float = math.nan
    ttft_ms_p99: float = math.nan
    tpot_ms_p50: float = math.nan
    tpot_ms_p99: float = math.nan
    itl_ms_p50: float = math.nan
    # distributions, not one point (docs/metrics.md, "Distributions"): mean and p90 beside p50 / p99
    ttft_ms_mean: float = math.nan
    ttft_ms_p90: float = math.nan
    tpot_ms_mean: float = math.nan
    tpot_ms_p90: float = math.nan
    itl_ms_mean: float = math.nan           # per token, token-weighted over the cell
    itl_ms_p90: float = math.nan            # median over requests of their per-token p90
    itl_ms_p99: float = math.nan            # median over requests of their per-token p99
    # per_token: every ok request's chunks carried a token count; chunk: some did not, so no
    # per-token ITL is given for the cell (itl_ms_* NaN) and chunk_gap_ms_p50 holds the chunk gaps
    itl_kind: str = ""
    tokens_per_chunk: float = math.nan      # mean tokens per later content chunk
    chunk_gap_ms_p50: float = math.nan      # median over requests of their median chunk gap
    tpot_bimodality: float = math.nan       # Sarle's bimodality coefficient of per-request TPOT
    tpot_mode_low_ms: float = math.nan      # the two modes when TPOT is flagged bimodal (else NaN)
    tpot_mode_high_ms: float = math.nan
    send_lag_ms_p99: float = math.nan       # open loop: actual - scheduled send time
    acceptance_length: float = math.nan     # 1.0 when nothing was drafted; NaN without stats
    cpu_mean_percent: float = math.nan
    cpu_max_percent: float = math.nan
    speedup: float = math.nan               # output_tokens_per_s / autoregressive's, same cell
    repeat: int = 0                         # 0-based repeat (--repeats)
    sampling: str = M.GREEDY                # sampling label (configs.tiers.Sampling.name): part of the cell
    duration_s: float = math.nan            # first scheduled send -> last end of any row, s
    degraded_requests: int = 0              # requests whose drafter failed: went on autoregressively
    # --acceptance-length: the forced acceptance length of a synthetic deployment (its text is not
    # the target's; never a recommendation); NaN for a real one
    synthetic_acceptance_length: float = math.nan
    warnings: list[str] = field(default_factory=list)
    # --workers N: per Locust worker {worker_index, client_id, ray_node_id, cpu_percent_mean/max,
    # users_max/last, rows, lost} (loadgen.run.locust_runner.CellRun.workers)
    workers: list[dict] = field(default_factory=list)
    # --server-metrics: the target's own counters over the cell (deltas) and gauges (mean / max),
    # loadgen.run.server_metrics.cell_figures; {} when not read
    server_metrics: dict[str, Any] = field(default_factory=dict)


def meets_slo(row: dict[str, Any], slo: Slo) -> bool:
    """An ok request meets the SLO when TTFT <= slo.ttft_ms and TPOT <= slo.tpot_ms; a
    one-token output has no TPOT and is judged on TTFT alone (as analysis.data.metrics.meets_slo)."""
    ttft, tpot = row.get(M.REQ_TTFT_MS), row.get(M.REQ_TPOT_MS)
    if ttft is None or not ttft <= slo.ttft_ms:
        return False
    if tpot is None:
        return (row.get(M.REQ_OUTPUT_TOKENS) or 0) <= 1
    return tpot <= slo.tpot_ms


def summarize_cell(rows: list[dict[str, Any]], *, strategy: str, tier: str, output_class: str, arrival: str,
                   users: int, rate_rps: float | None, slo: Slo, window: tuple[float, float],
                   cpu_samples: list[float]) -> CellSummary:
    """Summarise one cell's rows; adds concurrency and CPU warnings (the issue's 90% rules)."""
    s = CellSummary(strategy, tier, output_class, arrival, users, rate_rps)
    s.n_requests = len(rows)
    for r in rows:
        s.by_status[r[M.REQ_STATUS]] = s.by_status.get(r[M.REQ_STATUS], 0) + 1
    ok = [r for r in rows if r[M.REQ_STATUS] == M.STATUS_OK]
    s.n_ok = len(ok)
    s.degraded_requests = sum(1 for r in rows if r.get(M.DEGRADED_REASON))
    s.achieved_concurrency = achieved_concurrency(rows, *window)
    # The same definitions as the report (analysis/data/metrics.py): the cell's wall time runs from
    # the first scheduled send to the last end of any row; SLO attainment is over all requests.
    starts = [r[M.REQ_SCHEDULED_TS] if r.get(M.REQ_SCHEDULED_TS) is not None else r.get(M.REQ_SENT_TS)
              for r in rows]
    starts = [t for t in starts if t is not None]
    ends = [r[M.REQ_END_TS] for r in rows if r.get(M.REQ_END_TS) is not None]
    if starts and ends:
        s.duration_s = max(ends) - min(starts)
    if ok and s.duration_s > 0:
        s.output_tokens_per_s = sum(r.get(M.REQ_OUTPUT_TOKENS) or 0 for r in ok) / s.duration_s
        good = [r for r in ok if meets_slo(r, slo)]
        s.goodput_rps = len(good) / s.duration_s
        s.slo_attainment = len(good) / len(rows)
    s.ttft_ms_p50 = _pct([r.get(M.REQ_TTFT_MS) for r in ok], 50)
    s.ttft_ms_p99 = _pct([r.get(M.REQ_TTFT_MS) for r in ok], 99)
    s.tpot_ms_p50 = _pct([r.get(M.REQ_TPOT_MS) for r in ok], 50)
    s.tpot_ms_p99 = _pct([r.get(M.REQ_TPOT_MS) for r in ok], 99)
    s.itl_ms_p50 = _pct([r.get(M.REQ_ITL_P50_MS) for r in ok], 50)
    _distributions(s, ok, rows)
    lags = [(r[M.REQ_SENT_TS] - r[M.REQ_SCHEDULED_TS]) * 1000 for r in rows
            if r.get(M.REQ_SENT_TS) is not None and r.get(M.REQ_SCHEDULED_TS) is not None]
    s.send_lag_ms_p99 = _pct(lags, 99)
    _acceptance(s, ok)
    if cpu_samples:
        s.cpu_mean_percent = sum(cpu_samples) / len(cpu_samples)
        s.cpu_max_percent = max(cpu_samples)
    _load_warnings(s, arrival, users)
    return s


def _acceptance(s: CellSummary, ok: list[dict[str, Any]]) -> None:
    """tau: one definition everywhere (metric_names.acceptance_length): 1.0 when the server
    reports zero drafts (autoregressive), undefined (NaN -> null) when it reports no stats.
    A row with drafts but no accepted count (an engine key spelling not read) makes the
    pooled tau "not reported", never 1.0: the warning says why."""
    with_stats = [r for r in ok if r.get(M.NUM_DRAFTS) is not None]
    no_accepted = [r for r in with_stats if r[M.NUM_DRAFTS] and r.get(M.NUM_ACCEPTED_TOKENS) is None]
    if with_stats and not no_accepted:
        s.acceptance_length = M.acceptance_length(sum(r[M.NUM_DRAFTS] for r in with_stats),
                                                  sum(r.get(M.NUM_ACCEPTED_TOKENS) or 0 for r in with_stats))
    elif no_accepted:
        src = sorted({str(r.get(M.REQ_SPEC_SOURCE)) for r in no_accepted})
        s.warnings.append(f"tau not reported: {len(no_accepted)} request(s) report drafts but no accepted "
                          f"count (source {', '.join(src)})")


def _load_warnings(s: CellSummary, arrival: str, users: int) -> None:
    """The load generator's own limits (the 90% rules): achieved concurrency under 90% of
    the users (closed loop), p99 send lag over 50 ms (open loop), its CPU over 90%."""
    if arrival == "closed" and not math.isnan(s.achieved_concurrency) and \
            s.achieved_concurrency < CONCURRENCY_WARN_FRACTION * users:
        s.warnings.append(f"achieved concurrency {s.achieved_concurrency:.1f} < 90% of the requested {users} users "
                          "(server rejecting/slow to accept, generator saturated, or too short a cell)")
    if arrival == "open" and not math.isnan(s.send_lag_ms_p99) and s.send_lag_ms_p99 > 50:
        s.warnings.append(f"open loop: p99 send lag {s.send_lag_ms_p99:.0f} ms behind schedule "
                          f"(all {users} users busy or generator saturated; latencies include the lag)")
    if not math.isnan(s.cpu_mean_percent) and s.cpu_mean_percent > CPU_WARN_PERCENT:
        s.warnings.append(f"load generator CPU {s.cpu_mean_percent:.0f}% > {CPU_WARN_PERCENT:.0f}%: timings may be "
                          "inflated; use --workers N to spread the load")


def _speculation_off(strategy: str, ok: list[dict[str, Any]]) -> bool:
    """The cell emits one token per step: every ok row's server stats say no draft token
    was accepted (the only way a step emits several); without stats, the strategy is
    ``autoregressive``."""
    accepted = [r.get(M.NUM_ACCEPTED_TOKENS) for r in ok]
    if accepted and all(a is not None for a in accepted):
        return all(a == 0 for a in accepted)
    parsed = M.parse_variant_name(strategy)
    return parsed is not None and parsed[0] == M.AUTOREGRESSIVE


def _distributions(s: CellSummary, ok: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """Mean / p90 / p99 of TTFT, TPOT and ITL; ITL per token only where every ok request had
    per-chunk token counts (else "chunk ITL", labelled); the TPOT bimodality flag; the stream
    batching flag (multi-token chunks with speculation off)."""
    from analysis.data.distribution import bimodality, describe

    ttft = describe(r.get(M.REQ_TTFT_MS) for r in ok)
    tpot = describe(r.get(M.REQ_TPOT_MS) for r in ok)
    s.ttft_ms_mean, s.ttft_ms_p90 = ttft["mean"], ttft["p90"]
    s.tpot_ms_mean, s.tpot_ms_p90 = tpot["mean"], tpot["p90"]
    with_gaps = [r for r in ok if r.get(M.REQ_ITL_SOURCE) is not None]
    per_token = [r for r in with_gaps if r[M.REQ_ITL_SOURCE] != M.ITL_SOURCE_CHUNKS]
    tpc = [(r[M.REQ_TOKENS_PER_CHUNK], (r.get(M.REQ_NUM_CHUNKS) or 0) - 1) for r in with_gaps
           if r.get(M.REQ_TOKENS_PER_CHUNK) is not None]
    if tpc and sum(w for _, w in tpc) > 0:
        s.tokens_per_chunk = sum(v * w for v, w in tpc) / sum(w for _, w in tpc)
    s.chunk_gap_ms_p50 = _pct([r.get(M.REQ_CHUNK_GAP_P50_MS) for r in with_gaps], 50)
    if with_gaps and len(per_token) == len(with_gaps):
        s.itl_kind = "per_token"
        s.itl_ms_p90 = _pct([r.get(M.REQ_ITL_P90_MS) for r in per_token], 50)
        s.itl_ms_p99 = _pct([r.get(M.REQ_ITL_P99_MS) for r in per_token], 50)
        means = [(r[M.REQ_ITL_MEAN_MS], (r.get(M.REQ_OUTPUT_TOKENS) or 0) - 1) for r in per_token
                 if r.get(M.REQ_ITL_MEAN_MS) is not None]
        if means and sum(w for _, w in means) > 0:
            s.itl_ms_mean = sum(v * w for v, w in means) / sum(w for _, w in means)
    elif with_gaps:
        s.itl_kind = "chunk"
        s.itl_ms_p50 = math.nan   # never a chunk gap as per-token ITL
        s.warnings.append(f"chunk ITL, {_num(s.tokens_per_chunk, '.1f')} tokens per chunk on average: "
                          f"{len(with_gaps) - len(per_token)} of {len(with_gaps)} requests came without a "
                          f"per-chunk token count, so no per-token ITL is given (median chunk gap "
                          f"{_num(s.chunk_gap_ms_p50, '.1f')} ms)")
    # a stray 2-token chunk (a detokeniser holding back half a UTF-8 character) is not batching:
    # flagged when at least STREAM_BATCHING_SHARE of the later chunks carry several tokens
    multi = sum(r.get(M.REQ_MULTI_TOKEN_CHUNKS) or 0 for r in ok)
    later = sum(max((r.get(M.REQ_NUM_CHUNKS) or 0) - 1, 0) for r in ok if r.get(M.REQ_MULTI_TOKEN_CHUNKS) is not None)
    batched = (multi >= STREAM_BATCHING_SHARE * later > 0 if s.itl_kind == "per_token"
               else s.itl_kind == "chunk" and s.tokens_per_chunk > 1 + STREAM_BATCHING_SHARE)
    if _speculation_off(s.strategy, ok) and batched:
        what = (f"{multi} chunks of several tokens" if multi else "per-chunk counts unknown")
        s.warnings.append("multi-token chunks with speculation off "
                          f"({what}, {_num(s.tokens_per_chunk, '.2f')} tokens per chunk on average): the server "
                          "batches its stream (stream_interval, Ray Serve LLM's stream batching); a "
                          "server artefact, chunk gaps are not engine steps")
    bi = bimodality(r.get(M.REQ_TPOT_MS) for r in ok)
    s.tpot_bimodality = bi["bc"]
    if bi["bimodal"]:
        s.tpot_mode_low_ms, s.tpot_mode_high_ms = bi["low_mode"], bi["high_mode"]
        s.warnings.append(f"TPOT is bimodal: modes {bi['low_mode']:.1f} ms ({100 * bi['low_share']:.0f}% of "
                          f"requests) and {bi['high_mode']:.1f} ms (bimodality coefficient {bi['bc']:.2f}, "
                          f"Ashman's D {bi['ashman_d']:.1f}): read the mean and both modes, not p50")


def add_speedups(summaries: list[CellSummary], baseline: str = M.AUTOREGRESSIVE) -> None:
    """Set ``speedup`` = tokens/s / the baseline strategy's tokens/s in the same cell
    (``metric_names.CellKey`` with the baseline as strategy) and repeat; where the baseline
    has not run that repeat (a racing round that dropped it, or runs it later), its pooled
    figure over the cell's earlier repeats (output tokens / summed wall time, as the cell
    table pools)."""
    same: dict[tuple, float] = {}
    pooled: dict[M.CellKey, list[tuple[float, float]]] = {}
    for s in summaries:
        if s.strategy == baseline and not math.isnan(s.output_tokens_per_s):
            key = M.CellKey.of(s)
            same[(key, s.repeat)] = s.output_tokens_per_s
            if s.duration_s > 0:
                pooled.setdefault(key, []).append((s.output_tokens_per_s * s.duration_s, s.duration_s))
    for s in summaries:
        key = M.CellKey.of(s).baseline(baseline)
        b = same.get((key, s.repeat))
        if b is None and pooled.get(key):
            b = sum(t for t, _ in pooled[key]) / sum(d for _, d in pooled[key])
        if b and not math.isnan(b) and b > 0 and not math.isnan(s.output_tokens_per_s):
            s.speedup = s.output_tokens_per_s / b


# --- console table -------------------------------------------------------------
# (header, value, explanation). Listed in the order shown; when the terminal is too
# narrow, columns are dropped from the end of DROP_ORDER (never cut). The full table
# is summary.csv (every CellSummary field) and the report's per-cell table.
def _num(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _pct_str(frac: float) -> str:
    return "-" if frac is None or math.isnan(frac) else f"{100 * frac:.0f}%"


def _users(s: CellSummary) -> str:
    return f"{s.users}" if s.arrival == "closed" else f"{s.rate_rps:g}/s"


CONSOLE_COLUMNS: tuple[tuple[str, Any, str], ...] = (
    ("strategy", lambda s: s.strategy, "decoding strategy (the request's model)"),
    ("tier", lambda s: s.tier, "load tier (configs/tiers.yaml)"),
    ("out", lambda s: s.output_class + ("" if s.sampling == M.GREEDY else f"/{s.sampling}"),
     "output class: short or long max_tokens (/t0.7: its sampling setting; none shown: greedy)"),
    ("users", _users, "requested concurrency (closed loop) or arrival rate (open loop, req/s)"),
    ("conc", lambda s: _num(s.achieved_concurrency, ".1f"),
     "achieved concurrency: time-weighted mean of requests in flight"),
    ("ok/total", lambda s: f"{s.n_ok}/{s.n_requests}", "successful / all requests of the cell"),
    ("tok/s", lambda s: _num(s.output_tokens_per_s, ".1f"),
     "output tokens/s of ok requests over the cell (first scheduled send to last end)"),
    ("speedup", lambda s: _num(s.speedup, ".2f") + ("x" if not math.isnan(s.speedup) else ""),
     "tok/s / autoregressive's tok/s in the same tier and output class"),
    ("TTFT", lambda s: _num(s.ttft_ms_p50, ".0f"), "time to first token, p50, ms"),
    ("TPOT", lambda s: _num(s.tpot_ms_p50, ".1f"), "time per output token after the first, p50, ms"),
    ("TPOT avg", lambda s: _num(s.tpot_ms_mean, ".1f") + ("*" if not math.isnan(s.tpot_mode_low_ms) else ""),
     "TPOT mean, ms (* = bimodal: the two modes are in summary.csv and the warnings)"),
    ("SLO", lambda s: _pct_str(s.slo_attainment), "share of requests meeting both the TTFT and TPOT SLOs"),
    ("tau", lambda s: _num(s.acceptance_length, ".2f"),
     "acceptance length: tokens per verification step (1.00 = no speculation, - = not reported)"),
    ("CPU%", lambda s: _num(s.cpu_mean_percent, ".0f"),
     "the load generator's own CPU, mean % of one core (> 90 inflates latencies: use --workers)"),
)
DROP_ORDER = ("conc", "users", "CPU%", "TPOT avg", "TPOT", "SLO", "tau", "ok/total", "TTFT", "speedup")  # first dropped first


def _table(summaries: list[CellSummary], headers: list[str]):
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1),
              collapse_padding=True, title="per strategy x cell", title_justify="left")
    cols = [c for c in CONSOLE_COLUMNS if c[0] in headers]
    for name, fn, _ in cols:
        left = name in ("strategy", "tier", "out")
        # numbers never shrink (min_width = the longest value); were the terminal narrower
        # still, text folds onto a second line instead of being cut with an ellipsis
        t.add_column(name, justify="left" if left else "right", overflow="fold",
                     min_width=None if name == "strategy" else max(
                         [len(name)] + [len(fn(s)) for s in summaries]))
    for s in summaries:
        t.add_row(*(fn(s) for _, fn, _ in cols))
    return t


def table_width(table) -> int:
    """Columns a rich table needs when nothing is shrunk."""
    from rich.console import Console

    return Console(width=10_000, file=open(os.devnull, "w")).measure(table).maximum


def render_table(summaries: list[CellSummary], max_width: int = 100):
    """A rich Table of the key columns that fits ``max_width`` terminal columns.

    Columns are dropped in ``DROP_ORDER`` until the table fits; numbers are never
    shrunk or cut (``no_wrap``, ``min_width`` = the longest value). Returns
    (table, shown headers).
    """
    headers = [c[0] for c in CONSOLE_COLUMNS]
    table = _table(summaries, headers)
    for name in DROP_ORDER:
        if table_width(table) <= max_width:
            break
        headers.remove(name)
        table = _table(summaries, headers)
    return table, headers


def legend(headers: list[str]) -> str:
    """One ``header: explanation`` clause per shown column."""
    return "; ".join(f"{name}: {text}" for name, _, text in CONSOLE_COLUMNS
                     if name in headers and name not in ("strategy", "tier", "out")) + "."


# --- summary.csv -------------------------------------------------------------------
# server_metrics keys flattened into summary.csv as server_<key> (the manifest has them all)
SERVER_CSV_KEYS = (M.SRV_NUM_DRAFTS, M.SRV_NUM_DRAFT_TOKENS, M.SRV_NUM_ACCEPTED_TOKENS,
                   M.SRV_NUM_ACCEPTED_PER_POS, M.ACCEPTANCE_LENGTH, M.SRV_PROMPT_TOKENS,
                   M.SRV_GENERATION_TOKENS, M.SRV_REQUESTS_FINISHED, M.SRV_ENGINE_STEPS, M.SRV_STEP_TOKENS,
                   f"{M.SRV_RUNNING}_mean", f"{M.SRV_RUNNING}_max", f"{M.SRV_WAITING}_mean",
                   f"{M.SRV_WAITING}_max", f"{M.SRV_KV_USAGE}_max", M.SRV_PREEMPTIONS, "counter_resets",
                   "samples", "unattributed_drafts", "unattributed_requests")
SERVER_CSV_PREFIX = "server_"


def csv_columns() -> list[str]:
    """summary.csv's columns: every CellSummary field (by_status flattened to status_<name>,
    server_metrics to server_<key>)."""
    names = [f.name for f in dataclasses.fields(CellSummary)
             if f.name not in ("by_status", "warnings", "workers", "server_metrics")]   # per-worker stats: manifest.json
    return (names + [f"status_{st}" for st in M.REQ_STATUSES]
            + [SERVER_CSV_PREFIX + k for k in SERVER_CSV_KEYS] + ["warnings"])


def write_csv(path: Path, summaries: list[CellSummary]) -> Path:
    """Write ``summary.csv`` (one row per strategy x cell, every field) atomically.

    Undefined numbers are empty cells; warnings are joined with `` | ``.
    """
    cols = csv_columns()
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for s in summaries:
            d = dataclasses.asdict(s)
            row = []
            for c in cols:
                if c.startswith("status_"):
                    v: Any = s.by_status.get(c[len("status_"):], 0)
                elif c.startswith(SERVER_CSV_PREFIX):
                    v = (s.server_metrics or {}).get(c[len(SERVER_CSV_PREFIX):])
                    if isinstance(v, list):
                        v = " ".join(str(x) for x in v)   # per-position counts, position 0 first
                elif c == "warnings":
                    v = " | ".join(s.warnings)
                else:
                    v = d[c]
                if v is None or (isinstance(v, float) and math.isnan(v)):
                    v = ""
                elif isinstance(v, float):
                    v = repr(v)   # full precision: a rounded CSV value would round again differently
                row.append(v)
            w.writerow(row)
    os.replace(tmp, path)
    return Path(path)


# --- progress lines ------------------------------------------------------------------
def clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def cell_line(index: int, total: int, s: CellSummary, elapsed_s: float, eta_s: float | None,
              at_most: bool = False) -> str:
    """One plain line for a finished cell (logs, CI, and above the live bar in a terminal).

    ``at_most``: ``total`` is an upper bound (``--sweep`` stops early), and so is the ETA.
    """
    eta = (f", ETA {'at most ' if at_most else ''}{clock(eta_s)}" if eta_s is not None and index < total
           else "")
    key = M.CellKey(s.strategy, s.tier, s.output_class, s.sampling, s.users if s.tier == "sweep" else None)
    rep = f" r{s.repeat}" if s.repeat else ""
    return (f"cell {index}/{total}{' max' if at_most else ''} {key.label()}{rep}: ok {s.n_ok}/{s.n_requests}, "
            f"{_num(s.output_tokens_per_s, '.1f')} tok/s, speedup {_num(s.speedup, '.2f')}, "
            f"TTFT p50 {_num(s.ttft_ms_p50, '.0f')} ms, SLO {_pct_str(s.slo_attainment)} "
            f"[{clock(elapsed_s)} elapsed{eta}]")


def eta_seconds(done: int, total: int, elapsed_s: float, planned_cell_s: float) -> float:
    """Remaining time: cells left x the mean measured cell time (the planned time before any)."""
    per_cell = elapsed_s / done if done else planned_cell_s
    return max(0, total - done) * per_cell


# --- the run's per-cell table (after the run) -------------------------------------------
# (header, cell-table column or callable, explanation): one row per strategy x cell, its
# repeats pooled, from the rows and the function the report uses (analysis.report.build.prepare:
# warm-up cut, SLO flags, analysis.data.metrics.cell_table), so every number here is the
# report's and the answer's.
CELL_COLUMNS: tuple[tuple[str, Any, str], ...] = (
    ("strategy", M.REQ_STRATEGY, "decoding strategy (the request's model)"),
    ("tier", M.REQ_TIER, "load tier"),
    ("out", lambda r: r[M.REQ_OUTPUT_CLASS] + ("" if r.get(M.REQ_SAMPLING) in (None, M.GREEDY)
                                                else f"/{r[M.REQ_SAMPLING]}"),
     "output class (/t0.7: its sampling setting)"),
    ("users", lambda r: f"{int(r[M.REQ_USERS])}", "concurrency"),
    ("reps", lambda r: f"{int(r.get('replicates') or 1)}", "cell runs pooled (repeats, the A/A included)"),
    ("tok/s", lambda r: _num(r.get(M.CELL_OUTPUT_TOKENS_PER_S), ".1f"),
     "output tokens/s of ok requests over the cell runs' summed wall time, warm-up cut"),
    ("speedup", lambda r: _num(r.get(M.CELL_SPEEDUP), ".2f"), "tok/s over autoregressive's, same cell"),
    ("goodput", lambda r: _num(r.get(M.CELL_GOODPUT_TOKENS_PER_S), ".1f"),
     "output tokens/s of requests meeting both SLOs"),
    ("TTFT", lambda r: _num(r.get("ttft_ms_p50"), ".0f"), "TTFT p50, ms"),
    ("TPOT", lambda r: _num(r.get("tpot_ms_p50"), ".1f"), "TPOT p50, ms"),
    ("tau", lambda r: _num(r.get(M.ACCEPTANCE_LENGTH), ".2f"), "acceptance length (tokens per step)"),
)


def render_cell_table(cells: "Any", max_width: int = 100):
    """A rich Table of the run's cell table (``analysis.report.build.prepare``), one row per
    strategy x cell, cells low -> high; columns dropped from the right end until it fits.
    Returns (table, shown headers)."""
    from rich import box
    from rich.table import Table

    from analysis.decide.recommend import cell_order

    rows = sorted(cells.to_dict("records"), key=lambda r: (
        cell_order((str(r[M.REQ_TIER]), str(r[M.REQ_OUTPUT_CLASS]))), str(r.get(M.REQ_SAMPLING)),
        str(r[M.REQ_STRATEGY])))
    headers = [c[0] for c in CELL_COLUMNS]

    def build(names):
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1),
                  collapse_padding=True, title="per strategy x cell (repeats pooled)",
                  title_justify="left")
        cols = [c for c in CELL_COLUMNS if c[0] in names]
        for name, _, _ in cols:
            t.add_column(name, justify="left" if name in ("strategy", "tier", "out") else "right",
                         no_wrap=True)
        for r in rows:
            t.add_row(*[str(r.get(fn)) if isinstance(fn, str) else fn(r) for _, fn, _ in cols])
        return t

    table = build(headers)
    for name in ("tau", "TPOT", "TTFT", "goodput", "users"):
        if table_width(table) <= max_width:
            break
        headers.remove(name)
        table = build(headers)
    return table, headers


def cell_legend(headers: list[str]) -> str:
    """One ``header: explanation`` clause per shown column of ``render_cell_table``."""
    return "; ".join(f"{name}: {text}" for name, _, text in CELL_COLUMNS
                     if name in headers and name not in ("strategy", "tier", "out")) + "."
