"""The plan's queue model (analysis.model.replica_model) against closed-form queues, and
``analysis plan`` on a synthetic run whose step cost is known (tests/capacity_synth.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.model import backtest as bt
from analysis.decide.plan import plan
from analysis.model.replica_model import ReplicaModel, replicas_needed
from analysis.model.stepcost import DecodeCost, StepModel
from configs import metric_names as mn
from configs.tiers import Slo
from tests import capacity_synth as cs

LOOSE = Slo(ttft_ms=1e9, tpot_ms=1e9, source="flags")


def _model(floor_ms: float, row_ms: float, out_tokens: float, s: int, w: int,
           ttft_ab=(0.0, 1.0)) -> ReplicaModel:
    """A replica whose step costs floor + row * B ms, tau 1, no prefill: X(b) = 1000 b / (step L)."""
    step = StepModel("x", DecodeCost(floor_ms, row_ms, 0.0, 1e9), None, 0.0, (0.0, 0.0))
    work = bt.Workload(v=1.0, ctx_per_row=0.0, tau=1.0, out_tokens=out_tokens, prompt_tokens=0.0,
                       occupancy=1.0)
    cell = bt.CellModel("x", "long", step, work, 1.0, 1.0)
    return ReplicaModel("x", "long", cell, out_tokens, ttft_ab, np.ones((1, 2)), s, w, 8)


def test_constant_service_rate_is_mm1k():
    # step = 2 ms * B: one completion per 2 ms * 100 tokens = 5 req/s whatever the batch (M/M/1/K)
    m = _model(0.0, 2.0, 100.0, s=4, w=6)
    assert m.saturation_rps() == pytest.approx(5.0)
    lam, mu, k_max = 4.0, 5.0, 10
    rho = lam / mu
    pi = [(1 - rho) * rho ** k / (1 - rho ** (k_max + 1)) for k in range(k_max + 1)]
    p = m.predict(lam, LOOSE)
    assert p.reject_share == pytest.approx(pi[-1], rel=1e-9)
    assert p.mean_in_system == pytest.approx(sum(k * q for k, q in enumerate(pi)), rel=1e-9)
    assert p.attainment == pytest.approx(1 - pi[-1], rel=1e-9)   # loose SLO: only 429s miss
    assert m.predict(5.5, LOOSE).attainment == 0.0 and not m.predict(5.5, LOOSE).stable


def test_batch_independent_step_is_erlang_loss_and_replicas_by_hand():
    # step 10 ms whatever B, 50-token outputs: each request in the batch completes at 2 req/s,
    # X(b) = 2b; no waiting room: M/M/S/S, reject share = Erlang B(S, lam / 2)
    s = 8
    m = _model(10.0, 0.0, 50.0, s=s, w=0)

    def erlang_b(servers, a):
        b = 1.0
        for k in range(1, servers + 1):
            b = a * b / (k + a * b)
        return b
    for lam in (2.0, 8.0, 15.0):
        p = m.predict(lam, LOOSE)
        assert p.reject_share == pytest.approx(erlang_b(s, lam / 2), rel=1e-9)
        assert p.attainment == pytest.approx(1 - erlang_b(s, lam / 2), rel=1e-9)
        assert p.tpot_ms == pytest.approx(10.0)
    # smallest N with Erlang B(8, qps / N / 2) <= 0.1 at qps 30: by hand over N
    want = next(n for n in range(1, 50) if erlang_b(s, 30.0 / n / 2) <= 0.1)
    n, at_n, below = replicas_needed(m, 30.0, LOOSE, 0.9)
    assert n == want == 3
    assert at_n.attainment >= 0.9 > below.attainment
    # a TTFT SLO below ttft_b * step misses everything: no replica count helps
    assert replicas_needed(m, 30.0, Slo(ttft_ms=5.0, tpot_ms=1e9), 0.9) == (None, None, None)


def test_waiting_adds_ttft_of_queued_departures():
    # M/M/1 with a waiting room: an arrival finding k requests waits k / X(S) s before its step
    m = _model(0.0, 2.0, 100.0, s=1, w=50, ttft_ab=(0.0, 1.0))
    # (X = 5 req/s); TTFT = 2 ms (one step of batch 1) + 200 ms * k. At 4 req/s the SLO
    # 2 + 200 * 8 ms misses exactly the arrivals finding k >= 9: P = 0.8 ** 9 (M/M/1)
    p = m.predict(4.0, Slo(ttft_ms=2.0 + 200.0 * 8 + 1e-6, tpot_ms=1e9))
    assert p.attainment == pytest.approx(1 - 0.8 ** 9, abs=1e-3)


def test_plan_replicas_from_the_fitted_model_past_the_measured_users(tmp_path):
    # true saturation of one autoregressive replica on long outputs: batch 32 (max_num_seqs),
    # step 4 + 0.05 * 32 = 5.6 ms, tau 1, 120 tokens -> 1000 * 32 / (5.6 * 120) = 47.6 req/s
    sat = 1000 * 32 / (float(cs.true_step_ms(mn.AUTOREGRESSIVE, 32)) * 120)
    full = cs.write_sweep_run(tmp_path / "full", levels=(1, 2, 4, 8, 16, 32))
    low = cs.write_sweep_run(tmp_path / "low", levels=(1, 2, 4, 8))
    for run, extrapolated in ((full, False), (low, True)):
        out = plan(run, qps=100, tier="sweep", slo_ttft_ms=1e6, slo_tpot_ms=1e6)
        ar = next(r for r in out["model"] if r["strategy"] == mn.AUTOREGRESSIVE
                  and r["output_class"] == "long")
        assert ar["saturation_rps"] == pytest.approx(sat, rel=0.02)
        # loose SLO: a replica holds any rate below saturation; 100 / 2 = 50 > 47.6 -> 3
        assert ar["replicas"] == 3 and ar["predicted_attainment_minus_one"] == 0.0
        assert ar["predicted_attainment"] >= 0.9
        assert ar["extrapolated"] is extrapolated and ar["measured_users_max"] == (32 if not extrapolated else 8)
    assert any("EXTRAPOLATED" in a for a in out["assumptions"])
    # a TPOT SLO binds before saturation: fewer requests per replica, N meets it and N - 1 not
    out = plan(full, qps=100, tier="sweep", slo_ttft_ms=1e6, slo_tpot_ms=5.0)
    ar = next(r for r in out["model"] if r["strategy"] == mn.AUTOREGRESSIVE
              and r["output_class"] == "long")
    assert ar["capacity_rps"] < 0.9 * sat
    assert ar["replicas"] == math.ceil(100 / ar["capacity_rps"] - 1e-9)
    assert ar["predicted_attainment"] >= 0.9 > ar["predicted_attainment_minus_one"]


def test_plan_for_engine_limits_set_by_flags(tmp_path):
    """``plan(engine_limits={"max_num_seqs": S})``: the queue holds at most S in service; one
    replica then saturates at 1000 S / (step(S) L) req/s, so a load one replica held at the
    Serve config's 32 needs more replicas at S = 4; the assumptions say so."""
    full = cs.write_sweep_run(tmp_path / "full", levels=(1, 2, 4, 8, 16, 32))
    base = plan(full, qps=40, tier="sweep", slo_ttft_ms=1e6, slo_tpot_ms=1e6)
    small = plan(full, qps=40, tier="sweep", slo_ttft_ms=1e6, slo_tpot_ms=1e6,
                 engine_limits={"max_num_seqs": 4, "max_waiting": 0})

    def ar(out):
        return next(r for r in out["model"] if r["strategy"] == mn.AUTOREGRESSIVE
                    and r["output_class"] == "long")
    sat4 = 1000 * 4 / (float(cs.true_step_ms(mn.AUTOREGRESSIVE, 4)) * 120)
    assert ar(small)["saturation_rps"] == pytest.approx(sat4, rel=0.03)
    assert ar(base)["replicas"] == 1 and ar(small)["replicas"] > 40 / sat4
    assert any("max_num_seqs 4" in a and "max_waiting 0" in a for a in small["assumptions"])
