"""A step cost model from a target's own counters, where no step log exists.

A real engine (vLLM) publishes no per-step times; what its counters give per cell
(``analysis.data.server``) is the number of engine steps (the iteration-tokens
histogram's count), the tokens they carried and the cell's wall time. So the fit is
across cells, not steps: step_ms = cell wall / steps against the batch tokens of a
mean step, T = (verification tokens + prompt tokens) / steps, fitted as the hinge
``analysis.model.capacity.fit_cost_curve`` (flat while memory-bound, linear past
the knee; Williams, Waterman & Patterson 2009) from 4 cells with distinct T on, a
line (non-negative slope) from 2 or 3 cells, flat at the measured step time with
one (``knee_observed`` = False says the knee was not seen). step_ms is the mean
inter-token latency where vLLM publishes its histogram (the step as its running
requests saw it), else cell wall / steps.

``step_model`` turns a curve into the ``stepcost.StepModel`` that
``analysis.model.backtest.fit_server_cell_models`` makes the ``CellModel`` the
report's crossover, the backtest and ``analysis plan`` use: decode(B, T) = the
hinge in T (prefill, draft and overhead folded into it), the workload from the
counters: v = verification tokens / decode request-steps, tau = 1 + accepted /
drafts, occupancy = mean running batch / users, calibrated as the step-log model
is (median measured / modelled over the fit levels).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.model import stepcost
from analysis.model.capacity import CostCurve, fit_cost_curve
from configs import metric_names as mn

SOURCE = "server /metrics (one sample per cell)"
MIN_CELLS_FOR_KNEE = 4   # distinct token counts a hinge needs (3 parameters); fewer: a line


def _samples(srv: pd.DataFrame, strategy: str, levels=None) -> pd.DataFrame:
    g = srv[srv[mn.REQ_STRATEGY].eq(strategy)]
    if levels is not None:
        g = g[g[mn.REQ_USERS].isin(levels)]
    return g[np.isfinite(g["batch_tokens_per_step"].astype(float)) & np.isfinite(g["step_ms"].astype(float))]


def fit_curves(srv: pd.DataFrame, levels=None) -> dict[str, CostCurve]:
    """Per strategy: the hinge step_ms(T) over its cells (module docstring); a flat curve
    at the mean step time when its cells give fewer than 2 distinct T."""
    out = {}
    if srv is None or srv.empty or "step_ms" not in srv:
        return out
    for strategy in sorted(srv[mn.REQ_STRATEGY].dropna().unique()):
        g = _samples(srv, strategy, levels)
        if g.empty:
            continue
        t, y = g["batch_tokens_per_step"].to_numpy(float), g["step_ms"].to_numpy(float)
        try:
            out[strategy] = (fit_cost_curve(t, y) if len(np.unique(t)) >= MIN_CELLS_FOR_KNEE
                             else _line(t, y, int(g["steps"].sum())))
        except ValueError:
            out[strategy] = CostCurve(floor_ms=float(np.mean(y)), slope_ms_per_token=0.0,
                                      knee_tokens=float(np.max(t)), r2=float("nan"),
                                      n_steps=int(g["steps"].sum()), knee_observed=False)
    return out


def _line(t: np.ndarray, y: np.ndarray, n_steps: int) -> CostCurve:
    """A line with a non-negative slope from the smallest observed T on (flat below it): with
    2 or 3 cells a hinge's three parameters would pass through the points and say nothing.
    Raises ValueError with fewer than 2 distinct T."""
    if len(np.unique(t)) < 2:
        raise ValueError("one token count")
    slope, icpt = np.polyfit(t, y, 1)
    if slope <= 0:
        return CostCurve(floor_ms=float(np.mean(y)), slope_ms_per_token=0.0, knee_tokens=float(t.max()),
                         r2=float("nan"), n_steps=n_steps, knee_observed=False)
    pred = icpt + slope * t
    sst = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / sst if sst > 0 else 1.0
    return CostCurve(floor_ms=float(icpt + slope * t.min()), slope_ms_per_token=float(slope),
                     knee_tokens=float(t.min()), r2=r2, n_steps=n_steps, knee_observed=False)


def fit_table(srv: pd.DataFrame) -> list[dict]:
    """The report's rows: per strategy the hinge, its r² and the cells it rests on."""
    rows = []
    for strategy, c in fit_curves(srv).items():
        g = _samples(srv, strategy)
        rows.append({"strategy": strategy, "cells": len(g), "engine_steps": int(g["steps"].sum()),
                     "tokens_per_step": ", ".join(f"{x:.1f}" for x in g["batch_tokens_per_step"]),
                     "step_ms_measured": ", ".join(f"{x:.2f}" for x in g["step_ms"]),
                     "floor_ms": c.floor_ms, "slope_ms_per_token": c.slope_ms_per_token,
                     "knee_tokens": c.knee_tokens, "knee_observed": c.knee_observed,
                     "r2": None if not np.isfinite(c.r2) else c.r2, "source": SOURCE})
    return rows


def step_model(strategy: str, curve: CostCurve) -> stepcost.StepModel:
    decode = stepcost.DecodeCost(floor_ms=curve.floor_ms, row_ms=0.0, token_ms=curve.slope_ms_per_token,
                                 knee_tokens=curve.knee_tokens, r2=curve.r2, n_steps=curve.n_steps)
    return stepcost.StepModel(strategy, decode, None, 0.0, (0.0, 0.0), r2_step=curve.r2,
                              n_steps=curve.n_steps)
