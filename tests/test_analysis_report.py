"""analysis report on synthetic results with known answers (tests/analysis_synth.py)."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from analysis import cli
from analysis.data.load import load_results
from analysis.report.build import analyse, build_report
from configs import metric_names as mn
from tests import analysis_synth as syn


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    syn.write_run(root / "run-a")
    out = build_report(root / "run-a", root / "out")
    return root, out


def test_best_strategy_per_tier(report):
    _, out = report
    rec = out["recommendation"]
    assert set(rec) == set(syn.TIERS)
    for tier, best in syn.BEST.items():
        for oc in syn.OUTPUT_TOKENS:
            r = rec[tier][oc]
            assert r["leader"] == best, (tier, oc, r)
            # the run's A/A (autoregressive twice, identical) measures zero noise: even mid's
            # 10 % lead of ngram over dflash is decided (tests/test_race.py has the noisy cases)
            assert r["strategy"] == best and r["tied"] == [] and r["status"] == "decided", (tier, oc, r)
            assert r["noise"]["relative"] == pytest.approx(0.0, abs=1e-9) and r["looks"] == 1


def test_recommendation_values(report):
    rec = report[1]["recommendation"]
    low = rec["low"]["short"]
    # dflash at 1 user: 3.0 x 50 tokens/s, all requests within SLO; runner-up ngram 75.
    assert low["goodput"] == pytest.approx(150.0, rel=1e-4)
    assert low["runner_up"] == mn.NGRAM
    assert low["margin"] == pytest.approx(1.0, rel=1e-4)
    assert low["confidence"] == 1.0
    assert low["users"] == [1]
    assert low["speedup"] == pytest.approx(3.0, rel=1e-4)
    # mid: dflash is 2x faster but half its requests miss TTFT -> goodput 300 < ngram 330.
    mid = rec["mid"]["long"]
    assert mid["goodput"] == pytest.approx(330.0, rel=1e-4)
    assert mid["goodput_by_strategy"][mn.DFLASH] == pytest.approx(300.0, rel=1e-4)
    assert mid["confidence"] == 1.0   # zero measured noise (the A/A is exact): a sure 10 % lead
    # high: speculation loses (0.6x, 0.9x): autoregressive, margin 900/810 - 1.
    high = rec["high"]["short"]
    assert high["margin"] == pytest.approx(900 / 810 - 1, rel=1e-4)
    assert high["slo"] == {"ttft_ms": 500.0, "tpot_ms": 1000.0, "source": "manifest"}


def test_outputs_written(report):
    root, out = report
    saved = json.loads((root / "out" / "recommendation.json").read_text())
    assert saved["schema_version"] == 4
    assert saved["scope"]["line"].startswith("on this deployment only: ")
    assert saved["low"]["long"]["strategy"] == mn.DFLASH
    assert {"strategy", "goodput", "margin", "confidence"} <= set(saved["mid"]["short"])
    md = (root / "out" / "report.md").read_text()
    assert "## Recommendation" in md and "| low | short | 1 | dflash |" in md
    html = (root / "out" / "report.html").read_text()
    assert 'id="recommendation"' in html and "http://" not in html and "https://" not in html
    # 7 + step residuals + 2 backtest + throughput over time + acceptance by prompt source
    assert html.count("data:image/png;base64,") == 13   # the latency distribution (ECDF) figure included
    assert "cond = accepted at i / accepted at i-1" in md and "uncond = accepted at i / drafts" in md


def test_crossover_measured_and_predicted(report):
    rows = {(r["strategy"], r["output_class"]): r for r in report[1]["crossover"]}
    for strategy, users in syn.MEASURED_CROSSOVER.items():
        for oc in syn.OUTPUT_TOKENS:
            r = rows[(strategy, oc)]
            assert r["status"] == "crossed"
            assert r["crossover_users"] == pytest.approx(users, rel=1e-3)
            assert r["tau"] == pytest.approx(syn.DFLASH.tau if strategy == mn.DFLASH
                                             else syn.NGRAM.tau)


def test_capacity_and_acceptance_tables(report):
    a = analyse(load_results(report[0] / "run-a"))
    cap = a.capacity.set_index(mn.STEP_STRATEGY)
    # dflash verifies k+1 = 8 tokens per request and emits tau = 4: half is wasted.
    assert cap.loc[mn.DFLASH, "wasted_share"] == pytest.approx(0.5)
    assert cap.loc[mn.NGRAM, "wasted_share"] == pytest.approx(1 - 2.5 / 4)
    assert cap.loc[mn.AUTOREGRESSIVE, "wasted_share"] == pytest.approx(0.0)
    assert cap.loc[mn.DFLASH, "verification_per_emitted"] == pytest.approx(2.0)
    # the one step cost model recovers the synthetic target: max(FLOOR, INTERCEPT + SLOPE*T)
    # = FLOOR + SLOPE * max(0, T - KNEE); dflash verifies T = 8 B tokens, 8..512 across the knee
    dec = a.capacity_model["step_models"][mn.DFLASH].decode
    assert dec.floor_ms == pytest.approx(syn.FLOOR_MS, rel=0.01)
    assert dec.token_ms == pytest.approx(syn.SLOPE_MS, rel=0.03)
    assert dec.knee_tokens == pytest.approx(syn.KNEE_TOKENS, rel=0.03)
    assert dec.row_ms == pytest.approx(0.0, abs=2e-3)
    assert "fit_floor_ms" not in a.capacity.columns   # no second (pooled) cost fit
    pos = a.positions[a.positions[mn.REQ_STRATEGY].eq(mn.DFLASH)].set_index("position")
    assert list(pos["uncond"]) == pytest.approx(list(syn.DFLASH.accept_rates))
    assert pos.loc[2, "cond"] == pytest.approx(0.8 / 0.9)
    assert "top1_cov" not in pos.columns  # coverage is offline only (bench.acceptance)
    cells = a.cells.set_index([mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS])
    c = cells.loc[(mn.DFLASH, "mid", "short")]
    assert c["slo_attainment"] == pytest.approx(0.5)
    assert c["speedup"] == pytest.approx(2.0, rel=1e-4)
    assert c[mn.ACCEPTANCE_LENGTH] == pytest.approx(4.0)
    assert c["ttft_ms_p99"] == pytest.approx(5000.0, rel=1e-3)


def test_the_decision_is_reproducible(report):
    results = load_results(report[0] / "run-a")
    r1 = analyse(results).recommendation["mid"]["short"]["confidence"]
    r2 = analyse(results).recommendation["mid"]["short"]["confidence"]
    assert r1 == r2


def test_slo_flags_override_manifest(report):
    results = load_results(report[0] / "run-a")
    # TTFT SLO of 10 s: dflash's slow first tokens (5 s) now pass, so it wins mid too.
    a = analyse(results, slo_ttft_ms=10_000, slo_tpot_ms=1000)
    assert a.slos["mid"].source == "flags"
    assert a.recommendation["mid"]["short"]["strategy"] == mn.DFLASH
    # TPOT SLO below every measured TPOT: nothing meets it, the baseline is shown.
    a = analyse(results, slo_tpot_ms=1.0)
    rec = a.recommendation["low"]["short"]
    assert rec["strategy"] == mn.AUTOREGRESSIVE and rec["goodput"] == 0.0 and rec["note"]


def test_missing_spec_columns_and_steps(tmp_path):
    syn.write_run(tmp_path / "ext", with_steps=False, with_spec_columns=False, manifest_slo=None)
    out = build_report(tmp_path / "ext", tmp_path / "out")
    assert out["recommendation"]["low"]["short"]["strategy"] == mn.DFLASH
    assert out["slos"]["low"]["source"] == "default"
    assert all(r["predicted_crossover_users"] is None for r in out["crossover"])
    html = (tmp_path / "out" / "report.html").read_text()
    # goodput, speedup, throughput-latency, throughput over time (needs no server stats)
    assert html.count("data:image/png;base64,") == 5   # the latency distribution (ECDF) figure included


def test_several_runs_pooled(tmp_path):
    syn.write_run(tmp_path / "runs" / "r1", run_id="r1")
    syn.write_run(tmp_path / "runs" / "r2", run_id="r2")
    results = load_results(tmp_path / "runs")
    assert [r.run_id for r in results.runs] == ["r1", "r2"]
    a = analyse(results)
    assert set(a.cells[mn.REQ_RUN_ID]) == {"r1", "r2"}
    assert a.cells["speedup"].notna().all()
    assert a.recommendation["low"]["long"]["goodput"] == pytest.approx(150.0, rel=1e-4)


def test_baseline_acceptance_drop_flags_and_exits_3(tmp_path, capsys):
    syn.write_run(tmp_path / "base", run_id="base")
    # pydoc accepted counts x0.8: dflash tau 4.0 -> 3.4 (-15%), ngram 2.5 -> 2.2 (-12%).
    syn.write_run(tmp_path / "cur", run_id="cur", tau_scale={"pydoc": 0.8})
    a = analyse(load_results(tmp_path / "cur"), baseline=tmp_path / "base")
    flagged = a.degradation[a.degradation["flagged"]]
    assert set(zip(flagged[mn.REQ_STRATEGY], flagged[mn.REQ_DATASET])) == {
        (mn.DFLASH, "pydoc"), (mn.NGRAM, "pydoc")}
    row = flagged.set_index(mn.REQ_STRATEGY).loc[mn.DFLASH]
    assert row["tau_drop"] == pytest.approx(0.15)
    assert "acceptance length" in row["reason"]
    code = cli.main(["report", str(tmp_path / "cur"), "--out", str(tmp_path / "o"),
                     "--baseline", str(tmp_path / "base")])
    assert code == 3
    assert "pydoc" in capsys.readouterr().out


def test_baseline_goodput_drop_and_clean_pass(tmp_path):
    syn.write_run(tmp_path / "base", run_id="base")
    slower = dataclasses.replace(syn.NGRAM, speedup={u: s * 0.85 for u, s in syn.NGRAM.speedup.items()})
    syn.write_run(tmp_path / "cur", run_id="cur", strats=(syn.AR, syn.DFLASH, slower))
    a = analyse(load_results(tmp_path / "cur"), baseline=tmp_path / "base")
    flagged = a.degradation[a.degradation["flagged"]]
    assert set(flagged[mn.REQ_STRATEGY]) == {mn.NGRAM}
    assert flagged["goodput_drop"].tolist() == pytest.approx([0.15, 0.15], rel=1e-3)
    same = analyse(load_results(tmp_path / "base"), baseline=tmp_path / "base")
    assert not same.degradation["flagged"].any() and len(same.degradation) == 6


def test_cli_errors(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no requests.parquet" in capsys.readouterr().err
    (tmp_path / "zero").mkdir()
    pd.DataFrame({c: pd.Series(dtype="float64") for c in
                  (mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS,
                   mn.REQ_OUTPUT_TOKENS, mn.REQ_END_TS)}).to_parquet(tmp_path / "zero" / "requests.parquet")
    assert cli.main(["report", str(tmp_path / "zero")]) == 2
    assert "0 requests" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", str(tmp_path), "--slo-ttft-ms", "fast"])
    assert exc.value.code == 2
    assert "--slo-ttft-ms" in capsys.readouterr().err


def test_the_warm_up_cut_never_hides_a_failure(report):
    """A request that failed inside the warm-up window is cut from every goodput figure but
    still shown in the faults section (outage table and timeline): the cut hides no outage."""
    results = load_results(report[0] / "run-a")
    req = results.requests.copy()
    cell = req[req[mn.REQ_STRATEGY].eq(mn.NGRAM) & req[mn.REQ_TIER].eq("low")
               & req[mn.REQ_OUTPUT_CLASS].eq("short")]
    first = cell[mn.REQ_SCHEDULED_TS].idxmin()
    req.loc[first, mn.REQ_STATUS] = mn.STATUS_DISCONNECTED
    results = dataclasses.replace(results, requests=req)
    a = analyse(results, warmup_s=1e-3)
    out = a.outages.set_index([mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS])
    assert out.loc[(mn.NGRAM, "low", "short"), "n_failed"] == 1
    assert a.timeline["n_failed"].sum() == 1
    assert a.recommendation["low"]["short"]["degraded"]
