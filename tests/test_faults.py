"""Fault injection on real processes: what a user sees and what is lost.

Each fault of README "Faults" is made real here: a strategy replica's process
killed by pid mid run, a load-generator worker (Ray actor) killed by pid, open-
loop overload at 3x the measured capacity, ``kill -9`` of the load generator
(and of its writer) mid cell, and a 1-minute soak. The service is the real one
(``python -m cluster up`` on a private Ray head, the tiny engine on
``models/target``), shut down in the fixture's ``finally``. Every request loop
is bounded in count and time.

The first tests are fast checks of the pieces the slow ones rely on (outage
window, degraded recommendation, retry delay).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from analysis import faults
from configs import metric_names as M
from loadgen.cells import parse_retry_after, retry_delay_s

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------- fast checks
def _row(strategy, status, end, first=None, tokens=8, tier="low", oc="short"):
    return {M.REQ_RUN_ID: "r", M.REQ_STRATEGY: strategy, M.REQ_TIER: tier, M.REQ_OUTPUT_CLASS: oc,
            M.REQ_USERS: 2, M.REQ_STATUS: status, M.REQ_SCHEDULED_TS: end - 1.0, M.REQ_END_TS: end,
            M.REQ_FIRST_TOKEN_TS: first, M.REQ_OUTPUT_TOKENS: tokens if status == "ok" else None,
            M.REQ_RETRIES: 0}


def test_outage_window_timeline_and_degraded_note():
    rows = [_row("ngram", "ok", 100.0 + i, 99.5 + i) for i in range(5)]           # 100..104 ok
    rows += [_row("ngram", "disconnected", 105.2), _row("ngram", "disconnected", 105.3)]  # replica died
    rows += [_row("ngram", "ok", 113.0 + i, 112.0 + i) for i in range(3)]          # back: token at 112.0
    rows += [_row("autoregressive", "ok", 100.0 + i, 99.6 + i) for i in range(8)]
    rows += [_row("autoregressive", "rejected", 101.5)]                           # 429: not a failure
    df = pd.DataFrame(rows)
    out = faults.outages(df).set_index(M.REQ_STRATEGY)
    assert out.loc["ngram", "n_failed"] == 2 and out.loc["ngram", "failed_by_status"] == "disconnected: 2"
    assert out.loc["ngram", "outage_start_ts"] == 105.2 and out.loc["ngram", "outage_end_ts"] == 112.0
    assert out.loc["ngram", "outage_s"] == pytest.approx(6.8) and out.loc["ngram", "recovered"]
    assert out.loc["autoregressive", "n_failed"] == 0 and out.loc["autoregressive", "n_rejected"] == 1
    assert math.isnan(out.loc["autoregressive", "outage_s"])
    tl = faults.timeline(df)
    ng = tl[tl[M.REQ_STRATEGY].eq("ngram")].set_index("t_s")
    t_fail = math.floor(105.2 - tl.attrs["t0"])
    assert ng.loc[t_fail, "n_failed"] == 2 and ng.loc[t_fail, "error_rate"] == 1.0
    assert ng.loc[t_fail + 2, "n_ended"] == 0 and ng.loc[t_fail + 2, "output_tokens_per_s"] == 0  # the gap
    rec = {"low": {"short": {"strategy": "autoregressive", "note": ""}}, "mid": {"short": {"note": ""}}}
    faults.annotate_degraded(rec, faults.outages(df))
    assert rec["low"]["short"]["degraded"] and "degraded run" in rec["low"]["short"]["note"]
    assert rec["low"]["short"]["degraded_strategies"]["ngram"]["failed"] == 2
    assert rec["mid"]["short"]["degraded"] is False


def test_retry_delay_honours_retry_after():
    assert retry_delay_s(1, None, 0.5) == 0.5 and retry_delay_s(3, None, 0.5) == 2.0
    assert retry_delay_s(1, 3.0, 0.5) == 3.0            # never sooner than Retry-After
    assert retry_delay_s(10, None, 0.5, cap_s=5.0) == 5.0
    assert parse_retry_after("2") == 2.0 and parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
