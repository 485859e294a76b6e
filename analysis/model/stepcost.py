"""Step cost model: what one engine step costs, from what it actually runs.

A step of the engine (``actors.engine.llm_engine``) is up to three parts:
draft (the proposer), one decode forward of the target over every running
request's verification tokens, and one prefill forward over the admitted
prompt chunks. The step log records ``draft_ms``, ``verify_ms`` (decode forward
+ acceptance) and ``step_ms``; the prefill part is ``step_ms - draft_ms -
verify_ms`` (plus scheduling overhead). The parts are fitted separately,
per replica configuration (one deployment = one strategy = one config):

- decode target: ``verify_ms = a + b*B + c*max(0, T - k) + e*A`` with B the
  decode rows, T the tokens the forward computes (``padded_tokens`` when
  logged and the forward padded, else ``verification_tokens``: the stack and compiled
  forwards are ragged), A = T * (context tokens / B) / 1000
  the attention work (query tokens x KV length, thousands) when
  ``context_tokens`` is logged. Two regimes, as a roofline (Williams,
  Waterman & Patterson 2009): below the knee k a step costs a per-step floor
  plus a per-row cost (on a CPU the per-row acceptance loop; on a GPU the
  weight read dominates and b is small); past it each token costs c.
  b, c, e >= 0 (non-negative least squares at each candidate knee; the knee
  by grid search over the observed T, as in ``capacity.fit_cost_curve``).
- prefill: ``rest_ms = step_ms - draft_ms - verify_ms`` on steps with prefill
  tokens P, fitted as the hinge ``capacity.fit_cost_curve`` in P; the
  overhead of a decode-only step (no prefill) is the median ``rest_ms`` there.
- draft: ``draft_ms = d0 + d1*B`` (least squares, clipped >= 0).

``fit_step_model`` returns all three per strategy, with r² of each part and of
the whole step (``step_ms`` predicted from the step's own B, T, A, P against
the measured one). ``fit_table`` is the report's table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from analysis.model.capacity import CostCurve, fit_cost_curve
from configs import metric_names as mn

MAX_KNEE_CANDIDATES = 64


@dataclass(frozen=True)
class DecodeCost:
    """``ms = floor_ms + row_ms*B + token_ms*max(0, T - knee_tokens) + attn_ms*A``.

    Units: ms; B rows; T tokens; A = T * mean context per row / 1000 (k token^2).
    """

    floor_ms: float
    row_ms: float
    token_ms: float
    knee_tokens: float
    attn_ms: float = 0.0
    r2: float = float("nan")
    n_steps: int = 0

    def __call__(self, rows, tokens, attn=0.0):
        b, t = np.asarray(rows, float), np.asarray(tokens, float)
        return (self.floor_ms + self.row_ms * b + self.token_ms * np.maximum(0.0, t - self.knee_tokens)
                + self.attn_ms * np.asarray(attn, float))


def r2_score(y: np.ndarray, pred: np.ndarray) -> float:
    sst = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - pred) ** 2)) / sst if sst > 0 else 1.0


def fit_decode_cost(rows, tokens, ms, attn=None) -> DecodeCost:
    """Fit ``DecodeCost`` to per-step samples (arrays of equal length, NaNs dropped).

    The floor is free, the other coefficients non-negative (scipy ``nnls`` on the
    centred problem at each candidate knee; candidates = quantiles of T plus one
    below the minimum, i.e. no flat part). Raises ValueError with fewer than 3 steps.
    """
    from scipy.optimize import nnls

    b = np.asarray(rows, float)
    t = np.asarray(tokens, float)
    y = np.asarray(ms, float)
    a = np.zeros_like(t) if attn is None else np.nan_to_num(np.asarray(attn, float))
    ok = np.isfinite(b) & np.isfinite(t) & np.isfinite(y)
    b, t, y, a = b[ok], t[ok], y[ok], a[ok]
    if y.size < 3:
        raise ValueError(f"decode cost fit needs >= 3 decode steps, got {y.size}")
    uniq = np.unique(t)
    cands = uniq if uniq.size <= MAX_KNEE_CANDIDATES else np.unique(
        np.quantile(t, np.linspace(0, 1, MAX_KNEE_CANDIDATES)))
    cands = np.concatenate([[t.min() - 1.0], cands[:-1]])
    use_attn = bool(np.ptp(a) > 0)
    best = None
    for k in cands:
        cols = [b, np.maximum(0.0, t - k)] + ([a] if use_attn else [])
        x = np.column_stack(cols)
        xm, ym = x.mean(axis=0), y.mean()
        coef, _ = nnls(x - xm, y - ym)
        icpt = ym - float(xm @ coef)
        sse = float(np.sum((y - icpt - (x @ coef)) ** 2))
        if best is None or sse < best[0]:
            best = (sse, icpt, coef, float(k))
    sse, icpt, coef, k = best
    attn_ms = float(coef[2]) if use_attn else 0.0
    fit = DecodeCost(floor_ms=float(icpt), row_ms=float(coef[0]), token_ms=float(coef[1]),
                     knee_tokens=k if coef[1] > 0 else float(t.max()), attn_ms=attn_ms,
                     n_steps=int(y.size))
    return DecodeCost(**{**asdict(fit), "r2": r2_score(y, fit(b, t, a))})


@dataclass(frozen=True)
class StepModel:
    """One replica configuration's step cost: draft line + decode forward + prefill.

    ``step_ms(B, T, A, P) = draft0 + draft1*B + decode(B, T, A) [if B > 0]
    + prefill(P) [if P > 0, else overhead_ms]``.
    """

    strategy: str
    decode: DecodeCost | None
    prefill: CostCurve | None
    overhead_ms: float
    draft: tuple[float, float]
    r2_step: float = float("nan")
    n_steps: int = 0
    residuals: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False, compare=False)
    fitted: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False, compare=False)
    is_prefill: np.ndarray = field(default_factory=lambda: np.zeros(0, bool), repr=False,
                                   compare=False)
    # the drafter's ms per step as a function of B (a profiled curve); None: the draft line
    draft_curve: object = field(default=None, repr=False, compare=False)
    # "fitted": fitted on the step log (extrapolated beyond its batches); "profiled": the
    # engine profile calibrated on the step log (analysis.model.profiled)
    source: str = "fitted"
    # the engine loop's ms between one step's end and the next one's start, g0 + g1 * B
    # (streaming each row's tokens, scheduling: no step's ``step_ms`` holds it); ``loop_gap``
    loop_gap: tuple = (0.0, 0.0)

    def gap_ms(self, rows):
        """The engine loop's ms between steps at B rows (array ok)."""
        return self.loop_gap[0] + self.loop_gap[1] * np.asarray(rows, float)

    def draft_ms(self, rows):
        """The drafter's ms per step at B rows (array ok)."""
        b = np.asarray(rows, float)
        if self.draft_curve is not None:
            return np.asarray(self.draft_curve(b), float)
        return self.draft[0] + self.draft[1] * b

    def step_ms(self, rows, tokens, attn=0.0, prefill_tokens=0.0):
        """Predicted step ms (array ok); decode part only where rows > 0."""
        b = np.asarray(rows, float)
        p = np.asarray(prefill_tokens, float)
        dec = self.decode(b, tokens, attn) if self.decode is not None else 0.0
        dec = np.where(b > 0, dec + self.draft_ms(b), 0.0)
        pre = self.prefill(p) if self.prefill is not None else self.overhead_ms
        return dec + np.where(p > 0, pre, self.overhead_ms)


LOOP_GAP_MAX_MS = 5.0   # a longer pause between steps is the engine waiting for work


def loop_gap(steps: pd.DataFrame) -> tuple[float, float]:
    """(g0 ms, g1 ms per row): the engine loop's time between consecutive steps of one
    replica in one cell (the next step's start, its log ``ts`` minus ``step_ms``, minus this
    step's end ``ts``), least squares on the next step's decode rows B with g0, g1 >= 0.
    Pauses over ``LOOP_GAP_MAX_MS`` (no work) are left out; (0, 0) with fewer than 3 gaps or
    no ``ts``."""
    from scipy.optimize import nnls

    if steps.empty or mn.STEP_TS not in steps:
        return 0.0, 0.0
    keys = [k for k in (mn.REQ_RUN_ID, mn.REQ_REPEAT, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS,
                        mn.REQ_USERS, mn.STEP_REPLICA) if k in steps]
    gaps, rows = [], []
    for _, g in (steps.groupby(keys, dropna=False, sort=False) if keys else [(None, steps)]):
        g = g.sort_values(mn.STEP_TS)
        end = g[mn.STEP_TS].to_numpy(float) * 1000.0
        start = end - g[mn.STEP_MS].to_numpy(float)
        d = start[1:] - end[:-1]
        ok = (d >= 0) & (d <= LOOP_GAP_MAX_MS)
        gaps.append(d[ok])
        rows.append(g[mn.STEP_BATCH_SIZE].to_numpy(float)[1:][ok])
    y, b = np.concatenate(gaps), np.concatenate(rows)
    if y.size < 3:
        return 0.0, 0.0
    coef, _ = nnls(np.column_stack([np.ones_like(b), b]), y)
    return float(coef[0]), float(coef[1])


def step_features(steps: pd.DataFrame) -> pd.DataFrame:
    """Per step: B, T (padded tokens if logged, else verification tokens), A, P,
    draft_ms, verify_ms (step - draft when not logged), rest_ms, step_ms."""
    s = steps
    verif = s[mn.STEP_VERIFICATION_TOKENS].astype(float).fillna(0.0)
    padded = (s[mn.STEP_PADDED_TOKENS].astype(float) if mn.STEP_PADDED_TOKENS in s
              else pd.Series(np.nan, index=s.index))
    # a step on a ragged forward (the stack kernel, the compiled flat one) computed its rows'
    # own tokens; logs before the engine said so wrote B x longest row there too
    ragged = (s[mn.STEP_FORWARD_PATH].isin([mn.FORWARD_PATH_STACK, mn.FORWARD_PATH_COMPILED])
              if mn.STEP_FORWARD_PATH in s else pd.Series(False, index=s.index))
    t = padded.where(padded.notna() & (padded > 0) & ~ragged, verif)
    b = s[mn.STEP_BATCH_SIZE].astype(float).fillna(0.0)
    ctx = (s[mn.STEP_CONTEXT_TOKENS].astype(float) if mn.STEP_CONTEXT_TOKENS in s
           else pd.Series(np.nan, index=s.index))
    attn = (t * (ctx / b.where(b > 0)) / 1000.0).fillna(0.0)
    draft = s[mn.STEP_DRAFT_MS].astype(float).fillna(0.0)
    step = s[mn.STEP_MS].astype(float)
    verify = s[mn.STEP_VERIFY_MS].astype(float)
    verify = verify.where(verify.notna(), step - draft)
    return pd.DataFrame({"B": b, "T": t, "A": attn,
                         "P": s[mn.STEP_PREFILL_TOKENS].astype(float).fillna(0.0),
                         "draft_ms": draft, "verify_ms": verify,
                         "rest_ms": (step - draft - verify.where(b > 0, 0.0)).clip(lower=0.0),
                         "step_ms": step}, index=s.index)


def _draft_line(f: pd.DataFrame) -> tuple[float, float]:
    d = f[f["B"] > 0]
    if d.empty or d["draft_ms"].abs().sum() == 0:
        return (0.0, 0.0)
    if d["B"].nunique() < 2:
        return (float(d["draft_ms"].mean()), 0.0)
    slope, icpt = np.polyfit(d["B"], d["draft_ms"], 1)
    if slope < 0:
        return (float(d["draft_ms"].mean()), 0.0)
    return (max(float(icpt), 0.0), float(slope))


def fit_strategy(steps: pd.DataFrame, strategy: str = "") -> StepModel:
    """Fit one replica configuration's ``StepModel`` on its step rows.

    Raises ValueError when there are fewer than 3 decode steps."""
    f = step_features(steps)
    f = f[(f["B"] > 0) | (f["P"] > 0)]
    dec = f[f["B"] > 0]
    decode = fit_decode_cost(dec["B"], dec["T"], dec["verify_ms"], dec["A"])
    pre = f[f["P"] > 0]
    prefill = None
    if pre["P"].nunique() >= 2:
        prefill = fit_cost_curve(pre["P"], pre["rest_ms"])
    elif not pre.empty:
        prefill = CostCurve(floor_ms=float(pre["rest_ms"].mean()), slope_ms_per_token=0.0,
                            knee_tokens=float(pre["P"].max()), r2=float("nan"),
                            n_steps=len(pre), knee_observed=False)
    pure = f[(f["B"] > 0) & (f["P"] == 0)]
    overhead = float(pure["rest_ms"].median()) if not pure.empty else 0.0
    model = StepModel(strategy, decode, prefill, overhead, _draft_line(f))
    pred = model.step_ms(f["B"], f["T"], f["A"], f["P"])
    y = f["step_ms"].to_numpy(float)
    return StepModel(strategy, decode, prefill, overhead, model.draft,
                     r2_step=r2_score(y, np.asarray(pred)), n_steps=len(f),
                     residuals=y - np.asarray(pred), fitted=np.asarray(pred),
                     is_prefill=(f["P"] > 0).to_numpy(), loop_gap=loop_gap(steps))


def cpu_fit(steps: pd.DataFrame) -> dict | None:
    """The same model fitted on the engine thread's CPU time (``cpu_ms``,
    ``verify_cpu_ms``) instead of wall time: what the step costs when it is not
    waiting for a core. On a shared machine the gap between this fit's r² and the
    wall-clock one is the share of step-time variance due to other processes.

    Decode: ``fit_decode_cost`` on verify_cpu_ms; draft + overhead: a line in B on
    decode-only steps (cpu - verify_cpu); prefill: hinge in P on what remains.
    Returns {"r2_step_cpu", "r2_decode_cpu", "cpu_share"} (cpu_share = total cpu /
    total wall ms) or None when the step log has no CPU columns."""
    if mn.STEP_CPU_MS not in steps or steps[mn.STEP_CPU_MS].isna().all():
        return None
    f = step_features(steps)
    keep = ((f["B"] > 0) | (f["P"] > 0)) & steps[mn.STEP_CPU_MS].notna()
    f, cpu = f[keep], steps.loc[keep, mn.STEP_CPU_MS].astype(float)
    vcpu = steps.loc[keep, mn.STEP_VERIFY_CPU_MS].astype(float).fillna(0.0)
    dec = f["B"] > 0
    if dec.sum() < 3:
        return None
    decode = fit_decode_cost(f.loc[dec, "B"], f.loc[dec, "T"], vcpu[dec], f.loc[dec, "A"])
    rest = (cpu - vcpu.where(dec, 0.0)).clip(lower=0.0)
    pure = dec & (f["P"] == 0)
    if pure.sum() >= 2 and f.loc[pure, "B"].nunique() >= 2:
        slope, icpt = np.polyfit(f.loc[pure, "B"], rest[pure], 1)
    else:
        slope, icpt = 0.0, float(rest[pure].mean()) if pure.any() else 0.0
    line = np.where(dec, icpt + slope * f["B"], 0.0)
    pre = f["P"] > 0
    pre_part = np.zeros(len(f))
    if pre.sum() >= 2 and f.loc[pre, "P"].nunique() >= 2:
        curve = fit_cost_curve(f.loc[pre, "P"], (rest - line)[pre])
        pre_part = np.where(pre, curve(f["P"]), 0.0)
    pred = np.where(dec, decode(f["B"], f["T"], f["A"]), 0.0) + line + pre_part
    return {"r2_step_cpu": r2_score(cpu.to_numpy(), pred), "r2_decode_cpu": decode.r2,
            "cpu_share": float(cpu.sum() / f["step_ms"].sum()) if f["step_ms"].sum() > 0 else np.nan}


def fit_step_models(steps: pd.DataFrame) -> dict[str, StepModel]:
    """``{strategy: StepModel}`` for every strategy with >= 3 decode steps."""
    out = {}
    if steps is None or steps.empty:
        return out
    for strategy, g in steps.groupby(mn.STEP_STRATEGY, sort=True):
        try:
            out[str(strategy)] = fit_strategy(g, str(strategy))
        except ValueError:
            continue
    return out


def fit_table(models: dict[str, StepModel], steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """The report's table: per strategy r² of the whole step, of the decode and
    prefill parts, the decode coefficients and the residual spread (ms); with
    ``steps`` carrying CPU columns also the CPU-time fit's r² (``cpu_fit``)."""
    rows = []
    for s, m in models.items():
        cpu = None
        if steps is not None and not steps.empty:
            cpu = cpu_fit(steps[steps[mn.STEP_STRATEGY].eq(s)])
        d, p = m.decode, m.prefill
        res = m.residuals
        g = (lambda name: getattr(d, name, np.nan) if d is not None else np.nan)  # noqa: E731
        rows.append({"strategy": s, "step_model": m.source, "steps": m.n_steps,
                     "r2_step": m.r2_step,
                     "r2_decode": d.r2 if d else np.nan,
                     "r2_prefill": getattr(p, "r2", np.nan) if p is not None else np.nan,
                     "verify_scale": g("scale"),
                     "floor_ms": g("floor_ms"),
                     "row_ms": g("row_ms"),
                     "token_ms": g("token_ms"),
                     "knee_tokens": g("knee_tokens"),
                     "attn_ms_per_ktok2": g("attn_ms"),
                     "draft_ms_per_row": m.draft[1], "overhead_ms": m.overhead_ms,
                     "residual_p50_abs_ms": float(np.median(np.abs(res))) if res.size else np.nan,
                     "residual_p90_abs_ms": float(np.percentile(np.abs(res), 90)) if res.size else np.nan,
                     **(cpu or {"r2_step_cpu": np.nan, "r2_decode_cpu": np.nan, "cpu_share": np.nan})})
    return pd.DataFrame(rows)
