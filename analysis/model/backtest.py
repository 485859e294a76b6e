"""Backtest of the capacity model: fit on the lower concurrency levels of a run,
predict the highest, print the error (``python -m analysis backtest RUN_DIR``).

A forecaster's hold-out test (fit on part of the data, predict the rest). Per
strategy the step cost model (``analysis.model.stepcost``) is fitted on the step log
of the lower users levels only; per strategy x output class the same levels
give the workload: verification tokens per row v (T / B), context per row,
acceptance length tau, mean output and prompt tokens, and the batch occupancy
(mean decode rows / users). At concurrency N the model then says

    B = occupancy * N,  T = B * v,  q = B * tau / L   (prefills per step)
    step(N) = draft(B) + decode(B, T, A) + (1 - min(q, 1)) * overhead
              + min(q, 1) * prefill(max(q, 1) * P)
    tokens/s = 1000 * B * tau / step(N),   TPOT = step(N) / tau

and a per strategy x output class calibration factor (median over the lower
levels of measured / modelled, for tokens/s and TPOT p50 separately) absorbs
what the step log cannot see (client and HTTP time, the streaming path). The
speedup is the predicted tokens/s over the predicted ``autoregressive`` one.
Errors are fractions: |predicted - measured| / measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.model import capacity
from analysis.data import metrics
from analysis.data import server as server_data
from analysis.model import server_fit
from analysis.model import stepcost
from analysis.data.load import Results
from configs import metric_names as mn
from configs.tiers import Slo

METRICS = (metrics.OUTPUT_TOKENS_PER_S, "tpot_ms_p50", metrics.SPEEDUP)


def steps_with_users(steps: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """Step rows with a ``users`` column: the step's own label when the load
    generator wrote one, else the users level of its (run, strategy, tier,
    output class) cell. Steps outside every cell window get NaN."""
    df = steps.copy()
    if df.empty:
        df[mn.REQ_USERS] = pd.Series(dtype=float)
        return df
    keys = [k for k in (mn.REQ_RUN_ID, mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS)
            if k in df.columns]
    own = (pd.to_numeric(df[mn.REQ_USERS], errors="coerce") if mn.REQ_USERS in df.columns
           else pd.Series(np.nan, index=df.index))
    if len(keys) == 4:
        lut = requests.groupby(keys)[mn.REQ_USERS].max().rename("_u").reset_index()
        merged = df[keys].merge(lut, on=keys, how="left")
        own = own.fillna(pd.Series(merged["_u"].to_numpy(float), index=df.index))
    df[mn.REQ_USERS] = own
    return df


@dataclass(frozen=True)
class Workload:
    """What a strategy x output class runs per step, measured on the fit levels."""

    v: float            # tokens the decode forward computes per row (T / B)
    ctx_per_row: float  # KV tokens attended per row (0 if unlogged)
    tau: float          # output tokens per request per step
    out_tokens: float   # mean output tokens per request
    prompt_tokens: float
    occupancy: float    # mean decode rows / users


def _workload(steps: pd.DataFrame, req: pd.DataFrame, strategy: str) -> Workload:
    f = stepcost.step_features(steps)
    dec = f[f["B"] > 0]
    b_sum = dec["B"].sum()
    v = float(dec["T"].sum() / b_sum) if b_sum > 0 else 1.0
    ctx = steps.loc[dec.index, mn.STEP_CONTEXT_TOKENS] if mn.STEP_CONTEXT_TOKENS in steps else None
    ctx_row = float(ctx.sum() / b_sum) if ctx is not None and ctx.notna().any() and b_sum > 0 else 0.0
    ok = req[req[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    tau = metrics.pooled_tau(ok) if strategy != mn.AUTOREGRESSIVE else 1.0
    if not np.isfinite(tau):
        emitted = steps.loc[dec.index, mn.STEP_EMITTED_TOKENS].sum()
        tau = float(emitted / b_sum) if b_sum > 0 else 1.0
    occ = []
    for users, g in dec.groupby(steps.loc[dec.index, mn.REQ_USERS]):
        if users > 0:
            occ.append(float(g["B"].mean()) / float(users))
    return Workload(v=v, ctx_per_row=ctx_row, tau=float(tau),
                    out_tokens=float(ok[mn.REQ_OUTPUT_TOKENS].mean()) if len(ok) else 1.0,
                    prompt_tokens=float(ok[mn.REQ_PROMPT_TOKENS].mean())
                    if ok[mn.REQ_PROMPT_TOKENS].notna().any() else 0.0,
                    occupancy=float(np.median(occ)) if occ else 1.0)


def model_point(model: stepcost.StepModel, w: Workload, users) -> tuple[np.ndarray, np.ndarray]:
    """(tokens/s, TPOT ms) the uncalibrated model gives at ``users`` (array ok)."""
    n = np.asarray(users, float)
    b = np.maximum(w.occupancy * n, 1e-9)
    t = b * w.v
    a = t * w.ctx_per_row / 1000.0
    q = b * w.tau / max(w.out_tokens, 1.0)
    pq = np.minimum(q, 1.0)
    dec = model.decode(b, t, a) if model.decode is not None else 0.0
    pre = (model.prefill(np.maximum(q, 1.0) * w.prompt_tokens) if model.prefill is not None
           and w.prompt_tokens > 0 else model.overhead_ms)
    step = model.draft[0] + model.draft[1] * b + dec + (1.0 - pq) * model.overhead_ms + pq * pre
    step = np.maximum(step, 1e-6)
    return 1000.0 * b * w.tau / step, step / w.tau


@dataclass(frozen=True)
class CellModel:
    """A calibrated predictor for one strategy x output class."""

    strategy: str
    output_class: str
    model: stepcost.StepModel
    workload: Workload
    k_tps: float
    k_tpot: float

    def predict(self, users) -> tuple[np.ndarray, np.ndarray]:
        tps, tpot = model_point(self.model, self.workload, users)
        return self.k_tps * tps, self.k_tpot * tpot


def _measured(cells: pd.DataFrame) -> pd.DataFrame:
    """Mean per (strategy, output class, users) over runs / repeats / tiers."""
    cols = [metrics.OUTPUT_TOKENS_PER_S, "tpot_ms_p50", metrics.SPEEDUP]
    return cells.groupby([mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS])[cols].mean()


def fit_cell_models(steps: pd.DataFrame, flagged: pd.DataFrame, cells: pd.DataFrame,
                    levels: list[int]) -> tuple[dict[tuple[str, str], CellModel], dict]:
    """Fit per strategy (step model) and strategy x output class (workload,
    calibration) on the given users ``levels``. Returns (models, step models)."""
    st = steps[steps[mn.REQ_USERS].isin(levels)]
    steps_models = stepcost.fit_step_models(st)
    meas = _measured(cells[cells[mn.REQ_USERS].isin(levels)])
    out = {}
    for (strategy, oc), req in flagged[flagged[mn.REQ_USERS].isin(levels)].groupby(
            [mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS]):
        model = steps_models.get(strategy)
        if model is None:
            continue
        s_steps = st[st[mn.STEP_STRATEGY].eq(strategy)]
        if mn.REQ_OUTPUT_CLASS in s_steps and s_steps[mn.REQ_OUTPUT_CLASS].eq(oc).any():
            s_steps = s_steps[s_steps[mn.REQ_OUTPUT_CLASS].eq(oc)]
        w = _workload(s_steps, req, strategy)
        out[(strategy, oc)] = _calibrated(strategy, oc, model, w, meas, levels)
    return out, steps_models


def _calibrated(strategy: str, oc: str, model, w, meas: pd.DataFrame, levels) -> "CellModel":
    """``CellModel`` of one strategy x output class, calibrated per output class: the median
    over the fitted users levels of measured / modelled output tokens/s and TPOT p50 (1.0
    where no level has both)."""
    r_tps, r_tpot = [], []
    for users in levels:
        key = (strategy, oc, users)
        if key not in meas.index:
            continue
        tps, tpot = model_point(model, w, users)
        m = meas.loc[key]
        if np.isfinite(m[metrics.OUTPUT_TOKENS_PER_S]) and tps > 0:
            r_tps.append(m[metrics.OUTPUT_TOKENS_PER_S] / float(tps))
        if np.isfinite(m["tpot_ms_p50"]) and tpot > 0:
            r_tpot.append(m["tpot_ms_p50"] / float(tpot))
    return CellModel(strategy, oc, model, w, float(np.median(r_tps)) if r_tps else 1.0,
                     float(np.median(r_tpot)) if r_tpot else 1.0)


def fit_all_levels(results: Results, flagged: pd.DataFrame, cells: pd.DataFrame,
                   notes: list[str] | None = None) -> dict[tuple[str, str], CellModel]:
    """``fit_cell_models`` on every users level of the run: the one capacity model the
    report's crossover and ``analysis plan`` use. Step rows outside every cell (no users
    label) take their batch size as the users level (batch occupancy 1); ``notes`` gets
    a sentence saying so. Empty without a step log."""
    if results.steps is None or results.steps.empty:
        srv = server_data.cell_table(results)
        if srv.empty:
            return {}
        if notes is not None:
            notes.append("no step log: the capacity model is fitted on the target's own counters "
                         "(server /metrics: cell wall / engine steps against tokens per step)")
        levels = sorted({int(u) for u in cells[mn.REQ_USERS].unique()})
        return fit_server_cell_models(srv, flagged, cells, levels)[0]
    steps = steps_with_users(results.steps, results.requests)
    unlabelled = steps[mn.REQ_USERS].isna()
    if unlabelled.any():
        steps.loc[unlabelled, mn.REQ_USERS] = steps.loc[unlabelled, mn.STEP_BATCH_SIZE]
        if notes is not None:
            notes.append(f"{int(unlabelled.sum())} step rows lie outside every cell (no users "
                         "label): their batch size is taken as the users level (occupancy 1)")
    levels = sorted({int(u) for u in cells[mn.REQ_USERS].unique()}
                    | {int(u) for u in steps[mn.REQ_USERS].dropna().unique()})
    return fit_cell_models(steps, flagged, cells, levels)[0]


def _server_workload(g: pd.DataFrame, req: pd.DataFrame, strategy: str) -> Workload:
    """What a strategy x output class runs per step, from its server cells: v = verification
    tokens / decode request-steps, tau from the drafts and accepted counters (else the
    requests'), occupancy = mean running batch / users."""
    steps = g["request_steps"].astype(float).sum()
    verif = g["verification_tokens_total"].astype(float).sum()
    v = float(verif / steps) if steps > 0 and np.isfinite(verif) else 1.0
    drafts = g[mn.SRV_NUM_DRAFTS].astype(float).sum() if mn.SRV_NUM_DRAFTS in g else np.nan
    acc = g[mn.SRV_NUM_ACCEPTED_TOKENS].astype(float).sum() if mn.SRV_NUM_ACCEPTED_TOKENS in g else np.nan
    ok = req[req[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    tau = 1.0 + acc / drafts if drafts > 0 else metrics.pooled_tau(ok)
    if not np.isfinite(tau):
        tau = 1.0
    occ = (g["batch_size_mean"].astype(float) / g[mn.REQ_USERS].astype(float)).dropna()
    return Workload(v=v, ctx_per_row=0.0, tau=float(tau),
                    out_tokens=float(ok[mn.REQ_OUTPUT_TOKENS].mean()) if len(ok) else 1.0,
                    prompt_tokens=0.0,   # the hinge's T already carries the prompt tokens
                    occupancy=float(np.median(occ)) if len(occ) else 1.0)


def fit_server_cell_models(srv: pd.DataFrame, flagged: pd.DataFrame, cells: pd.DataFrame,
                levels: list[int]) -> tuple[dict[tuple[str, str], CellModel], dict[str, stepcost.StepModel]]:
    """``fit_cell_models`` from a target's own counters (``analysis.data.server.cell_table``), for
    a run without a step log: the hinge of ``analysis.model.server_fit`` as the step model, the
    workload from the counters (``_server_workload``). Returns (models, step models)."""
    if srv is None or srv.empty:
        return {}, {}
    curves = server_fit.fit_curves(srv, levels)
    step_models = {s: server_fit.step_model(s, c) for s, c in curves.items()}
    meas = _measured(cells[cells[mn.REQ_USERS].isin(levels)])
    out = {}
    for (strategy, oc), req in flagged[flagged[mn.REQ_USERS].isin(levels)].groupby(
            [mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS]):
        model = step_models.get(strategy)
        g = srv[srv[mn.REQ_STRATEGY].eq(strategy) & srv[mn.REQ_OUTPUT_CLASS].eq(oc)
                & srv[mn.REQ_USERS].isin(levels)]
        if model is None or g.empty:
            continue
        w = _server_workload(g, req, strategy)
        out[(strategy, oc)] = _calibrated(strategy, oc, model, w, meas, levels)
    return out, step_models


def predicted_speedup(models: dict, strategy: str, oc: str, users) -> np.ndarray | None:
    """Calibrated predicted speedup vs autoregressive at ``users`` (None if either is unfitted)."""
    s, ar = models.get((strategy, oc)), models.get((mn.AUTOREGRESSIVE, oc))
    if s is None or ar is None:
        return None
    return s.predict(users)[0] / ar.predict(users)[0]


def predicted_crossover(models: dict, strategy: str, oc: str, max_users: float = 4096.0):
    """Smallest users level in [1, max_users] where the predicted speedup < 1
    (geometric scan, then bisection to 0.01 users); None if never."""
    return capacity.first_users_below_one(lambda u: predicted_speedup(models, strategy, oc, u),
                                          max_users, points=2000, tol=0.01)


def measured_crossover_interval(cells: pd.DataFrame) -> pd.DataFrame:
    """Per strategy x output class: the measured crossover as an interval.

    ``lo`` = the highest users level with mean speedup >= 1 before the first
    level below 1, ``hi`` = that first level; ``point`` interpolates the speedup
    linearly in log(users) between them. Status ``crossed``, ``never`` (>= 1 at
    every level; lo = the highest level) or ``below_at_min``.
    """
    rows = []
    spec = cells[~cells[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE) & cells[metrics.SPEEDUP].notna()]
    for (strategy, oc), g in spec.groupby([mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS], sort=True):
        curve = g.groupby(mn.REQ_USERS)[metrics.SPEEDUP].mean().sort_index()
        u, s = curve.index.to_numpy(float), curve.to_numpy(float)
        row = {"strategy": strategy, "output_class": oc, "status": "never", "lo": float(u[-1]),
               "hi": None, "point": None,
               "levels": ", ".join(f"{int(a)}:{b:.2f}x" for a, b in zip(u, s))}
        if s[0] < 1:
            row.update(status="below_at_min", lo=None, hi=float(u[0]), point=float(u[0]))
        else:
            for i in range(1, len(s)):
                if s[i] < 1 <= s[i - 1]:
                    frac = (s[i - 1] - 1.0) / (s[i - 1] - s[i])
                    point = float(np.exp(np.log(u[i - 1]) + frac * (np.log(u[i]) - np.log(u[i - 1]))))
                    row.update(status="crossed", lo=float(u[i - 1]), hi=float(u[i]), point=point)
                    break
        rows.append(row)
    return pd.DataFrame(rows, columns=["strategy", "output_class", "status", "lo", "hi", "point",
                                       "levels"])


def backtest(results: Results, holdout: int | None = None) -> dict:
    """Fit on every users level below ``holdout`` (default: the highest), predict it.

    Returns {"holdout_users", "fit_levels", "median_abs_error", "fit_r2": {strategy:
    r² of the whole step on the fit levels}, "rows": [{"strategy", "output_class",
    "metric", "users", "predicted", "measured", "abs_error"}], "models" (not
    JSON), "crossover": [rows]}. Raises ValueError when the run has fewer than two
    users levels or no step log.
    """
    req = results.requests
    tiers = sorted(req[mn.REQ_TIER].unique())
    loose = {t: Slo(ttft_ms=1e12, tpot_ms=1e12, source="backtest") for t in tiers}
    flagged = metrics.with_slo_flags(req, loose)
    cells = metrics.cell_table(flagged)
    levels = sorted(int(u) for u in cells[mn.REQ_USERS].unique())
    if len(levels) < 2:
        raise ValueError(f"backtest needs >= 2 users levels, the run has {levels}; run more "
                         "than one tier (`--tier all`) or a sweep (`--sweep`)")
    srv = server_data.cell_table(results) if results.steps.empty else None
    if results.steps.empty and (srv is None or srv.empty):
        raise ValueError("backtest needs the server's step log (steps.parquet) or its Prometheus "
                         "counters (--server-metrics); the target gave neither")
    top = holdout if holdout is not None else levels[-1]
    if top not in levels:
        raise ValueError(f"holdout users level {top} was not measured; levels are {levels}")
    fit_levels = [u for u in levels if u < top]
    if not fit_levels:
        raise ValueError(f"no users level below the holdout {top}; levels are {levels}")
    if srv is not None:
        models, step_models = fit_server_cell_models(srv, flagged, cells, fit_levels)
    else:
        steps = steps_with_users(results.steps, req)
        models, step_models = fit_cell_models(steps, flagged, cells, fit_levels)
    meas = _measured(cells)
    rows = []
    for (strategy, oc), cm in sorted(models.items()):
        key = (strategy, oc, top)
        if key not in meas.index:
            continue
        tps, tpot = cm.predict(top)
        pred = {metrics.OUTPUT_TOKENS_PER_S: float(tps), "tpot_ms_p50": float(tpot)}
        sp = predicted_speedup(models, strategy, oc, top)
        if strategy != mn.AUTOREGRESSIVE and sp is not None:
            pred[metrics.SPEEDUP] = float(sp)
        for metric, p in pred.items():
            m = float(meas.loc[key, metric])
            if not np.isfinite(m) or m == 0:
                continue
            rows.append({"strategy": strategy, "output_class": oc, "metric": metric,
                         "users": int(top), "predicted": p, "measured": m,
                         "abs_error": abs(p - m) / abs(m)})
    errs = [r["abs_error"] for r in rows]
    measured_x = measured_crossover_interval(cells)
    crossover = []
    for r in measured_x.to_dict("records"):
        r["predicted"] = predicted_crossover(models, r["strategy"], r["output_class"])
        crossover.append(r)
    return {"holdout_users": int(top), "fit_levels": fit_levels,
            "median_abs_error": float(np.median(errs)) if errs else None,
            "fit_r2": {s: float(m.r2_step) for s, m in step_models.items()},
            "rows": rows, "crossover": crossover, "models": models, "cells": cells}


def to_json(bt: dict) -> dict:
    """The command contract's JSON (the ``models`` and ``cells`` objects dropped)."""
    return {k: v for k, v in bt.items() if k not in ("models", "cells")}
