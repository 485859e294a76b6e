"""Stability arithmetic on synthetic repeats: intervals, CV flags, warm-up, time bins, inputs."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.data import stability as st
from configs import metric_names as mn

T_975_2 = 4.302652729911275     # Student t, 97.5 % quantile, 2 degrees of freedom (table value)


def _req(strategy, repeat, sched, end, tokens, tpot=10.0, drafts=None, accepted=None,
         prompt_id="humaneval/HumanEval/0", tier="low", oc="short", users=1, status="ok"):
    return {mn.REQ_RUN_ID: "r1", mn.REQ_STRATEGY: strategy, mn.REQ_TIER: tier,
            mn.REQ_OUTPUT_CLASS: oc, mn.REQ_USERS: users, st.REPEAT: repeat,
            mn.REQ_SCHEDULED_TS: sched, mn.REQ_END_TS: end, mn.REQ_OUTPUT_TOKENS: tokens,
            mn.REQ_TPOT_MS: tpot, mn.REQ_STATUS: status, mn.NUM_DRAFTS: drafts,
            mn.NUM_ACCEPTED_TOKENS: accepted, mn.REQ_PROMPT_ID: prompt_id,
            mn.REQ_DATASET: "mixed"}


def _repeats(strategy, tokens_per_s, tpots=(10.0, 10.0, 10.0), taus=(2.0, 2.0, 2.0)):
    """One replicate per value: requests from t=100*r to 100*r + 10 s carrying tps * 10 tokens."""
    rows = []
    for r, (tps, tpot, tau) in enumerate(zip(tokens_per_s, tpots, taus)):
        t0 = 100.0 * r
        # two requests, 10 drafts each, accepted = (tau - 1) * 10
        for i in range(2):
            rows.append(_req(strategy, r, t0 + i, t0 + 10.0, tps * 5.0, tpot, 10, (tau - 1) * 10))
    return rows


def test_t_interval_hand_computed():
    ci = st.t_interval([100.0, 110.0, 90.0])
    assert ci["n"] == 3 and ci["mean"] == pytest.approx(100.0)
    assert ci["std"] == pytest.approx(10.0)
    assert ci["half_width"] == pytest.approx(T_975_2 * 10.0 / math.sqrt(3), rel=1e-9)
    assert ci["low"] == pytest.approx(100.0 - 24.841377, rel=1e-6)
    assert ci["cv"] == pytest.approx(0.10)
    one = st.t_interval([5.0, float("nan")])
    assert one["n"] == 1 and one["mean"] == 5.0 and math.isnan(one["half_width"])


def test_stability_table_intervals_and_cv_flags():
    rows = (_repeats("autoregressive", (100.0, 110.0, 90.0))                       # CV 10 %: not flagged
            + _repeats("dflash", (100.0, 130.0, 70.0), taus=(3.0, 3.0, 3.0))     # CV 30 %: flagged
            + _repeats("ngram", (100.0, 100.0, 100.0), tpots=(10.0, 20.0, 30.0)))  # TPOT CV 50 %
    table = st.stability_table(pd.DataFrame(rows)).set_index(mn.REQ_STRATEGY)
    ar, df, ng = table.loc["autoregressive"], table.loc["dflash"], table.loc["ngram"]
    assert ar["replicates"] == 3
    assert ar["output_tokens_per_s_mean"] == pytest.approx(100.0)
    assert ar["output_tokens_per_s_ci95"] == pytest.approx(T_975_2 * 10 / math.sqrt(3))
    assert ar["output_tokens_per_s_cv"] == pytest.approx(0.10)
    assert not ar["flagged"]
    assert df["flagged"] and df["flag_reason"] == "output_tokens_per_s CV 30%"
    assert df["output_tokens_per_s_ci95"] == pytest.approx(T_975_2 * 30 / math.sqrt(3))
    assert df[f"{mn.ACCEPTANCE_LENGTH}_mean"] == pytest.approx(3.0)
    assert df[f"{mn.ACCEPTANCE_LENGTH}_cv"] == pytest.approx(0.0)
    assert ng["flagged"] and ng["flag_reason"] == "tpot_ms_p50 CV 50%"
    assert ng["tpot_ms_p50_mean"] == pytest.approx(20.0)


def test_runs_without_repeat_column_are_replicates():
    rows = _repeats("autoregressive", (100.0, 120.0, 80.0))
    df = pd.DataFrame(rows).drop(columns=[st.REPEAT])
    df[mn.REQ_RUN_ID] = [f"run{int(t // 100)}" for t in df[mn.REQ_SCHEDULED_TS]]
    table = st.stability_table(df)
    assert table["replicates"].tolist() == [3]
    assert table["output_tokens_per_s_cv"].iloc[0] == pytest.approx(0.2)


def test_warmup_drops_the_first_seconds_of_each_replicate():
    rows = [_req("ar", r, 100.0 * r + dt, 100.0 * r + dt + 1, 10) for r in (0, 1)
            for dt in (0.0, 1.0, 2.5, 4.0)]
    req = pd.DataFrame(rows)
    steps = pd.DataFrame({mn.STEP_TS: [0.5, 2.9, 3.5, 100.2, 104.0],
                          mn.STEP_STRATEGY: "ar", mn.REQ_TIER: "low", mn.REQ_OUTPUT_CLASS: "short"})
    kept, kept_steps, dropped = st.apply_warmup(req, steps, 2.0)
    # each replicate starts at its first send; sends at +0 and +1 s are inside the 2 s warm-up
    assert dropped == 4
    assert sorted(kept[mn.REQ_SCHEDULED_TS].tolist()) == [2.5, 4.0, 102.5, 104.0]
    assert kept_steps[mn.STEP_TS].tolist() == [2.9, 3.5, 104.0]
    same, _, none = st.apply_warmup(req, steps, 0.0)
    assert none == 0 and len(same) == len(req)
    with pytest.raises(ValueError, match="warmup_s"):
        st.apply_warmup(req, steps, -1.0)


def test_throughput_over_time_bins_and_drift():
    # one replicate: 1 s bins; requests end at 0.5, 1.5, 1.7, 2.5, 3.5 s with 10 tokens each
    rows = [_req("ar", 0, 0.0, end, 10) for end in (0.5, 1.5, 1.7, 2.5, 3.5)]
    ot = st.throughput_over_time(pd.DataFrame(rows), bin_s=1.0)
    assert ot["t_s"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert ot["tokens_per_s"].tolist() == [10.0, 20.0, 10.0, 10.0]
    drift = st.drift_table(ot)
    # first half (10 + 20) / 2 = 15, second half 10 -> drift -1/3
    assert drift["drift"].iloc[0] == pytest.approx(-1 / 3)


def test_acceptance_by_dataset_uses_prompt_source():
    rows = [_req("dflash", 0, 0, 1, 10, drafts=10, accepted=a, prompt_id=f"docs/x#{a}")
            for a in (10, 20, 30)]
    rows += [_req("dflash", 0, 0, 1, 10, drafts=10, accepted=a, prompt_id=f"stdlib/y:{a}")
             for a in (40, 40)]
    rows += [_req("autoregressive", 0, 0, 1, 10, drafts=0, accepted=0)]
    t = st.acceptance_by_dataset(pd.DataFrame(rows)).set_index("source")
    assert list(t.index) == ["docs", "stdlib"]
    assert t.loc["docs", "tau_mean"] == pytest.approx(3.0)       # taus 2, 3, 4
    assert t.loc["docs", "tau_std"] == pytest.approx(1.0)
    assert t.loc["docs", "tau_p50"] == pytest.approx(3.0)
    assert t.loc["stdlib", "n"] == 2 and t.loc["stdlib", "tau_cv"] == pytest.approx(0.0)
    assert np.isclose(t.loc["docs", "tau_cv"], 1 / 3)
