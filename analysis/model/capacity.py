"""Batch capacity from the engine step log: how verification eats the batch.

The step cost model itself is ``analysis.model.stepcost`` (per strategy, prefill and
decode apart); the report's crossover and the plan both use it through
``analysis.model.backtest``. Here:

- The hinge primitive ``fit_cost_curve``: ``f(T) = max(a, b + c*T)`` written
  ``a + c*max(0, T - T_knee)``, flat while a forward is memory-bound, linear
  once compute-bound (the roofline model, Williams, Waterman & Patterson 2009,
  CACM 52(4)); weighted least squares for (a, c >= 0) at each candidate knee,
  the knee by grid search over the observed token counts. ``stepcost`` fits a
  prefill with it; ``analysis.decide.plan`` writes a GPU roofline as one.
- Wasted share = (verification tokens - emitted tokens) / verification tokens
  >= 0: emitted tokens are what verification delivered (the step log's
  ``emitted_tokens``; each request's first token comes from prefill and is
  counted apart in ``prefill_emitted_tokens``), so autoregressive shows
  emitted = verification = 1.00 per request-step and a wasted share of 0.
- Capacity per emitted token = verification tokens / emitted token and engine
  ms / emitted token.
- ``first_users_below_one``: the crossover search (first users level where a
  predicted speedup falls below 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from configs import metric_names as mn

BATCH_TOKENS = "batch_tokens"


@dataclass(frozen=True)
class CostCurve:
    """``step_ms(T) = floor_ms + slope_ms_per_token * max(0, T - knee_tokens)``.

    Equivalently ``max(a, b + c*T)`` with a = floor_ms, c = slope,
    b = floor_ms - slope * knee_tokens. Units: ms and tokens per step.
    """

    floor_ms: float
    slope_ms_per_token: float
    knee_tokens: float
    r2: float = float("nan")
    n_steps: int = 0
    knee_observed: bool = True  # False: flat or linear over all the data (knee outside it)

    def __call__(self, tokens):
        t = np.asarray(tokens, dtype=float)
        return self.floor_ms + self.slope_ms_per_token * np.maximum(0.0, t - self.knee_tokens)

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and np.isnan(v) else v)
                for k, v in asdict(self).items()}


def fit_cost_curve(tokens, step_ms, max_candidates: int = 256) -> CostCurve:
    """Fit the hinge ``a + c*max(0, T - k)`` to (tokens, ms) samples.

    Samples are first averaged per distinct token count (weights = counts) so
    the fit costs O(distinct T x candidates). Candidate knees: the distinct T
    values (subsampled to ``max_candidates``) plus one below the minimum (a
    pure line). Raises ValueError with fewer than 2 distinct token counts.
    """
    df = pd.DataFrame({"t": np.asarray(tokens, float), "y": np.asarray(step_ms, float)}).dropna()
    agg = df.groupby("t")["y"].agg(["mean", "count"]).reset_index()
    if len(agg) < 2:
        raise ValueError(f"cost curve fit needs >= 2 distinct batch-token counts, got "
                         f"{len(agg)}; the step log covers too narrow a load range.")
    t, y, w = agg["t"].to_numpy(), agg["mean"].to_numpy(), agg["count"].to_numpy(float)
    cands = t if len(t) <= max_candidates else np.quantile(t, np.linspace(0, 1, max_candidates))
    cands = np.concatenate([[t.min() - 1.0], cands])
    sw = np.sqrt(w)

    def solve(k: float) -> tuple[float, float, float, float]:
        x = np.maximum(0.0, t - k)
        design = np.column_stack([np.ones_like(t), x]) * sw[:, None]
        (a, c), *_ = np.linalg.lstsq(design, y * sw, rcond=None)
        if c < 0:  # cost never falls with more tokens: clamp to flat
            a, c = np.average(y, weights=w), 0.0
        return float(np.sum(w * (y - (a + c * x)) ** 2)), float(a), float(c), float(k)

    grid = [solve(k) for k in cands]
    i = int(np.argmin([g[0] for g in grid]))
    best = grid[i]
    # The true knee usually falls between two observed token counts: refine it
    # continuously between the neighbouring candidates (bounded Brent search).
    lo, hi = cands[max(i - 1, 0)], cands[min(i + 1, len(cands) - 1)]
    if hi > lo:
        from scipy.optimize import minimize_scalar
        res = minimize_scalar(lambda k: solve(k)[0], bounds=(lo, hi), method="bounded",
                              options={"xatol": 1e-3})
        refined = solve(float(res.x))
        if refined[0] <= best[0]:
            best = refined
    sse, a, c, k = best
    sst = float(np.sum(w * (y - np.average(y, weights=w)) ** 2))
    # With no slope the curve is flat over the observed range: the knee lies at
    # or beyond the largest observed batch, which is what knee_tokens then says.
    knee = float(k) if c > 0 else float(t.max())
    return CostCurve(floor_ms=float(a), slope_ms_per_token=float(c), knee_tokens=knee,
                     r2=1.0 - sse / sst if sst > 0 else 1.0, n_steps=int(w.sum()),
                     knee_observed=bool(c > 0 and t.min() < k <= t.max()))


def step_table(steps: pd.DataFrame, decode_only: bool = True) -> pd.DataFrame:
    """Steps with ``batch_tokens`` = verification + prefill tokens added.

    ``decode_only`` keeps steps with a running batch (per-request ratios need
    it); otherwise every step that ran tokens, prefill-only ones included (the
    cost fit wants the whole token range)."""
    df = steps.copy()
    df[BATCH_TOKENS] = (df[mn.STEP_VERIFICATION_TOKENS].fillna(0)
                        + df[mn.STEP_PREFILL_TOKENS].fillna(0))
    keep = df[mn.STEP_BATCH_SIZE].fillna(0) > 0 if decode_only else df[BATCH_TOKENS] > 0
    return df[keep]


def target_ms(df: pd.DataFrame) -> pd.Series:
    """The target forward's cost per step: ``verify_ms`` if logged, else step - draft."""
    if df[mn.STEP_VERIFY_MS].notna().any():
        return df[mn.STEP_VERIFY_MS]
    return df[mn.STEP_MS] - df[mn.STEP_DRAFT_MS].fillna(0)


def capacity_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Per strategy: steps, mean batch, verification tokens per step and per request,
    wasted share, verification tokens and engine ms per emitted token."""
    df = step_table(steps)
    rows = []
    for strategy, g in df.groupby(mn.STEP_STRATEGY, sort=True):
        verif, emitted = g[mn.STEP_VERIFICATION_TOKENS].sum(), g[mn.STEP_EMITTED_TOKENS].sum()
        row = {mn.STEP_STRATEGY: strategy, "steps": len(g),
               "batch_size_mean": g[mn.STEP_BATCH_SIZE].mean(),
               "verification_tokens_per_step": g[mn.STEP_VERIFICATION_TOKENS].mean(),
               "verification_tokens_per_request": verif / g[mn.STEP_BATCH_SIZE].sum(),
               "emitted_tokens_per_request": emitted / g[mn.STEP_BATCH_SIZE].sum(),
               "wasted_share": (verif - emitted) / verif if verif else np.nan,
               "verification_per_emitted": verif / emitted if emitted else np.nan,
               "ms_per_emitted_token": g[mn.STEP_MS].sum() / emitted if emitted else np.nan}
        rows.append(row)
    return pd.DataFrame(rows)


def first_users_below_one(speedup, max_users: float, points: int = 4000, tol: float = 1e-6) -> float | None:
    """Smallest users level in [1, max_users] where ``speedup(users) < 1``: a geometric scan of
    ``points`` levels, then bisection to ``tol`` users. 1.0 if already below 1 at one user;
    None if it never falls below 1 in range, or if ``speedup`` returns None.

    ``speedup`` takes an array (the scan) and a scalar (the bisection) of users.
    """
    grid = np.geomspace(1.0, max_users, points)
    vals = speedup(grid)
    if vals is None:
        return None
    below = np.nonzero(np.asarray(vals) < 1.0)[0]
    if below.size == 0:
        return None
    i = int(below[0])
    if i == 0:
        return 1.0
    lo, hi = grid[i - 1], grid[i]
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if speedup(mid) >= 1.0 else (lo, mid)
    return float(hi)


def verification_per_request(steps_cap: pd.DataFrame, flagged: pd.DataFrame) -> dict[str, float]:
    """Verification tokens per request per step v, per strategy: from the step log
    when present, else 1 + draft tokens / drafts from the request rows."""
    v = {}
    if not steps_cap.empty:
        v.update(dict(zip(steps_cap[mn.STEP_STRATEGY], steps_cap["verification_tokens_per_request"])))
    for strategy, g in flagged.groupby(mn.REQ_STRATEGY):
        if strategy not in v:
            drafts = g[mn.NUM_DRAFTS].sum()
            v[strategy] = 1.0 + g[mn.NUM_DRAFT_TOKENS].sum() / drafts if drafts > 0 else 1.0
    return v


def draft_ratio(steps: pd.DataFrame) -> dict[str, float]:
    """Per strategy: total draft ms / total target-forward ms over decode steps
    (0 where nothing was drafted or the target time is unknown)."""
    df = step_table(steps)
    if df.empty:
        return {}
    df = df.assign(_target=target_ms(df), _draft=df[mn.STEP_DRAFT_MS].fillna(0))
    sums = df.groupby(mn.STEP_STRATEGY)[["_draft", "_target"]].sum()
    return {s: float(r["_draft"] / r["_target"]) if r["_target"] > 0 else 0.0
            for s, r in sums.iterrows()}
