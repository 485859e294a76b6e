"""Concurrency sweep order and stop rules (pure), and ``--sweep --repeats`` end to end
against the fake server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from configs import metric_names as M
from loadgen.tools import fake_server
from loadgen.run.sweep import SweepState, grid_cells, sweep_cells, sweep_levels
from tests.tiers_file import write_tiers

REPO = Path(__file__).resolve().parent.parent


def test_sweep_levels():
    assert sweep_levels(1, 2, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert sweep_levels(2, 1.5, 10) == [2, 3, 4, 7]  # 2, 3, 4.5->4, 6.75->7, 10.1 > 10
    with pytest.raises(ValueError):
        sweep_levels(1, 1.0, 8)


def _drive(tps_of, strategies, levels, repeats=1):
    state, ran = SweepState(), []
    for spec in sweep_cells(strategies, ["long"], "high", levels, state, repeats):
        ran.append((spec.strategy, spec.users, spec.repeat))
        state.record(spec.strategy, "long", spec.users, tps_of(spec.strategy, spec.users), 1.0)
    return state, ran


def test_sweep_stops_each_strategy_at_its_crossover_or_saturation():
    speed = {M.DFLASH: {1: 2.0, 2: 1.6, 4: 1.2, 8: 0.9, 16: 0.7},
             M.NGRAM: {1: 1.3, 2: 1.2, 4: 1.1, 8: 1.05, 16: 1.02}}

    def tps(s, n):
        ar = 100.0 * min(n, 8)  # autoregressive saturates at 8 users
        return ar if s == M.AUTOREGRESSIVE else ar * speed[s][n]

    state, ran = _drive(tps, [M.AUTOREGRESSIVE, M.DFLASH, M.NGRAM], [1, 2, 4, 8, 16, 32])
    dflash = [u for s, u, _ in ran if s == M.DFLASH]
    ngram = [u for s, u, _ in ran if s == M.NGRAM]
    assert dflash == [1, 2, 4, 8]                  # below 1 at 8: bracket (4, 8)
    assert state.stopped[(M.DFLASH, "long")] == "below_1"
    assert ngram == [1, 2, 4, 8, 16]               # 16 gives < 5% more than 8: saturated
    assert state.stopped[(M.NGRAM, "long")] == "saturated"
    assert [u for s, u, _ in ran if s == M.AUTOREGRESSIVE] == [1, 2, 4, 8, 16]


def test_sweep_goes_on_while_only_the_strategy_saturates():
    # dspark's replica is full from 1 user, autoregressive still grows: its speedup falls,
    # so the sweep keeps going until it crosses 1 (the old rule stopped at 2 as "saturated")
    s_tps = {1: 300.0, 2: 305.0, 4: 310.0, 8: 312.0}
    state, ran = _drive(lambda s, n: 100.0 * n if s == M.AUTOREGRESSIVE else s_tps[n],
                        [M.AUTOREGRESSIVE, M.DSPARK], [1, 2, 4, 8])
    assert [u for s, u, _ in ran if s == M.DSPARK] == [1, 2, 4]
    assert state.stopped[(M.DSPARK, "long")] == "below_1"


def test_sweep_repeats_and_grid_order():
    _, ran = _drive(lambda s, n: 100.0 * n, [M.AUTOREGRESSIVE, M.NGRAM], [1, 2], repeats=2)
    assert ran[:4] == [(M.AUTOREGRESSIVE, 1, 0), (M.AUTOREGRESSIVE, 1, 1), (M.NGRAM, 1, 0),
                       (M.NGRAM, 1, 1)]
    grid = list(grid_cells(["a", "b"], ["low"], ["short"], repeats=3))
    assert [(c.strategy, c.repeat) for c in grid] == [("a", 0), ("a", 1), ("a", 2), ("b", 0),
                                                       ("b", 1), ("b", 2)]


@pytest.mark.slow
def test_sweep_with_repeats_end_to_end(tmp_path):
    tiers = write_tiers(tmp_path, {"users": 2, "spawn_rate": 100, "duration_s": 1, "max_tokens": 6,
                                   "slo": {"ttft_ms": 1000, "tpot_ms": 100}})
    with fake_server.running("--ttft-ms", "20", "--gap-ms", "10", "--tokens-per-chunk", "2") as url:
        p = subprocess.run([sys.executable, "-m", "loadgen", "--sweep", "--sweep-max-users", "2",
                            "--repeats", "2", "--output", "short", "--target", url,
                            "--tiers-file", str(tiers), "--results", str(tmp_path / "res"),
                            "--strategies", "ngram"], capture_output=True, text=True, timeout=120,
                           cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (d,) = list((tmp_path / "res").iterdir())
    df = pd.read_parquet(d / "requests.parquet")
    assert set(df[M.REQ_TIER]) == {"sweep"} and set(df[M.REQ_REPEAT]) == {0, 1}
    assert set(df[M.REQ_STRATEGY]) == {M.AUTOREGRESSIVE, M.NGRAM}   # reference added
    assert 1 in set(df[M.REQ_USERS]) and set(df[M.REQ_USERS]) <= {1, 2}
    man = json.loads((d / "manifest.json").read_text())
    assert man["schema_version"] >= 2 and man["sweep"]["levels"] == [1, 2]
    assert "sweep" in man["config"]["slo"]
    steps = pd.read_parquet(d / "steps.parquet")
    labelled = steps[steps[M.REQ_TIER].eq("sweep")]
    assert not labelled.empty and set(labelled[M.REQ_USERS].dropna()) <= {1, 2}
