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


def test_theta_moves_the_others_prompts_out_of_tpot_and_leaves_the_loop_alone():
    """With theta = 0.5 (``Workload.levels``' fifth field) a decode step carries half of the
    others' prompts: TPOT = (step + theta x q (B - 1) / B x pre) / tau, tokens/s as at theta 1
    (the request's time and the batch are the engine's either way)."""
    m = _step_model(2.0, prefill_ms=10.0)
    base = bt.Workload(v=1.0, ctx_per_row=0.0, tau=1.0, out_tokens=33.0, prompt_tokens=50.0,
                       occupancy=1.0, levels=((4.0, 1.0, 1.0, 0.0, 1.0), (16.0, 1.0, 1.0, 0.0, 1.0)))
    half = bt.Workload(**{**base.__dict__,
                          "levels": ((4.0, 1.0, 1.0, 0.0, 0.5), (16.0, 1.0, 1.0, 0.0, 0.5))})
    t1, p1 = bt.model_point(m, base, 8)
    t2, p2 = bt.model_point(m, half, 8)
    assert float(t2) == pytest.approx(float(t1), rel=1e-12)
    # solve the batch as model_point does, then the interference per step by hand
    b = 8.0
    for _ in range(200):
        q = b / 33.0
        step = 2.0 + q * 10.0
        own = 2.0 + q * (b - 1.0) / b * 10.0
        r_pre, r_dec = 1.5 * step * (b - 1.0) / b + 10.0, 32.0 * own
        b = 0.5 * b + 0.5 * min(8.0, 8.0 * r_dec / (r_pre + r_dec))
    inter = b / 33.0 * (b - 1.0) / b * 10.0
    assert float(p1) == pytest.approx(2.0 + inter, rel=1e-3)
    assert float(p2) == pytest.approx(2.0 + 0.5 * inter, rel=1e-3)
    # held outside the levels; a workload without the field shares the mean
    assert float(half.theta_at(1.0)) == 0.5 and float(_work().theta_at(4.0)) == 1.0


def _theta_cell(in_ttft: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """4 users' requests on one replica, every step 2 ms of decode at B = 4 but the mixed
    ones (12 ms: 10 ms of prompt); each request decodes over steps 1..8 of its own 10-step
    cycle, its first token at step 0. ``in_ttft``: the mixed steps are the steps each
    request waits through for its first token (step 9 of the cycle, before the next
    request's start), else they are spread over the decode windows."""
    steps, reqs = [], []
    t, k = 100.0, 0
    for cycle in range(40):
        start = t
        for i in range(10):
            mixed = (i == 9) if in_ttft else (i == 1 + cycle % 8)
            t += (12.0 if mixed else 2.0) / 1000.0
            steps.append({mn.STEP_TS: t, mn.STEP_BATCH_SIZE: 4, mn.STEP_PREFILL_TOKENS: 50 if mixed else 0,
                          mn.STEP_MS: 12.0 if mixed else 2.0, mn.STEP_REPLICA: "r0"})
            k += 1
        first = start + 1e-6 if in_ttft else start + 0.5e-3
        ends = steps[-2][mn.STEP_TS] if in_ttft else steps[-1][mn.STEP_TS] - 1e-6
        reqs.append({mn.REQ_FIRST_TOKEN_TS: first, mn.REQ_END_TS: ends, mn.REQ_STATUS: mn.STATUS_OK})
    return pd.DataFrame(steps), pd.DataFrame(reqs)


def test_decode_share_reads_where_the_prompts_fall():
    """theta from the step log and the requests' windows (``backtest._decode_share``): mixed
    steps spread over the decode windows give (B / (B - 1)) x the windows' share of the
    engine's decode steps; mixed steps only outside them give the floor of THETA_RANGE; one
    user gives None (no others to share with), another replica's steps 1.0."""
    st, rq = _theta_cell(in_ttft=False)
    got = bt._decode_share(st, rq)
    # every mixed step is inside a window; windows hold 9 of every 10 decode steps
    dec = 40 * 10
    win_steps = sum(((st[mn.STEP_TS] > r[mn.REQ_FIRST_TOKEN_TS]) & (st[mn.STEP_TS] <= r[mn.REQ_END_TS])).sum()
                    for _, r in rq.iterrows())
    want = (40 * 10.0 / win_steps) / (40 * 10.0 / dec * 3.0 / 4.0)
    assert got == pytest.approx(min(want, bt.THETA_RANGE[1]), rel=1e-9)
    st2, rq2 = _theta_cell(in_ttft=True)
    assert bt._decode_share(st2, rq2) == bt.THETA_RANGE[0]
    one = st.assign(**{mn.STEP_BATCH_SIZE: 1})
    assert bt._decode_share(one, rq) is None
    two = st.assign(**{mn.STEP_REPLICA: ["r0", "r1"] * (len(st) // 2)})
    assert bt._decode_share(two, rq) == 1.0
