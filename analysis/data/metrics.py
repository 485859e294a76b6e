"""Per-cell request metrics: throughput, speedup, latency percentiles, goodput,
acceptance length and per-position acceptance.

A cell is (run_id, strategy, tier, output_class, sampling, users): ``CELL_KEYS``. Definitions follow
docs/design.md "Metric definitions":

- output tokens/s = sum of ``ok`` requests' output tokens / cell wall time, the
  wall time running from the first scheduled send to the last response end (summed over repeats)
  (scheduled, not actual, send time: no coordinated omission).
- speedup = strategy tokens/s / ``autoregressive`` tokens/s, same run, tier,
  output class, sampling label and users.
- goodput = requests/s and output tokens/s of ``ok`` requests meeting every SLO
  (DistServe, Zhong et al. 2024, section 2).
- acceptance length tau = 1 + accepted / drafts (tokens per verification step).
- per-position acceptance: unconditional = accepted at i / drafts (vLLM
  ``SpecDecodingStats``); conditional = accepted at i / accepted at i-1 (DFlash 2,
  DSpark papers).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.data.dimensions import with_sampling
from configs import metric_names as mn
from configs.tiers import Slo
from analysis.data.distribution import bimodality

CELL_KEYS = [mn.REQ_RUN_ID, *mn.CELL_KEY]   # configs/metric_names.py CELL_KEY: sampling label included
# per-deployment attributes carried into the cell table (analysis.data.load adds them)
BASE_STRATEGY, K, CANDIDATES = "base_strategy", "k", "top_k_candidates"
SYNTHETIC_AL = "synthetic_acceptance_length"   # --acceptance-length (NaN: a real deployment)
CELL_ATTRS = (BASE_STRATEGY, K, CANDIDATES, SYNTHETIC_AL, mn.REQ_TEMPERATURE)
PERCENTILES = (50, 90, 99)
# Derived column names: the one per-cell scheme of configs/metric_names.py (CELL_*),
# shared with the load generator's live summary and summary.csv.
OUTPUT_TOKENS_PER_S = mn.CELL_OUTPUT_TOKENS_PER_S
SPEEDUP = mn.CELL_SPEEDUP
GOODPUT_TOKENS_PER_S = mn.CELL_GOODPUT_TOKENS_PER_S
GOODPUT_RPS = mn.CELL_GOODPUT_RPS
SLO_ATTAINMENT = mn.CELL_SLO_ATTAINMENT
DURATION_S = mn.CELL_DURATION_S
GOOD = "meets_slo"
REPLICATES = "replicates"   # cell runs (repeats) pooled into a cell-table row


def meets_slo(requests: pd.DataFrame, slos: dict[str, Slo]) -> pd.Series:
    """Boolean per request: ``ok`` and TTFT <= SLO and TPOT <= SLO for its tier.

    A one-token output has no TPOT (NaN); it is judged on TTFT alone.
    """
    ttft_slo = requests[mn.REQ_TIER].map(lambda t: slos[t].ttft_ms)
    tpot_slo = requests[mn.REQ_TIER].map(lambda t: slos[t].tpot_ms)
    ok = requests[mn.REQ_STATUS].eq("ok")
    ttft_ok = requests[mn.REQ_TTFT_MS].le(ttft_slo)
    no_tpot = requests[mn.REQ_TPOT_MS].isna() & requests[mn.REQ_OUTPUT_TOKENS].le(1)
    tpot_ok = requests[mn.REQ_TPOT_MS].le(tpot_slo) | no_tpot
    return (ok & ttft_ok & tpot_ok).astype(bool)


def request_tau(requests: pd.DataFrame) -> pd.Series:
    """Per-request acceptance length tau = 1 + accepted / drafts; NaN without stats."""
    drafts = requests[mn.NUM_DRAFTS]
    tau = 1.0 + requests[mn.NUM_ACCEPTED_TOKENS] / drafts.where(drafts > 0)
    # A request that drafted nothing (autoregressive) emits one token per step.
    return tau.where(~drafts.eq(0), 1.0)


def pooled_tau(requests: pd.DataFrame) -> float:
    """Token-weighted tau over requests: 1 + sum(accepted) / sum(drafts); NaN if unknown."""
    drafts = requests[mn.NUM_DRAFTS].sum(min_count=1)
    if pd.isna(drafts):
        return float("nan")
    # drafts reported without an accepted count (an engine key spelling not read): not
    # reported, never 1.0 (loadgen.results.summary says so in the cell's warnings)
    if (requests[mn.NUM_DRAFTS].fillna(0).gt(0) & requests[mn.NUM_ACCEPTED_TOKENS].isna()).any():
        return float("nan")
    return mn.acceptance_length(int(drafts), int(requests[mn.NUM_ACCEPTED_TOKENS].sum()))


def with_slo_flags(requests: pd.DataFrame, slos: dict[str, Slo]) -> pd.DataFrame:
    """Copy of the requests with ``meets_slo`` and per-request ``acceptance_length``."""
    df = requests.copy()
    df[GOOD] = meets_slo(df, slos)
    df[mn.ACCEPTANCE_LENGTH] = request_tau(df)
    return df


def _wall_time_s(g: pd.DataFrame) -> float:
    """A cell's wall time, s: first scheduled send to last end, summed over its repeats (the
    repeats of a raced run are interleaved with other cells: the time between them is not
    this cell's)."""
    rep = getattr(mn, "REQ_REPEAT", "repeat")
    parts = g.groupby(rep, sort=False) if rep in g.columns and g[rep].nunique() > 1 else [(0, g)]
    total = 0.0
    for _, p in parts:
        start, end = p[mn.REQ_SCHEDULED_TS].min(), p[mn.REQ_END_TS].max()
        if not (pd.notna(end) and pd.notna(start)):
            return float("nan")
        total += float(end - start)
    return total


def _cell_row(g: pd.DataFrame) -> dict:
    duration = _wall_time_s(g)
    ok = g[g[mn.REQ_STATUS].eq("ok")]
    good = g[g[GOOD]]
    rep = mn.REQ_REPEAT
    row = {
        mn.CELL_N_REQUESTS: len(g), mn.CELL_N_OK: len(ok), DURATION_S: duration,
        REPLICATES: int(g[rep].nunique()) if rep in g.columns else 1,
        OUTPUT_TOKENS_PER_S: ok[mn.REQ_OUTPUT_TOKENS].sum() / duration if duration > 0 else np.nan,
        GOODPUT_TOKENS_PER_S: good[mn.REQ_OUTPUT_TOKENS].sum() / duration if duration > 0 else np.nan,
        GOODPUT_RPS: len(good) / duration if duration > 0 else np.nan,
        SLO_ATTAINMENT: len(good) / len(g) if len(g) else np.nan,
        "e2e_ms_mean": ok[mn.REQ_E2E_MS].mean(),
        "output_tokens_mean": ok[mn.REQ_OUTPUT_TOKENS].mean(),
        "prompt_tokens_mean": ok[mn.REQ_PROMPT_TOKENS].mean(),
        mn.ACCEPTANCE_LENGTH: pooled_tau(ok),
        mn.CELL_DEGRADED_REQUESTS: (int(g[mn.DEGRADED_REASON].fillna("").astype(str).ne("").sum())
                                    if mn.DEGRADED_REASON in g else 0),
    }
    for name, col in (("ttft_ms", mn.REQ_TTFT_MS), ("tpot_ms", mn.REQ_TPOT_MS),
                      ("e2e_ms", mn.REQ_E2E_MS)):
        vals = ok[col].dropna().to_numpy(dtype=float)
        for p in PERCENTILES:
            row[mn.percentile_name(name, p)] = float(np.percentile(vals, p)) if vals.size else np.nan
    for name, col in (("ttft_ms", mn.REQ_TTFT_MS), ("tpot_ms", mn.REQ_TPOT_MS)):
        row[f"{name}_mean"] = float(ok[col].mean()) if ok[col].notna().any() else np.nan
    row.update(_itl_figures(ok))
    bi = bimodality(ok[mn.REQ_TPOT_MS].dropna().astype(float).tolist())
    row[mn.CELL_TPOT_BIMODALITY] = bi["bc"]
    row["tpot_mode_low_ms"] = bi["low_mode"] if bi["bimodal"] else np.nan
    row["tpot_mode_high_ms"] = bi["high_mode"] if bi["bimodal"] else np.nan
    taus = ok[mn.ACCEPTANCE_LENGTH].dropna().to_numpy(dtype=float)
    for p in (10, 50, 90):
        row[f"tau_p{p}"] = float(np.percentile(taus, p)) if taus.size else np.nan
    return row


def _itl_figures(ok: pd.DataFrame) -> dict:
    """The cell's ITL as loadgen.results.summary gives it (docs/metrics.md): per token only
    when every ok request with gaps had per-chunk token counts (``itl_source``); then the
    token-weighted mean and the median over requests of each request's p50 / p90 / p99.
    Otherwise ``itl_kind`` "chunk", no per-token figure, and the chunk gaps. Runs before
    schema 9 (no ``itl_source``) keep the old reading: p50 / p90 over requests' median ITL,
    p99 over their p99."""
    col = lambda c: ok[c] if c in ok else pd.Series(np.nan, index=ok.index)   # noqa: E731
    src = col(mn.REQ_ITL_SOURCE)
    out = {mn.CELL_ITL_MS_MEAN: np.nan, mn.CELL_ITL_MS_P50: np.nan, mn.CELL_ITL_MS_P90: np.nan,
           mn.CELL_ITL_MS_P99: np.nan, mn.CELL_ITL_KIND: None, mn.CELL_TOKENS_PER_CHUNK: np.nan,
           mn.CELL_CHUNK_GAP_MS_P50: np.nan}
    if src.isna().all():   # before schema 9
        itl50 = col(mn.REQ_ITL_P50_MS).dropna().to_numpy(dtype=float)
        itl99 = col(mn.REQ_ITL_P99_MS).dropna().to_numpy(dtype=float)
        out[mn.CELL_ITL_MS_P50] = float(np.percentile(itl50, 50)) if itl50.size else np.nan
        out[mn.CELL_ITL_MS_P90] = float(np.percentile(itl50, 90)) if itl50.size else np.nan
        out[mn.CELL_ITL_MS_P99] = float(np.percentile(itl99, 99)) if itl99.size else np.nan
        return out
    g = ok[src.notna()]
    later = (g[mn.REQ_NUM_CHUNKS].astype(float) - 1).clip(lower=0)
    tpc = g[mn.REQ_TOKENS_PER_CHUNK].astype(float)
    if later[tpc.notna()].sum() > 0:
        out[mn.CELL_TOKENS_PER_CHUNK] = float((tpc * later)[tpc.notna()].sum() / later[tpc.notna()].sum())
    gaps = g[mn.REQ_CHUNK_GAP_P50_MS].dropna().to_numpy(dtype=float)
    out[mn.CELL_CHUNK_GAP_MS_P50] = float(np.percentile(gaps, 50)) if gaps.size else np.nan
    if g[mn.REQ_ITL_SOURCE].eq(mn.ITL_SOURCE_CHUNKS).any():
        out[mn.CELL_ITL_KIND] = "chunk"
        return out
    out[mn.CELL_ITL_KIND] = "per_token"
    for name, c in ((mn.CELL_ITL_MS_P50, mn.REQ_ITL_P50_MS), (mn.CELL_ITL_MS_P90, mn.REQ_ITL_P90_MS),
                    (mn.CELL_ITL_MS_P99, mn.REQ_ITL_P99_MS)):
        v = g[c].dropna().to_numpy(dtype=float)
        out[name] = float(np.percentile(v, 50)) if v.size else np.nan
    w = (g[mn.REQ_OUTPUT_TOKENS].astype(float) - 1).clip(lower=0)
    m = g[mn.REQ_ITL_MEAN_MS].astype(float)
    if w[m.notna()].sum() > 0:
        out[mn.CELL_ITL_MS_MEAN] = float((m * w)[m.notna()].sum() / w[m.notna()].sum())
    return out


def cell_table(flagged: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (``CELL_KEYS``) from ``with_slo_flags`` output, with speedup.

    Speedup is NaN where the same run/tier/output class/users has no
    ``autoregressive`` cell.
    """
    flagged = with_sampling(flagged)
    attrs = [c for c in CELL_ATTRS if c in flagged.columns]
    rows = [dict(zip(CELL_KEYS, key), **{c: g[c].iloc[0] for c in attrs}, **_cell_row(g))
            for key, g in flagged.groupby(CELL_KEYS, sort=True, dropna=False)]
    cells = pd.DataFrame(rows)
    ar = cells[cells[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE)]
    base_keys = [k for k in CELL_KEYS if k != mn.REQ_STRATEGY]
    ar = ar[base_keys + [OUTPUT_TOKENS_PER_S]].rename(columns={OUTPUT_TOKENS_PER_S: "_ar_tps"})
    cells = cells.merge(ar, on=base_keys, how="left")
    cells[SPEEDUP] = cells[OUTPUT_TOKENS_PER_S] / cells["_ar_tps"]
    return cells.drop(columns="_ar_tps")


def _stack_lists(series: pd.Series) -> np.ndarray:
    """Right-pad a column of lists to a 2-D float array [n_requests, max_len] (NaN pad)."""
    lists = [np.asarray(v, dtype=float) for v in series
             if isinstance(v, (list, tuple, np.ndarray)) and len(v) > 0]
    if not lists:
        return np.empty((0, 0))
    width = max(len(v) for v in lists)
    out = np.full((len(lists), width), np.nan)
    for i, v in enumerate(lists):
        out[i, :len(v)] = v
    return out


def per_position(requests: pd.DataFrame, by: str = mn.REQ_STRATEGY) -> pd.DataFrame:
    """Per-position acceptance per ``by`` group.

    Columns: ``by``, position (1-based draft position), accepted (count),
    uncond (accepted_i / drafts), cond (accepted_i / accepted_{i-1}, position 1
    divides by drafts). (Drafter top-k coverage is an offline measurement:
    ``python -m bench.acceptance``; load runs do not carry it.)
    """
    rows = []
    ok = requests[requests[mn.REQ_STATUS].eq("ok")]
    for key, g in ok.groupby(by, sort=True):
        counts = _stack_lists(g[mn.NUM_ACCEPTED_TOKENS_PER_POS])
        has_pos = g[mn.NUM_ACCEPTED_TOKENS_PER_POS].map(lambda v: isinstance(v, (list, tuple, np.ndarray)))
        drafts = g.loc[has_pos, mn.NUM_DRAFTS].sum()
        width = counts.shape[1]
        acc = np.nansum(counts, axis=0) if counts.size else np.zeros(0)
        prev = drafts
        for i in range(width):
            a = float(acc[i]) if i < acc.size else np.nan
            rows.append({by: key, "position": i + 1, "accepted": a,
                         "uncond": a / drafts if drafts else np.nan,
                         "cond": a / prev if prev else np.nan})
            prev = a
    return pd.DataFrame(rows, columns=[by, "position", "accepted", "uncond", "cond"])


# curves over users levels: one per strategy x output class x sampling label (a temperature's
# cells never mix into another's curve)
CURVE_KEY = [mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING]


def curve_tau(flagged: pd.DataFrame) -> pd.DataFrame:
    """Measured acceptance length per strategy x output class x sampling label (``pooled_tau``
    over the ok requests of every users level): the tau of the crossover table, measured under
    each sampling setting, never another setting's."""
    flagged = with_sampling(flagged)
    ok = flagged[flagged[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    rows = [(*key, pooled_tau(g)) for key, g in ok.groupby(CURVE_KEY, sort=True)]
    return pd.DataFrame(rows, columns=[*CURVE_KEY, "tau"])


def crossover_measured(cells: pd.DataFrame) -> pd.DataFrame:
    """Concurrency where speedup first falls below 1, per strategy x output class x sampling.

    Users levels are pooled across tiers and runs (mean speedup per level), then
    linearly interpolated in users between the last level with speedup >= 1
    and the first with speedup < 1. ``status``: ``crossed``, ``never`` (>= 1 at
    every measured level) or ``below_at_min`` (< 1 already at the lowest level;
    ``users`` is then that level).
    """
    rows = []
    cells = with_sampling(cells)
    spec = cells[~cells[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE) & cells[SPEEDUP].notna()]
    for (strategy, oc, samp), g in spec.groupby(CURVE_KEY, sort=True):
        curve = g.groupby(mn.REQ_USERS)[SPEEDUP].mean().sort_index()
        users, s = curve.index.to_numpy(dtype=float), curve.to_numpy(dtype=float)
        status, value = "never", None
        if s[0] < 1:
            status, value = "below_at_min", float(users[0])
        else:
            for i in range(1, len(s)):
                if s[i] < 1 <= s[i - 1]:
                    frac = (s[i - 1] - 1.0) / (s[i - 1] - s[i])
                    status, value = "crossed", float(users[i - 1] + frac * (users[i] - users[i - 1]))
                    break
        rows.append({mn.REQ_STRATEGY: strategy, mn.REQ_OUTPUT_CLASS: oc, mn.REQ_SAMPLING: samp,
                     "crossover_users": value, "status": status,
                     "levels": ", ".join(f"{int(u)}:{v:.2f}x" for u, v in zip(users, s))})
    return pd.DataFrame(rows, columns=[*CURVE_KEY, "crossover_users", "status", "levels"])


def throughput_latency_knee(cells: pd.DataFrame) -> pd.DataFrame:
    """Knee of each strategy x output class (x sampling) throughput-latency curve.

    The knee is the users level maximising Kleinrock's power = throughput /
    latency (Kleinrock 1979, "Power and deterministic rules of thumb"), with
    throughput in output tokens/s and latency the p50 end-to-end ms: past it,
    latency grows faster than throughput.
    """
    rows = []
    cells = with_sampling(cells)
    for (strategy, oc, samp), g in cells.groupby(CURVE_KEY, sort=True):
        curve = g.groupby(mn.REQ_USERS)[[OUTPUT_TOKENS_PER_S, "e2e_ms_p50"]].mean().sort_index()
        curve = curve.dropna()
        if curve.empty:
            continue
        power = curve[OUTPUT_TOKENS_PER_S] / curve["e2e_ms_p50"]
        knee = power.idxmax()
        rows.append({mn.REQ_STRATEGY: strategy, mn.REQ_OUTPUT_CLASS: oc, mn.REQ_SAMPLING: samp,
                     "knee_users": int(knee),
                     "knee_tokens_per_s": float(curve.loc[knee, OUTPUT_TOKENS_PER_S]),
                     "knee_e2e_ms_p50": float(curve.loc[knee, "e2e_ms_p50"])})
    return pd.DataFrame(rows, columns=[*CURVE_KEY, "knee_users",
                                       "knee_tokens_per_s", "knee_e2e_ms_p50"])
