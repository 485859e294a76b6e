"""The capacity model's closed loop (``analysis.model.backtest.model_point``), the engine
loop's gap between steps (``analysis.model.stepcost.loop_gap``) and the joint calibration of
the profiled parts on steps that mix decode rows and prompt chunks
(``analysis.model.profiled.calibrate``), against numbers worked by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.model import backtest as bt
from analysis.model import profiled, stepcost
from configs import metric_names as mn


def _step_model(step_ms: float, prefill_ms: float = 0.0, gap=(0.0, 0.0), overhead=0.0):
    """A step model whose decode step costs ``step_ms`` at any batch, a prompt ``prefill_ms``."""
    from analysis.model.capacity import CostCurve

    prefill = CostCurve(prefill_ms, 0.0, 0.0) if prefill_ms else None
    return stepcost.StepModel("x", stepcost.DecodeCost(step_ms, 0.0, 0.0, 1e9), prefill, overhead,
                              (0.0, 0.0), loop_gap=gap)


def _work(out=33.0, tau=1.0, prompt=0.0, gap_ms=0.0):
    return bt.Workload(v=1.0, ctx_per_row=0.0, tau=tau, out_tokens=out, prompt_tokens=prompt,
                       occupancy=1.0, gap_ms=gap_ms)


def test_one_user_pays_its_prefill_its_steps_and_the_client_gap():
    # 1 user, 33 tokens at tau 1: a 10-ms prefill (alone: no decode rows to wait on), 32
    # decode steps of 2 ms + 0.5 ms of loop gap, then 4 ms in the client:
    # R = 10 + 32 * 2.5 = 90 ms, cycle 94 ms -> 33 / 0.094 tokens/s; TPOT the step alone
    m = _step_model(2.0, prefill_ms=10.0, gap=(0.5, 0.0))
    tps, tpot = bt.model_point(m, _work(prompt=50.0, gap_ms=4.0), 1)
    assert float(tpot) == pytest.approx(2.5)   # one row: no other request's prefill in its steps
    assert float(tps) == pytest.approx(1000.0 * 33.0 / 94.0, rel=1e-6)


def test_batch_grows_with_users_until_prefills_and_the_client_hold_it_back():
    # a step that costs 1 + 0.1 B ms, no prefill, no client gap: every user is in decode but
    # for its 1.5-step wait for a first token, so B = N * R_dec / R, solved by hand below
    m = stepcost.StepModel("x", stepcost.DecodeCost(1.0, 0.1, 0.0, 1e9), None, 0.0, (0.0, 0.0))
    w = _work(out=21.0)
    n = 8.0
    b = n
    for _ in range(200):
        step = 1.0 + 0.1 * b
        r_dec, r_pre = 20.0 * step, 1.5 * step * (b - 1.0) / b
        b = n * r_dec / (r_dec + r_pre)
    tps, tpot = bt.model_point(m, w, n)
    assert float(tpot) == pytest.approx(1.0 + 0.1 * b, rel=1e-3)
    assert float(tps) == pytest.approx(1000.0 * n * 21.0 / (r_dec + r_pre), rel=1e-3)
    # with the queue's view (every request in decode, no client): tokens/s = 1000 B / step
    tb, _ = bt.batch_point(m, w, n)
    assert float(tb) == pytest.approx(1000.0 * n / (1.0 + 0.1 * n))


def test_loop_gap_is_read_between_consecutive_steps_and_pauses_are_left_out():
    rng = np.random.default_rng(0)
    rows, t = [], 1000.0
    for i in range(400):
        b = int(rng.integers(1, 17))
        step = 2.0 + 0.3 * b
        gap = 0.1 + 0.02 * b if i % 50 else 40.0     # every 50th: the engine idled 40 ms
        t += gap + step                               # this step's end, ms
        rows.append({mn.STEP_TS: t / 1000.0, mn.STEP_MS: step, mn.STEP_BATCH_SIZE: b,
                     mn.STEP_REPLICA: "r0", mn.REQ_RUN_ID: "a"})
    g0, g1 = stepcost.loop_gap(pd.DataFrame(rows))
    assert g0 == pytest.approx(0.1, abs=1e-6) and g1 == pytest.approx(0.02, abs=1e-6)
    assert stepcost.loop_gap(pd.DataFrame(rows[:2])) == (0.0, 0.0)


def test_calibration_recovers_each_part_on_mixed_steps():
    """Steps of the run cost 1.3 x the profiled verify + 1.1 x the profiled drafter + 1.2 x
    the profiled prefill of their prompt chunk + 0.2 ms, some with decode rows only, some
    with both (the chunk inside ``verify_ms``: one forward), some prefill alone: each part's
    fit on its own column finds its scale, and the overhead."""
    prof = {"strategies": {"s": {
        "forward": [{"batch_size": b, "tokens_per_row": q, "context_len": c,
                     "step_ms": 0.5 + 0.05 * b * q + 0.001 * c, "cpu_ms": None}
                    for b in (1, 4, 16) for q in (1, 4, 8) for c in (64, 256)],
        "engine_steps": [{"batch_size": b, "tokens_per_row": 4.0, "context_per_row": 100.0,
                          "draft_ms": 0.3 * b, "verify_ms": 0.5 + 0.05 * b * 4 + 0.1 + 0.02 * b,
                          "step_ms": 0.0, "cpu_ms": None} for b in (1, 4, 16)],
        "prefill": [{"prefill_tokens": p, "step_ms": 0.04 * p, "cpu_ms": None}
                    for p in (16, 64, 256)]}}}
    prof["strategies"]["s"]["engine_steps"] = [
        {**e, "step_ms": e["draft_ms"] + e["verify_ms"]} for e in prof["strategies"]["s"]["engine_steps"]]
    parts = profiled.parts_from_profile(prof, "s")
    rng = np.random.default_rng(1)
    rows = []
    for i in range(300):
        b = int(rng.integers(0, 13)) if i % 3 else int(rng.integers(1, 13))
        p = int(rng.integers(16, 200)) if i % 2 else 0
        if b == 0 and p == 0:
            p = 32
        t = b * 4
        pv = float(parts.verify(max(b, 1), max(t, 1), max(t, 1) * 100 / 1000)) if b else 0.0
        draft = 1.1 * 0.3 * b
        # one forward for the decode rows and the prompt chunk: verify_ms holds both
        verify = 1.3 * pv + (1.2 * 0.04 * p if p and b else 0.0)
        step = draft + verify + (1.2 * 0.04 * p if p and not b else 0.0) + 0.2
        rows.append({mn.STEP_BATCH_SIZE: b, mn.STEP_PREFILL_TOKENS: p, mn.STEP_VERIFICATION_TOKENS: t,
                     mn.STEP_PADDED_TOKENS: t, mn.STEP_CONTEXT_TOKENS: 100 * b,
                     mn.STEP_DRAFT_MS: draft, mn.STEP_VERIFY_MS: verify, mn.STEP_MS: step})
    m = profiled.calibrate(parts, pd.DataFrame(rows), "s")
    assert m.decode.scale == pytest.approx(1.3, rel=1e-6)
    assert m.draft_curve.scale == pytest.approx(1.1, rel=1e-6)
    assert m.prefill.scale == pytest.approx(1.2, rel=1e-6)
    assert m.overhead_ms == pytest.approx(0.2, abs=1e-6)
    assert m.r2_step == pytest.approx(1.0, abs=1e-9)
