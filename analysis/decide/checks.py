"""Model checks: sentences the report puts beside a figure when a prediction
contradicts a measurement or a fit explains too little of its data.

A capacity model is only worth what it predicts (docs/design.md, "Capacity
model"). Until its predictions are validated, the report says in words where
they disagree with what was measured, so a reader never takes a smooth fitted
line for evidence:

- predicted crossover vs measured speedup: the model says a strategy stops
  beating ``autoregressive`` at X users, yet a measured level at or above X
  shows speedup >= 1 (or the model says it never stops, yet a measured level
  shows speedup < 1);
- backtest rows (fit on lower users levels, predict the highest): a predicted
  speedup on the other side of 1 from the measured one, or any predicted
  figure off by more than ``BACKTEST_ERROR_MAX``;
- fits with r² < ``R2_MIN`` (each strategy's step model).

A measured speedup within the run's own noise of 1 (``speedup_noise``: the race's pooled
cell-to-cell noise on a ratio of two cells) sits on neither side of 1, so it contradicts no
prediction.

``model_checks`` returns ``{figure key: [sentences]}`` (keys of
``analysis.report.build.make_figures``); every sentence also appears in the report's
"Model checks" section. Each check function takes an optional ``tally`` list and appends one
entry per comparison it made (failed or not), so the report can say "3 of 16 fail".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

from analysis.data.metrics import SPEEDUP
from configs import metric_names as mn

if TYPE_CHECKING:
    from analysis.data.analysis import Analysis

R2_MIN = 0.8                 # a fit explaining less than 80% of the variance is flagged
BACKTEST_ERROR_MAX = 0.25    # a backtest prediction off by more than 25% is flagged


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def speedup_noise(flagged: pd.DataFrame | None) -> float:
    """The run's noise on one measured speedup, as a fraction: a speedup is one cell's
    goodput over another's, so sqrt(2) x the pooled cell-to-cell sd of ln(goodput)
    (``analysis.decide.race.pooled_noise``: what the recommendation's race uses); 0.0 when
    nothing ran twice."""
    from analysis.decide import race

    if flagged is None or flagged.empty:
        return 0.0
    sd = race.pooled_noise(race.cell_replicates(flagged)).sd
    return float(math.expm1(math.sqrt(2.0) * sd)) if sd else 0.0


def _side(s: float, noise: float) -> int:
    """+1 / -1 when a measured speedup ``s`` lies above / below 1 beyond ``noise`` (a
    fraction: ln(s) against ln(1 + noise)), 0 within it."""
    band = math.log1p(max(noise, 0.0))
    return 0 if abs(math.log(s)) <= band else (1 if s > 1 else -1)


def crossover_checks(cells: pd.DataFrame, crossover: pd.DataFrame,
                     tally: list | None = None, noise: float = 0.0) -> list[str]:
    """Predicted crossover (``predicted_crossover_users``) against the measured speedups; a
    measured speedup within the run's ``noise`` of 1 (``speedup_noise``) contradicts
    neither side."""
    out: list[str] = []
    if crossover is None or crossover.empty or "predicted_crossover_users" not in crossover:
        return out
    spec = cells[~cells[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE) & cells[SPEEDUP].notna()]
    for _, row in crossover.iterrows():
        strategy, oc = row.get(mn.REQ_STRATEGY), row.get(mn.REQ_OUTPUT_CLASS)
        g = spec[spec[mn.REQ_STRATEGY].eq(strategy) & spec[mn.REQ_OUTPUT_CLASS].eq(oc)]
        samp = row.get(mn.REQ_SAMPLING)
        if isinstance(samp, str) and mn.REQ_SAMPLING in g.columns:   # one sampling setting's curve
            g = g[g[mn.REQ_SAMPLING].eq(samp)]
        if g.empty:
            continue
        curve = g.groupby(mn.REQ_USERS)[SPEEDUP].mean().sort_index()
        predicted = _num(row.get("predicted_crossover_users"))
        if tally is not None and (predicted is not None
                                  or _num(row.get("model_tau", row.get("tau"))) is not None):
            tally.append(("speedup", strategy, oc))
        if predicted is not None:
            above = curve[(curve.index >= predicted)
                          & curve.map(lambda v: _side(v, noise) > 0 or (not noise and v >= 1.0))]
            if len(above):
                u, s = int(above.index[-1]), float(above.iloc[-1])
                out.append(f"The model predicts {strategy} stops beating autoregressive at "
                           f"{predicted:.1f} users ({oc} outputs), but its measured speedup is "
                           f"{s:.2f}x at {u} users: the prediction contradicts the measurement.")
        elif _num(row.get("model_tau", row.get("tau"))) is not None:   # the model ran, no crossover
            below = curve[curve.map(lambda v: _side(v, noise) < 0)]
            if len(below):
                u, s = int(below.index[0]), float(below.iloc[0])
                out.append(f"The model predicts {strategy} keeps beating autoregressive at every "
                           f"concurrency ({oc} outputs), but its measured speedup is {s:.2f}x at "
                           f"{u} users: the prediction contradicts the measurement.")
    return out


def backtest_checks(bt: dict | None, tally: list | None = None,
                    noise: float = 0.0) -> dict[str, list[str]]:
    """Backtest rows whose prediction disagrees with the measurement, by figure key (the
    ex-post rows where the run has the machine's speed per cell); a speedup is on the wrong
    side of 1 only where the measured one lies beyond the run's ``noise`` from 1."""
    out: dict[str, list[str]] = {}
    post = (bt or {}).get("rows_ex_post")
    how = " (ex-post: at the cell's own measured machine speed)" if post else ""
    for r in post or (bt or {}).get("rows", []):
        p, m = _num(r.get("predicted")), _num(r.get("measured"))
        if p is None or m is None:
            continue
        key = f"backtest_speedup_{r.get('output_class')}"
        if tally is not None:
            tally.append((key, r.get("strategy"), r.get("metric"), r.get("users")))
        what = f"{r.get('strategy')} {r.get('metric')} at {r.get('users')} users ({r.get('output_class')})"
        if r.get("metric") == SPEEDUP and _side(m, noise) != 0 and (p >= 1.0) != (m >= 1.0):
            out.setdefault(key, []).append(
                f"Backtest{how}: predicted {what} {p:.2f}x, measured {m:.2f}x: the model calls the "
                f"wrong side of autoregressive.")
        elif m != 0 and abs(p - m) / abs(m) > BACKTEST_ERROR_MAX:
            out.setdefault(key, []).append(
                f"Backtest{how}: predicted {what} {p:.3g}, measured {m:.3g} ({abs(p - m) / abs(m):.0%} off, "
                f"more than {BACKTEST_ERROR_MAX:.0%}).")
    return out


LOO_MEDIAN_MAX = 0.10        # leave-one-level-out: median absolute error (tokens/s, TPOT)
LOO_WORST_MAX = 0.20         # ... and the worst one
R2_HOLDOUT_MIN = 0.9         # the step model's r² on the steps of held-out levels


def _noise_floor(bt: dict | None, metric: str, worst: float) -> str:
    """The leave-one-repeat-out figures of ``metric`` (``backtest.lro_backtest``: how far a
    new repeat of a measured cell lands from the model fitted on the others), as a sentence
    that places a leave-one-level-out worst case against them; "" without repeats."""
    o = (((bt or {}).get("lro") or {}).get("overall") or {}).get(metric)
    if not o:
        return ""
    med, top = _num(o.get("median_abs_error")), _num(o.get("worst_abs_error"))
    if med is None or top is None:
        return ""
    where = "within" if worst <= top else "beyond"
    return (f" The run's own repeats of a cell land median {med:.0%}, worst {top:.0%} from the "
            f"model fitted on the others (leave one repeat out over {o.get('n', 0)} "
            f"predictions): this worst case is {where} the run's own noise.")


def _ex_ante_sentence(loo: dict, metric: str) -> str | None:
    """A sentence on the ex-ante leave-one-level-out of ``metric`` (each held level predicted
    at the strategy's typical machine speed) when its median or worst case lies beyond the
    bar by more than the machine's worst drift between this run's cells (``machine_speed``:
    a slow cell errs by its own drift held out, and moves the typical speed the others are
    predicted at held in); None when it is within the bar or within that drift."""
    o = (loo.get("overall") or {}).get(metric) or {}
    ms = loo.get("machine_speed") or {}
    med, worst, drift = (_num(o.get("median_abs_error")), _num(o.get("worst_abs_error")),
                         _num(ms.get("worst")))
    if med is None or worst is None or (med <= LOO_MEDIAN_MAX and worst <= LOO_WORST_MAX):
        return None
    if drift is not None and med <= LOO_MEDIAN_MAX + drift and worst <= LOO_WORST_MAX + drift:
        return None
    return (f"Leave-one-level-out backtest of {metric}, ex-ante (at the strategy's typical "
            f"machine speed): median error {med:.0%}, worst {worst:.0%}; the machine's speed in "
            f"this run's cells lies median {_num(ms.get('median') or 0.0):.0%}, worst "
            f"{(drift or 0.0):.0%} from typical, and this is beyond the bar by more than that.")


def loo_checks(bt: dict | None, tally: list | None = None) -> dict[str, list[str]]:
    """The leave-one-level-out backtest (``analysis.model.backtest.loo_backtest``) against a
    forecaster's bar: median absolute error <= 10 % and worst <= 20 % for tokens/s and TPOT,
    the step model's hold-out r² >= 0.9. Where the run has the machine's speed per cell (an
    engine profile) the model is judged ex-post, each held level at its own measured speed;
    the ex-ante figures fail a check only where the machine's drift does not explain them
    (``_ex_ante_sentence``)."""
    out: dict[str, list[str]] = {}
    loo = (bt or {}).get("loo") or {}
    post = loo.get("ex_post")
    judged = post or loo
    how = " (ex-post: each held level at its own measured machine speed)" if post else ""
    for metric, o in sorted((judged.get("overall") or {}).items()):
        if metric == SPEEDUP:
            continue
        med, worst = _num(o.get("median_abs_error")), _num(o.get("worst_abs_error"))
        if tally is not None and med is not None and worst is not None:
            tally.append(("loo", metric))
        if med is not None and worst is not None and (med > LOO_MEDIAN_MAX or worst > LOO_WORST_MAX):
            bad = max((r for r in judged.get("rows", []) if r.get("metric") == metric),
                      key=lambda r: r.get("abs_error") or 0.0, default=None)
            where = (f" (worst: {bad['strategy']} {bad['output_class']} at {bad['users']} users, "
                     f"predicted {bad['predicted']:.3g}, measured {bad['measured']:.3g})") if bad else ""
            out.setdefault("step_residuals", []).append(
                f"Leave-one-level-out backtest of {metric}{how}: median error {med:.0%}, worst "
                f"{worst:.0%}{where}; the bar is {LOO_MEDIAN_MAX:.0%} / {LOO_WORST_MAX:.0%}."
                + _noise_floor(bt, metric, worst))
        if post:
            if tally is not None:
                tally.append(("loo_ex_ante", metric))
            ante = _ex_ante_sentence(loo, metric)
            if ante:
                out.setdefault("step_residuals", []).append(ante)
    for strategy, r2 in sorted((judged.get("r2_holdout") or {}).items()):
        r2, ceil = _num(r2), _num((loo.get("r2_ceiling") or {}).get(strategy))
        if tally is not None and r2 is not None:
            tally.append(("r2_holdout", strategy))
        if r2 is not None and r2 < R2_HOLDOUT_MIN:
            why = (f"; the step's own shape (B, T, prefill, context) explains at most r² {ceil:.2f} in sample "
                   f"(the rest, {1 - ceil:.0%} of the variance, is step-to-step noise the model "
                   f"cannot see), so the model loses {max(ceil - r2, 0):.2f} to what it could see"
                   if ceil is not None else "")
            out.setdefault("step_residuals", []).append(
                f"The step model of {strategy} explains r² {r2:.2f} of the step time on levels it "
                f"did not see (< {R2_HOLDOUT_MIN}){why}.")
    return out


def fit_checks(a: "Analysis", tally: list | None = None) -> dict[str, list[str]]:
    """Fits with r² < R2_MIN, by figure key."""
    out: dict[str, list[str]] = {}
    for strategy, m in sorted((a.capacity_model or {}).get("step_models", {}).items()):
        r2 = _num(getattr(m, "r2_step", None))
        if tally is not None and r2 is not None:
            tally.append(("r2_step", strategy))
        if r2 is not None and r2 < R2_MIN:
            out.setdefault("step_residuals", []).append(
                f"The step model of {strategy} has r² {r2:.2f} (< {R2_MIN}): its predictions "
                "(backtest, crossover) are not reliable.")
    return out


def model_checks(a: "Analysis", tally: list | None = None) -> dict[str, list[str]]:
    """``{figure key: [sentences]}`` for every contradiction and weak fit found; ``tally``
    (optional) gets one entry per comparison made, failed or not."""
    out: dict[str, list[str]] = {}
    noise = speedup_noise(getattr(a, "flagged", None))
    cross = crossover_checks(a.cells, a.crossover, tally, noise)
    if cross:
        out["speedup"] = cross
    bt = (a.capacity_model or {}).get("backtest")
    for part in (backtest_checks(bt, tally, noise), loo_checks(bt, tally), fit_checks(a, tally)):
        for k, v in part.items():
            out.setdefault(k, []).extend(v)
    return out
