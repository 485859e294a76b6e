"""The verification-cost surface (``python -m analysis surface RUN``, the report's section).

A run with ``python -m loadgen --acceptance-length A[,A...]`` measures every speculative
strategy at forced acceptance lengths (``rejection_sample_method: synthetic``: the drafter
and the verify forward run for real, only the accept decision is set), as deployments
``<strategy>[-k<K>]-al<A>`` beside ``autoregressive``. From them:

- ``surface_table``: tokens/s speedup vs autoregressive per (strategy, output class,
  sampling, users, k, A) with its interval: over repeats (a t interval on the repeats'
  speedups) where the cell was repeated, else over requests (a bootstrap of the requests
  of both cells, each cell's tokens/s scaled by the resampled tokens per second of request
  time: a ratio estimator, as ``analysis.decide.recommend``); ``interval_over`` says which.
- ``break_even_table``: per (strategy, output class, sampling, users, k) the acceptance
  length where the speedup crosses 1.0, by linear interpolation between the two measured
  A that bracket it (``"pays at every A"`` / ``"never pays up to <A max>"`` otherwise;
  "k+1" when that A max is k + 1).
- ``best_k_table``: per (strategy, output class, sampling, users, A) the k of the highest
  speedup.
- ``drafter_points``: every real speculative deployment's measured acceptance length and
  speedup per users level, and ``category_acceptance``: acceptance length per (strategy,
  category) with a bootstrap interval over requests: where each drafter, and each traffic
  class, stands against the break-even (DESIGN.md, "The verification-cost surface").
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.data.dimensions import SYNTHETIC_AL, is_synthetic
from analysis.data.metrics import SPEEDUP
from configs import metric_names as mn

SURFACE_FILE = "surface.csv"
BREAK_EVEN_FILE = "break_even.csv"
BEST_K_FILE = "best_k.csv"
DEFAULT_CONFIDENCE = 0.9
N_BOOT = 1000
A = "acceptance_length_set"            # the forced A of the deployment
A_MEASURED = "acceptance_length_measured"   # what the synthetic deployment delivered
LINE = ["base_strategy", mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING]
PAYS_ALWAYS = "pays at every A"
SURFACE_COLS = [*LINE, mn.REQ_USERS, "k", A, A_MEASURED, "strategy", SPEEDUP, "speedup_lo",
                "speedup_hi", "interval_over", "n_repeats", "n_requests", "tokens_per_s",
                "autoregressive_tokens_per_s"]


REPLICATE = [mn.REQ_RUN_ID, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING, mn.REQ_USERS,
             mn.REQ_REPEAT]


def _rate(g: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    ok = g[g[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    return (ok[mn.REQ_OUTPUT_TOKENS].fillna(0).to_numpy(dtype=float),
            ok[mn.REQ_E2E_MS].fillna(ok[mn.REQ_E2E_MS].median()).clip(lower=1e-3).to_numpy(dtype=float))


def _tokens_per_s(g: pd.DataFrame) -> float:
    """Output tokens of ok requests / (last end - first scheduled send), as the cell table."""
    start = g[mn.REQ_SCHEDULED_TS].fillna(g[mn.REQ_SENT_TS]).min()
    wall = float(g[mn.REQ_END_TS].max() - start)
    ok = g[g[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    return float(ok[mn.REQ_OUTPUT_TOKENS].sum()) / wall if wall > 0 else math.nan


def request_interval(spec: pd.DataFrame, ar: pd.DataFrame, tps: float, ar_tps: float,
                     confidence: float = DEFAULT_CONFIDENCE, n_boot: int = N_BOOT,
                     seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of one cell's speedup over its requests: each side's tokens/s is
    scaled by resampled (sum tokens / sum request time) over the measured ratio."""
    ts, es = _rate(spec)
    ta, ea = _rate(ar)
    if ts.size < 2 or ta.size < 2 or not (tps > 0 and ar_tps > 0):
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    i = rng.integers(0, ts.size, (n_boot, ts.size))
    j = rng.integers(0, ta.size, (n_boot, ta.size))
    rs = (ts[i].sum(1) / es[i].sum(1)) / (ts.sum() / es.sum())
    ra = (ta[j].sum(1) / ea[j].sum(1)) / (ta.sum() / ea.sum())
    boot = (tps * rs) / (ar_tps * ra)
    lo = (1 - confidence) / 2
    return float(np.quantile(boot, lo)), float(np.quantile(boot, 1 - lo))


def repeat_interval(values: np.ndarray, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """t interval of the mean of the repeats' speedups."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if x.size < 2:
        return math.nan, math.nan
    half = stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return float(x.mean() - half), float(x.mean() + half)


def surface_table(flagged: pd.DataFrame, confidence: float = DEFAULT_CONFIDENCE,
                  n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
    """One row per (strategy, output class, sampling, users, k, A) of the synthetic
    deployments (module docstring); the speedup is the mean over its replicates (run x
    repeat) of tokens/s / autoregressive's in the same replicate. Empty without any."""
    if flagged.empty:
        return pd.DataFrame(columns=SURFACE_COLS)
    df = flagged.copy()
    if mn.REQ_REPEAT not in df:
        df[mn.REQ_REPEAT] = 0
    df[mn.REQ_REPEAT] = pd.to_numeric(df[mn.REQ_REPEAT], errors="coerce").fillna(0).astype(int)
    if mn.REQ_SAMPLING not in df:
        df[mn.REQ_SAMPLING] = mn.GREEDY
    syn_mask = is_synthetic(df)
    if not syn_mask.any():
        return pd.DataFrame(columns=SURFACE_COLS)
    forced = df[SYNTHETIC_AL] if SYNTHETIC_AL in df else pd.Series(np.nan, index=df.index)
    df[SYNTHETIC_AL] = forced.where(forced.notna(), df[mn.REQ_STRATEGY].map(mn.parse_acceptance_length))
    for col, fallback in (("base_strategy", df[mn.REQ_STRATEGY]), ("k", np.nan)):
        if col not in df:
            df[col] = fallback
    ar = {key: g for key, g in df[df[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE)].groupby(REPLICATE)}
    ar_tps = {key: _tokens_per_s(g) for key, g in ar.items()}
    rows = []
    group = [*LINE, mn.REQ_USERS, "k", SYNTHETIC_AL]
    for gk, g in df[syn_mask].groupby(group, dropna=False):
        reps = []
        for rk, rg in g.groupby(REPLICATE):
            tps = _tokens_per_s(rg)
            base = ar_tps.get(rk, math.nan)
            reps.append((rk, rg, tps, base, tps / base if base and base > 0 else math.nan))
        vals = np.array([r[4] for r in reps], dtype=float)
        n_rep = int(np.isfinite(vals).sum())
        if n_rep >= 2:
            lo, hi = repeat_interval(vals, confidence)
            over = "repeats"
        else:
            rk, rg, tps, base, _ = reps[0]
            lo, hi = (request_interval(rg, ar[rk], tps, base, confidence, n_boot, seed)
                      if rk in ar else (math.nan, math.nan))
            over = "requests"
        ok = g[g[mn.REQ_STATUS].eq(mn.STATUS_OK)]
        drafts = ok[mn.NUM_DRAFTS].sum(min_count=1) if mn.NUM_DRAFTS in ok else math.nan
        rows.append({**dict(zip(group, gk)), "strategy": g[mn.REQ_STRATEGY].iloc[0],
                     A_MEASURED: (mn.acceptance_length(int(drafts), int(ok[mn.NUM_ACCEPTED_TOKENS].sum()))
                                  if pd.notna(drafts) and drafts > 0 else math.nan),
                     SPEEDUP: float(np.nanmean(vals)) if n_rep else math.nan,
                     "speedup_lo": lo, "speedup_hi": hi, "interval_over": over,
                     "n_repeats": len(reps), "n_requests": int(len(g)),
                     "tokens_per_s": float(np.nanmean([r[2] for r in reps])),
                     "autoregressive_tokens_per_s": float(np.nanmean([r[3] for r in reps]))})
    out = pd.DataFrame(rows).rename(columns={SYNTHETIC_AL: A})
    out["k"] = pd.to_numeric(out["k"], errors="coerce")
    out = out[out["k"].notna()]
    out["k"] = out["k"].astype(int)
    out[mn.REQ_USERS] = out[mn.REQ_USERS].astype(int)
    return out.sort_values([*LINE, "k", mn.REQ_USERS, A]).reset_index(drop=True)[SURFACE_COLS]


def break_even(a: np.ndarray, speedup: np.ndarray, k: int | None = None) -> tuple[float, str]:
    """(A*, verdict) of one line of speedup over A: the first crossing of 1.0 from below,
    linearly interpolated between the bracketing A; NaN with ``"pays at every A"`` or
    ``"never pays up to <A max>"`` (``k+1`` when A max is k + 1) when there is none."""
    order = np.argsort(a)
    a, s = np.asarray(a, dtype=float)[order], np.asarray(speedup, dtype=float)[order]
    ok = np.isfinite(s)
    a, s = a[ok], s[ok]
    if a.size == 0:
        return math.nan, "no measurement"
    if (s >= 1.0).all():
        return math.nan, PAYS_ALWAYS
    if (s < 1.0).all():
        top = "k+1" if k is not None and abs(a[-1] - (k + 1)) < 1e-9 else f"A = {a[-1]:g}"
        return math.nan, f"never pays up to {top}"
    last_below = int(np.nonzero(s < 1.0)[0].max()) if s[-1] >= 1.0 else None
    if last_below is None:   # pays at low A, loses at the top: report the first fall below 1
        i = int(np.nonzero(s < 1.0)[0].min())
        a0, a1, s0, s1 = a[i - 1], a[i], s[i - 1], s[i]
        x = a0 + (1.0 - s0) * (a1 - a0) / (s1 - s0)
        return float(x), f"falls below 1.0 at A = {x:.2f} (not monotone)"
    a0, a1, s0, s1 = a[last_below], a[last_below + 1], s[last_below], s[last_below + 1]
    x = a0 + (1.0 - s0) * (a1 - a0) / (s1 - s0)
    return float(x), f"pays above A = {x:.2f}"


def break_even_table(surface: pd.DataFrame) -> pd.DataFrame:
    """Per (strategy, output class, sampling, users, k): ``break_even_acceptance_length``
    (NaN where the line does not cross) and ``verdict``; also the break-even of the
    interval's ends (``break_even_lo`` from the upper speedups, ``break_even_hi`` from the
    lower), where those cross."""
    cols = [*LINE, mn.REQ_USERS, "k", "break_even_acceptance_length", "break_even_lo",
            "break_even_hi", "verdict", "a_min", "a_max"]
    if surface.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for gk, g in surface.groupby([*LINE, mn.REQ_USERS, "k"], dropna=False):
        k = int(gk[-1])
        x, verdict = break_even(g[A].to_numpy(), g[SPEEDUP].to_numpy(), k)
        lo, _ = break_even(g[A].to_numpy(), g["speedup_hi"].to_numpy(), k)
        hi, _ = break_even(g[A].to_numpy(), g["speedup_lo"].to_numpy(), k)
        rows.append({**dict(zip([*LINE, mn.REQ_USERS, "k"], gk)),
                     "break_even_acceptance_length": x, "break_even_lo": lo, "break_even_hi": hi,
                     "verdict": verdict, "a_min": float(g[A].min()), "a_max": float(g[A].max())})
    return pd.DataFrame(rows, columns=cols)


def best_k_table(surface: pd.DataFrame) -> pd.DataFrame:
    """Per (strategy, output class, sampling, users, A): the k with the highest speedup
    (among the k measured at that A) and that speedup."""
    cols = [*LINE, mn.REQ_USERS, A, "best_k", SPEEDUP, "ks_measured"]
    if surface.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for gk, g in surface.groupby([*LINE, mn.REQ_USERS, A], dropna=False):
        g = g[g[SPEEDUP].notna()]
        if g.empty:
            continue
        top = g.loc[g[SPEEDUP].idxmax()]
        rows.append({**dict(zip([*LINE, mn.REQ_USERS, A], gk)), "best_k": int(top["k"]),
                     SPEEDUP: float(top[SPEEDUP]),
                     "ks_measured": ",".join(str(int(k)) for k in sorted(g["k"].unique()))})
    return pd.DataFrame(rows, columns=cols)


def drafter_points(cells: pd.DataFrame) -> pd.DataFrame:
    """Every real speculative deployment (not synthetic, not autoregressive) per output
    class, sampling and users: its k, measured acceptance length and speedup."""
    cols = ["strategy", "base_strategy", mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING, mn.REQ_USERS, "k",
            mn.ACCEPTANCE_LENGTH, SPEEDUP]
    if cells.empty:
        return pd.DataFrame(columns=cols)
    real = cells[~is_synthetic(cells) & ~cells[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE)]
    if "base_strategy" not in real:
        real = real.assign(base_strategy=real[mn.REQ_STRATEGY])
    if "k" not in real:
        real = real.assign(k=np.nan)
    real = real[real["base_strategy"].ne(mn.AUTOREGRESSIVE)]
    if real.empty:
        return pd.DataFrame(columns=cols)
    out = (real.groupby(["strategy" if "strategy" in real else mn.REQ_STRATEGY, "base_strategy",
                         mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING, mn.REQ_USERS], dropna=False)
           .agg(k=("k", "first"), **{mn.ACCEPTANCE_LENGTH: (mn.ACCEPTANCE_LENGTH, "mean"),
                                      SPEEDUP: (SPEEDUP, "mean")}).reset_index())
    return out.rename(columns={mn.REQ_STRATEGY: "strategy"})[cols]


def category_acceptance(flagged: pd.DataFrame, confidence: float = DEFAULT_CONFIDENCE,
                        n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
    """Acceptance length (1 + accepted / drafts, pooled over requests) per real speculative
    deployment x sampling x category, with a bootstrap interval over requests."""
    cols = ["strategy", "k", mn.REQ_SAMPLING, mn.REQ_CATEGORY, "n_requests",
            mn.ACCEPTANCE_LENGTH, "acceptance_length_lo", "acceptance_length_hi"]
    if flagged.empty or mn.REQ_CATEGORY not in flagged:
        return pd.DataFrame(columns=cols)
    df = flagged[flagged[mn.REQ_STATUS].eq(mn.STATUS_OK) & flagged[mn.NUM_DRAFTS].gt(0)
                 & flagged[mn.REQ_CATEGORY].notna() & ~is_synthetic(flagged)]
    rows = []
    rng = np.random.default_rng(seed)
    lo_q = (1 - confidence) / 2
    for (s, samp, cat), g in df.groupby([mn.REQ_STRATEGY, mn.REQ_SAMPLING, mn.REQ_CATEGORY]):
        d = g[mn.NUM_DRAFTS].to_numpy(dtype=float)
        acc = g[mn.NUM_ACCEPTED_TOKENS].to_numpy(dtype=float)
        tau = 1.0 + acc.sum() / d.sum()
        lo = hi = math.nan
        if d.size >= 2:
            idx = rng.integers(0, d.size, (n_boot, d.size))
            boot = 1.0 + acc[idx].sum(1) / d[idx].sum(1)
            lo, hi = float(np.quantile(boot, lo_q)), float(np.quantile(boot, 1 - lo_q))
        k = g["k"].dropna().iloc[0] if "k" in g and g["k"].notna().any() else math.nan
        rows.append({"strategy": s, "k": k, mn.REQ_SAMPLING: samp, mn.REQ_CATEGORY: cat,
                     "n_requests": int(d.size), mn.ACCEPTANCE_LENGTH: float(tau),
                     "acceptance_length_lo": lo, "acceptance_length_hi": hi})
    return pd.DataFrame(rows, columns=cols)


def where_drafters_stand(points: pd.DataFrame, be: pd.DataFrame) -> pd.DataFrame:
    """Each real deployment (``drafter_points``) beside the break-even of its k at its users
    level (same strategy, output class and sampling; NaN where its strategy was not forced at that k):
    ``gap`` = measured acceptance length - break-even (positive: it pays)."""
    cols = [*points.columns, "break_even_acceptance_length", "verdict", "gap"]
    if points.empty or be.empty:
        return pd.DataFrame(columns=cols)
    on = ["base_strategy", mn.REQ_OUTPUT_CLASS, mn.REQ_SAMPLING, mn.REQ_USERS, "k"]
    b = (be.groupby(on, dropna=False)
         .agg(break_even_acceptance_length=("break_even_acceptance_length", "mean"),
              verdict=("verdict", "first")).reset_index())
    p = points.copy()
    p["k"] = pd.to_numeric(p["k"], errors="coerce")
    b["k"] = pd.to_numeric(b["k"], errors="coerce")
    # the break-even of the same strategy's forced deployments (its own draft cost) at its k
    out = p.merge(b, on=on, how="left")
    out["gap"] = out[mn.ACCEPTANCE_LENGTH] - out["break_even_acceptance_length"]
    return out[cols]


def analyse_surface(results, confidence: float = DEFAULT_CONFIDENCE, n_boot: int = N_BOOT,
                    seed: int = 0, drafters=None) -> dict:
    """Every surface table of a loaded run (``analysis.data.load.Results``); ``drafters``:
    another loaded run whose real deployments are marked too (None: this run's).
    Returns {"surface", "break_even", "best_k", "drafters", "stand", "categories"}."""
    from analysis.data import metrics
    from analysis.data.slo import resolve_slos

    def tables(res):
        tiers = sorted(res.requests[mn.REQ_TIER].unique())
        flagged = metrics.with_slo_flags(res.requests, resolve_slos(tiers, res.manifest_config))
        return flagged, metrics.cell_table(flagged)

    flagged, cells = tables(results)
    surf = surface_table(flagged, confidence, n_boot, seed)
    be = break_even_table(surf)
    dflag, dcells = (flagged, cells) if drafters is None else tables(drafters)
    pts = drafter_points(dcells)
    return {"surface": surf, "break_even": be, "best_k": best_k_table(surf), "drafters": pts,
            "stand": where_drafters_stand(pts, be), "categories": category_acceptance(dflag, confidence,
                                                                                      n_boot, seed)}
