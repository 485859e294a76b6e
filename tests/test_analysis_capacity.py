"""Capacity pieces with known answers: hinge fit (the prefill part of the step cost
model), measured crossover, knee. The step cost model and its predicted crossover:
tests/test_capacity_model.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.data import metrics
from analysis.model.capacity import fit_cost_curve
from analysis.data.load import load_results
from configs.tiers import Slo
from configs import metric_names as mn
from tests import analysis_synth as syn


def test_hinge_fit_recovers_knee_between_samples():
    t = np.repeat([1, 2, 3, 5, 7, 11, 13, 50, 70, 90, 130, 200], 3).astype(float)
    fit = fit_cost_curve(t, np.maximum(5.0, 1.0 + 0.05 * t))
    assert fit.knee_tokens == pytest.approx(80.0, rel=1e-3)  # between samples 70 and 90
    assert fit.floor_ms == pytest.approx(5.0, rel=1e-4)
    assert fit.slope_ms_per_token == pytest.approx(0.05, rel=1e-4)
    assert fit.r2 == pytest.approx(1.0) and fit.knee_observed


def test_hinge_fit_flat_and_linear():
    flat = fit_cost_curve(np.arange(1, 20), np.full(19, 3.0))
    assert flat.slope_ms_per_token == 0.0 and flat.floor_ms == 3.0 and not flat.knee_observed
    t = np.arange(10, 30, dtype=float)
    line = fit_cost_curve(t, 2.0 + 0.1 * t)
    assert line(t) == pytest.approx(2.0 + 0.1 * t)
    assert not line.knee_observed
    with pytest.raises(ValueError, match="2 distinct"):
        fit_cost_curve([4, 4], [1.0, 1.1])


def test_measured_crossover_statuses():
    cells = pd.DataFrame({mn.REQ_STRATEGY: ["a"] * 3 + ["b"] * 3 + ["c"] * 2,
                          mn.REQ_OUTPUT_CLASS: "short",
                          mn.REQ_USERS: [1, 4, 16, 1, 4, 16, 1, 4],
                          metrics.SPEEDUP: [2.0, 1.5, 1.1, 1.5, 0.5, 0.4, 0.9, 0.8]})
    out = metrics.crossover_measured(cells).set_index(mn.REQ_STRATEGY)
    assert out.loc["a", "status"] == "never" and pd.isna(out.loc["a", "crossover_users"])
    assert out.loc["b", "status"] == "crossed"
    assert out.loc["b", "crossover_users"] == pytest.approx(1 + 0.5 / 1.0 * 3)
    assert out.loc["c", "status"] == "below_at_min" and out.loc["c", "crossover_users"] == 1


def test_throughput_latency_knee(tmp_path):
    # Autoregressive saturates at 8 users: tokens/s = 50 * min(users, 8), latency by
    # Little's law flat before, linear after -> Kleinrock's power peaks at 8.
    levels = [1, 2, 4, 8, 16, 32, 64]
    syn.write_run(tmp_path / "sweep", strats=(syn.AR,), tiers={f"u{u}": u for u in levels},
                  ar_tps={u: 50.0 * min(u, 8) for u in levels}, with_steps=False, manifest_slo=None)
    results = load_results(tmp_path / "sweep")
    flagged = metrics.with_slo_flags(results.requests, {f"u{u}": Slo() for u in levels})
    knees = metrics.throughput_latency_knee(metrics.cell_table(flagged))
    assert set(knees["knee_users"]) == {8}
    assert knees["knee_tokens_per_s"].tolist() == pytest.approx([400.0, 400.0], rel=1e-4)
