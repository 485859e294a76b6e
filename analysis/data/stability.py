"""Stability: how much a cell's figures move between repeats, over time and across inputs.

- Repeats. A replicate of a cell is one (run_id, repeat) pair: ``python -m
  loadgen --repeats K`` writes the integer request column ``repeat`` (0-based);
  runs without it count as repeat 0, so several run directories loaded
  together are replicates too. Per replicate: output tokens/s (ok tokens over
  the replicate's wall time, first scheduled send to last end, as
  ``analysis.data.metrics``), TPOT p50 and pooled tau. Across replicates: mean,
  95 % confidence interval of the mean (Student's t, n - 1 degrees of
  freedom: mean +- t_{0.975, n-1} * s / sqrt(n)) and coefficient of variation
  CV = s / mean (s: sample standard deviation). A cell whose CV exceeds
  ``CV_THRESHOLD`` (10 %) on any of the three is flagged.
- Warm-up. ``apply_warmup`` drops requests scheduled in the first
  ``warmup_s`` seconds of each replicate (and engine steps of that window).
- Over time. ``throughput_over_time``: output tokens of ok requests binned by
  end time, per replicate, in seconds since the replicate's first send.
- Inputs. ``acceptance_by_dataset``: the distribution of per-request
  acceptance length per strategy and prompt source (``humaneval``, ``docs``,
  ``stdlib`` or the dataset name): which inputs make a strategy unstable.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.data.dimensions import with_sampling
from configs import metric_names as mn

REPEAT = getattr(mn, "REQ_REPEAT", "repeat")   # integer request column, 0-based
CV_THRESHOLD = 0.10
CONFIDENCE = 0.95
CELL = list(mn.CELL_KEY)
REPLICATE = CELL + [mn.REQ_RUN_ID, REPEAT]
STABILITY_METRICS = ("output_tokens_per_s", "tpot_ms_p50", mn.ACCEPTANCE_LENGTH)


def with_repeat(requests: pd.DataFrame) -> pd.DataFrame:
    """Copy with an integer ``repeat`` column (0 where the load generator wrote none) and a
    ``sampling`` label (``greedy`` where none: ``analysis.data.dimensions.with_sampling``)."""
    df = with_sampling(requests).copy()
    if REPEAT not in df.columns:
        df[REPEAT] = 0
    df[REPEAT] = pd.to_numeric(df[REPEAT], errors="coerce").fillna(0).astype(int)
    return df


def t_interval(values, confidence: float = CONFIDENCE) -> dict:
    """Mean and its two-sided Student-t confidence interval over replicate values.

    Returns {"n", "mean", "std" (sample, ddof 1), "half_width", "low", "high",
    "cv" (std / |mean|)}; NaN values are ignored; with n < 2 the spread is NaN.
    """
    from scipy import stats

    x = np.asarray([v for v in values if v is not None and not pd.isna(v)], dtype=float)
    n = int(x.size)
    mean = float(x.mean()) if n else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "std": math.nan, "half_width": math.nan,
                "low": math.nan, "high": math.nan, "cv": math.nan}
    std = float(x.std(ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    cv = std / abs(mean) if mean else math.nan
    return {"n": n, "mean": mean, "std": std, "half_width": half, "low": mean - half,
            "high": mean + half, "cv": cv}


def _replicate_row(g: pd.DataFrame) -> dict:
    start, end = g[mn.REQ_SCHEDULED_TS].min(), g[mn.REQ_END_TS].max()
    duration = float(end - start) if pd.notna(start) and pd.notna(end) else math.nan
    ok = g[g[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    drafts = ok[mn.NUM_DRAFTS].sum(min_count=1)
    tau = (mn.acceptance_length(int(drafts), int(ok[mn.NUM_ACCEPTED_TOKENS].sum()))
           if pd.notna(drafts) else math.nan)
    tpot = ok[mn.REQ_TPOT_MS].dropna()
    return {"n_ok": len(ok), "duration_s": duration,
            "output_tokens_per_s": ok[mn.REQ_OUTPUT_TOKENS].sum() / duration if duration > 0 else math.nan,
            "tpot_ms_p50": float(tpot.median()) if len(tpot) else math.nan,
            mn.ACCEPTANCE_LENGTH: tau}


def replicate_table(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per cell replicate (``REPLICATE`` keys) with the three stability metrics."""
    df = with_repeat(requests)
    rows = [dict(zip(REPLICATE, key), **_replicate_row(g))
            for key, g in df.groupby(REPLICATE, sort=True)]
    return pd.DataFrame(rows, columns=REPLICATE + ["n_ok", "duration_s", *STABILITY_METRICS])


def stability_table(requests: pd.DataFrame, cv_threshold: float = CV_THRESHOLD,
                    confidence: float = CONFIDENCE) -> pd.DataFrame:
    """Per cell: replicates, and for each metric mean, 95 % half-width and CV; ``flagged``
    when any CV exceeds ``cv_threshold`` (``flag_reason`` names them)."""
    reps = replicate_table(requests)
    rows = []
    for key, g in reps.groupby(CELL, sort=True):
        row = dict(zip(CELL, key))
        row["replicates"] = len(g)
        reasons = []
        for m in STABILITY_METRICS:
            ci = t_interval(g[m], confidence)
            row[f"{m}_mean"], row[f"{m}_ci95"], row[f"{m}_cv"] = ci["mean"], ci["half_width"], ci["cv"]
            if not math.isnan(ci["cv"]) and ci["cv"] > cv_threshold:
                reasons.append(f"{m} CV {ci['cv']:.0%}")
        row["flagged"] = bool(reasons)
        row["flag_reason"] = "; ".join(reasons)
        rows.append(row)
    cols = CELL + ["replicates"] + [f"{m}_{s}" for m in STABILITY_METRICS
                                     for s in ("mean", "ci95", "cv")] + ["flagged", "flag_reason"]
    return pd.DataFrame(rows, columns=cols)


def replicate_starts(requests: pd.DataFrame) -> pd.DataFrame:
    """First scheduled send (unix s) of every replicate: REPLICATE keys + ``t0``."""
    df = with_repeat(requests)
    return (df.groupby(REPLICATE, sort=True)[mn.REQ_SCHEDULED_TS].min()
            .rename("t0").reset_index())


def apply_warmup(requests: pd.DataFrame, steps: pd.DataFrame, warmup_s: float
                 ) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """Drop requests scheduled within ``warmup_s`` s of their replicate's first send,
    and step rows of the same strategy/tier/output class logged in that window. A
    replicate whose every request falls in the window (a cell shorter than one request per
    user) is kept whole: the cut never makes a strategy vanish from a cell.

    Returns (requests, steps, requests dropped). Raises ValueError for warmup_s < 0.
    """
    if warmup_s < 0:
        raise ValueError(f"warmup_s must be >= 0 seconds, got {warmup_s!r}")
    if not warmup_s or requests.empty:
        return requests, steps, 0
    df = with_repeat(requests)
    starts = replicate_starts(df)
    t0 = df.merge(starts, on=REPLICATE, how="left")["t0"].to_numpy()
    keep = ~(df[mn.REQ_SCHEDULED_TS].to_numpy() < t0 + warmup_s)
    any_kept = pd.Series(keep, index=df.index).groupby([df[k] for k in REPLICATE]).transform("any")
    keep = keep | ~any_kept.to_numpy()
    kept = requests.loc[keep]
    if steps is not None and not steps.empty and mn.REQ_TIER in steps.columns:
        drop = np.zeros(len(steps), dtype=bool)
        ts = pd.to_numeric(steps[mn.STEP_TS], errors="coerce").to_numpy()
        for _, s in starts.iterrows():
            in_cell = (steps[mn.STEP_STRATEGY].eq(s[mn.REQ_STRATEGY]).to_numpy()
                       & steps[mn.REQ_TIER].eq(s[mn.REQ_TIER]).to_numpy()
                       & steps[mn.REQ_OUTPUT_CLASS].eq(s[mn.REQ_OUTPUT_CLASS]).to_numpy()
                       & (steps[mn.REQ_SAMPLING].eq(s[mn.REQ_SAMPLING]).to_numpy()
                          if mn.REQ_SAMPLING in steps.columns else True))
            drop |= in_cell & (ts >= s["t0"]) & (ts < s["t0"] + warmup_s)
        steps = steps.loc[~drop]
    return kept, steps, int((~keep).sum())


def throughput_over_time(requests: pd.DataFrame, bin_s: float | None = None,
                         n_bins: int = 20) -> pd.DataFrame:
    """Output tokens/s per time bin and replicate: columns REPLICATE + ``t_s`` (bin
    start, seconds since the replicate's first send), ``bin_s``, ``tokens_per_s``.

    bin_s: bin width; default each replicate's wall time / ``n_bins`` (>= 0.25 s).
    """
    df = with_repeat(requests)
    ok = df[df[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    starts = {tuple(r[:-1]): r[-1] for r in replicate_starts(df).itertuples(index=False)}
    rows = []
    for key, g in ok.groupby(REPLICATE, sort=True):
        t0 = starts[key]
        rel = (g[mn.REQ_END_TS] - t0).to_numpy(dtype=float)
        span = float(np.nanmax(rel)) if rel.size else 0.0
        width = bin_s or max(span / n_bins, 0.25)
        edges = np.arange(0.0, span + width, width)
        if edges.size < 2:
            edges = np.array([0.0, width])
        hist, _ = np.histogram(rel, bins=edges, weights=g[mn.REQ_OUTPUT_TOKENS].to_numpy(dtype=float))
        for t, tokens in zip(edges[:-1], hist):
            rows.append(dict(zip(REPLICATE, key), t_s=float(t), bin_s=float(width),
                             tokens_per_s=float(tokens) / width))
    return pd.DataFrame(rows, columns=REPLICATE + ["t_s", "bin_s", "tokens_per_s"])


def drift_table(over_time: pd.DataFrame) -> pd.DataFrame:
    """Per replicate: tokens/s of the first and second half of its bins and the drift
    (second - first) / first, a sign of warm-up (> 0) or slow-down (< 0)."""
    rows = []
    for key, g in over_time.groupby(REPLICATE, sort=True):
        v = g.sort_values("t_s")["tokens_per_s"].to_numpy()
        if v.size < 4:
            continue
        h = v.size // 2
        first, second = float(v[:h].mean()), float(v[h:].mean())
        rows.append(dict(zip(REPLICATE, key), first_half_tokens_per_s=first,
                         second_half_tokens_per_s=second,
                         drift=(second - first) / first if first else math.nan))
    return pd.DataFrame(rows, columns=REPLICATE + ["first_half_tokens_per_s",
                                                   "second_half_tokens_per_s", "drift"])


def prompt_source(requests: pd.DataFrame) -> pd.Series:
    """Prompt source per request: the prompt_id prefix before '/' (humaneval, docs,
    stdlib in the named datasets), else the dataset column."""
    pid = requests[mn.REQ_PROMPT_ID].astype("string") if mn.REQ_PROMPT_ID in requests else None
    ds = requests[mn.REQ_DATASET].astype(str)
    if pid is None:
        return ds
    prefix = pid.str.split("/", n=1).str[0]
    has = pid.str.contains("/", regex=False).fillna(False).astype(bool)
    return prefix.where(has, ds).fillna(ds).astype(str)


def acceptance_by_dataset(flagged: pd.DataFrame) -> pd.DataFrame:
    """Per strategy x prompt source: per-request acceptance length n, mean, std, CV and
    p10 / p50 / p90 (ok requests that drafted; autoregressive has none)."""
    df = flagged[flagged[mn.REQ_STATUS].eq(mn.STATUS_OK) & flagged[mn.NUM_DRAFTS].gt(0)].copy()
    cols = [mn.REQ_STRATEGY, "source", "n", "tau_mean", "tau_std", "tau_cv", "tau_p10",
            "tau_p50", "tau_p90"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    df["source"] = prompt_source(df)
    tau = 1.0 + df[mn.NUM_ACCEPTED_TOKENS] / df[mn.NUM_DRAFTS]
    df["_tau"] = tau
    rows = []
    for (strategy, src), g in df.groupby([mn.REQ_STRATEGY, "source"], sort=True):
        x = g["_tau"].to_numpy(dtype=float)
        std = float(x.std(ddof=1)) if x.size > 1 else math.nan
        rows.append({mn.REQ_STRATEGY: strategy, "source": src, "n": int(x.size),
                     "tau_mean": float(x.mean()), "tau_std": std,
                     "tau_cv": std / float(x.mean()) if x.size > 1 else math.nan,
                     "tau_p10": float(np.percentile(x, 10)), "tau_p50": float(np.percentile(x, 50)),
                     "tau_p90": float(np.percentile(x, 90))})
    return pd.DataFrame(rows, columns=cols)
