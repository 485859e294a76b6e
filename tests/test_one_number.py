"""One number per concept: a cell's speedup, goodput and tau are the same wherever they are
printed (the answer and recommendation.json, the report's cell table, the crossover table,
the console's cell table), because each comes from one function over the same rows
(``analysis.report.build.prepare`` -> ``analysis.data.metrics.cell_table``)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from analysis.data import metrics
from analysis.data.load import load_results
from analysis.report.build import build_report, prepare
from configs import metric_names as mn
from tests import analysis_synth as syn

SAMPLINGS = {"greedy": (0.0, 1.0), "t0.7": (0.7, 0.6)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    path = syn.write_run(root / "run", samplings=SAMPLINGS)
    out = build_report(path, root / "out")
    cells = prepare(load_results(path))[-1]
    return path, out, cells, json.loads((root / "out" / "recommendation.json").read_text())


def _cell(cells: pd.DataFrame, strategy: str, tier: str, oc: str, sampling: str) -> pd.Series:
    g = cells[cells[mn.REQ_STRATEGY].eq(strategy) & cells[mn.REQ_TIER].eq(tier)
              & cells[mn.REQ_OUTPUT_CLASS].eq(oc) & cells[mn.REQ_SAMPLING].eq(sampling)]
    assert len(g) == 1
    return g.iloc[0]


def test_the_answer_and_recommendation_json_are_the_cell_table(run):
    _, out, cells, saved = run
    n = 0
    for tier, by in out["recommendation"].items():
        for oc, rec in by.items():
            for r in [rec, *rec.get("by_sampling", {}).values()]:
                for s, gp in r["goodput_by_strategy"].items():
                    c = _cell(cells, s, tier, oc, r["sampling"])
                    assert gp == pytest.approx(c[metrics.GOODPUT_TOKENS_PER_S], rel=1e-9)
                    n += 1
                lead = _cell(cells, r["leader"], tier, oc, r["sampling"])
                assert r["speedup"] == pytest.approx(lead[metrics.SPEEDUP], rel=1e-9)
                assert r["goodput"] == pytest.approx(lead[metrics.GOODPUT_TOKENS_PER_S], rel=1e-9)
    assert n == 3 * 3 * 2 * len(SAMPLINGS)      # strategies x tiers x output classes x samplings
    assert saved["low"]["short"]["speedup"] == pytest.approx(out["recommendation"]["low"]["short"]["speedup"])


def test_the_crossover_table_is_per_sampling_and_is_the_cell_table(run):
    _, out, cells, _ = run
    rows = pd.DataFrame(out["crossover"])
    flagged = prepare(load_results(run[0]))[4]
    ok = flagged[flagged[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    for _, row in rows.iterrows():
        if row[mn.REQ_STRATEGY] == mn.AUTOREGRESSIVE or not isinstance(row.get("levels"), str):
            continue
        for part in row["levels"].split(", "):
            users, speed = part.split(":")
            g = cells[cells[mn.REQ_STRATEGY].eq(row[mn.REQ_STRATEGY])
                      & cells[mn.REQ_OUTPUT_CLASS].eq(row[mn.REQ_OUTPUT_CLASS])
                      & cells[mn.REQ_SAMPLING].eq(row[mn.REQ_SAMPLING]) & cells[mn.REQ_USERS].eq(int(users))]
            assert float(speed.rstrip("x")) == pytest.approx(g[metrics.SPEEDUP].mean(), abs=0.006)
        mine = ok[ok[mn.REQ_STRATEGY].eq(row[mn.REQ_STRATEGY]) & ok[mn.REQ_OUTPUT_CLASS].eq(row[mn.REQ_OUTPUT_CLASS])
                  & ok[mn.REQ_SAMPLING].eq(row[mn.REQ_SAMPLING])]
        assert row["tau"] == pytest.approx(metrics.pooled_tau(mine), rel=1e-9)   # its own sampling's tau
    taus = rows[rows[mn.REQ_STRATEGY].eq(mn.DFLASH) & rows[mn.REQ_OUTPUT_CLASS].eq("short")].set_index(
        mn.REQ_SAMPLING)["tau"]
    assert taus["greedy"] == pytest.approx(syn.synth_tau(syn.DFLASH, 1.0), rel=1e-6)
    assert taus["t0.7"] == pytest.approx(syn.synth_tau(syn.DFLASH, 0.6), rel=1e-6)
    assert taus["t0.7"] < taus["greedy"]


def test_the_console_cell_table_prints_the_same_numbers(run):
    from rich.console import Console

    from loadgen.results.summary import render_cell_table

    _, _, cells, _ = run
    table, shown = render_cell_table(cells, max_width=400)
    assert shown[:6] == ["strategy", "tier", "out", "users", "reps", "tok/s"]
    con = Console(width=400, record=True)
    con.print(table)
    text = con.export_text()
    c = _cell(cells, mn.DFLASH, "low", "short", "t0.7")
    line = next(x for x in text.splitlines() if x.split()[:3] == [mn.DFLASH, "low", "short/t0.7"])
    assert f"{c[metrics.SPEEDUP]:.2f}" in line.split() and f"{c[metrics.GOODPUT_TOKENS_PER_S]:.1f}" in line.split()
    ar = _cell(cells, mn.AUTOREGRESSIVE, "low", "short", "greedy")
    assert int(ar["replicates"]) == 2                       # the A/A: autoregressive ran twice


def test_the_answer_states_its_scope():
    from analysis.data.scope import run_scope, scope_line

    manifest = {"target": "http://127.0.0.1:8000", "machine": {"cpu_count": 2, "memory_gb": 23.6},
                "args": {"warmup_s": 1.0, "duration": None}, "warmup": {"requests_per_strategy": 4},
                "tiers": ["low", "high"], "outputs": ["short"],
                "profile": {"tiers": {"low": {"short": {"duration_s": 10.0}},
                                      "high": {"short": {"duration_s": 10.0}}}},
                "memory": {s: {"replica": f"r{s}", "device": "cpu", "dtype": "float32",
                               "target_weight_bytes": 23_085_056} for s in ("autoregressive", "ngram")}}
    scope = run_scope([manifest])
    assert scope["target_params"] == 23_085_056 / 4 and scope["replicas"] == 1 and scope["cell_s"] == [10.0]
    assert scope_line(scope) == (
        "on this deployment only: a 5.8 M-parameter float32 target (22 MiB) on cpu, a 2-core machine "
        "with 23.6 GiB; 1 replica per strategy; 10-s cells, each one's first 1 s cut as warm-up, every "
        "strategy warmed by 4 unmeasured requests first")
    vllm = scope_line(run_scope([{**manifest, "memory": {}, "target": "http://10.0.0.5:8000"}]))
    assert vllm.startswith("on this deployment only: the target at http://10.0.0.5:8000 (its size not reported)")
