"""Claims check (analysis.decide.claims) on synthetic runs with known answers
(tests/analysis_synth.py): dflash2 wins low/long, dspark wins high -> held; otherwise what
the run shows instead; a strategy absent -> not measured."""

from __future__ import annotations

import json

import pytest

from analysis.data import metrics
from analysis.data.load import load_results
from analysis.data.slo import resolve_slos
from analysis.decide.claims import HELD, NOT_HELD, NOT_MEASURED, claim_lines, claims_check
from analysis.decide.recommend import recommend
from analysis.report.build import build_report
from configs import metric_names as mn
from tests import analysis_synth as syn

# speedups per users level (1 = low, 8 = mid, 64 = high); every request meets the SLOs
DFLASH2 = syn.Strat(mn.DFLASH2, {1: 3.0, 8: 2.0, 64: 0.8}, (0.9, 0.8, 0.6))
DSPARK = syn.Strat(mn.DSPARK, {1: 2.5, 8: 2.1, 64: 1.2}, (0.9, 0.7, 0.5))
DSPARK_FAST_LOW = syn.Strat(mn.DSPARK, {1: 3.6, 8: 2.1, 64: 1.2}, (0.9, 0.7, 0.5))
DSPARK_AS_DFLASH2 = syn.Strat(mn.DSPARK, {1: 3.0, 8: 2.0, 64: 1.2}, (0.9, 0.7, 0.5))


def _claims(tmp_path, strats):
    run = syn.write_run(tmp_path / "run", strats=strats, with_steps=False)
    res = load_results(run)
    slos = resolve_slos(sorted(res.requests[mn.REQ_TIER].unique()), res.manifest_config)
    flagged = metrics.with_slo_flags(res.requests, slos)
    rec = recommend(flagged, metrics.cell_table(flagged), slos)
    rows = claims_check(rec)
    return rec, {(r["claim_id"], r["output_class"]): r for r in rows}, rows


def test_claim_held(tmp_path):
    rec, by, rows = _claims(tmp_path, (syn.AR, DFLASH2, DSPARK))
    low = by[("dflash2-low-long", "long")]
    assert low["verdict"] == HELD and low["winner"] == mn.DFLASH2 and low["status"] == "decided"
    # dflash2 3.0x vs dspark 2.5x: 20% margin, measured
    assert low["margin"] == pytest.approx(0.2, rel=1e-3) and low["claimed_vs_winner"] == 0.0
    for oc in ("short", "long"):
        high = by[("dspark-high", oc)]
        assert high["verdict"] == HELD and high["winner"] == mn.DSPARK
        assert high["margin"] == pytest.approx(0.2, rel=1e-3)   # 1.2x vs autoregressive 1.0x
    assert by[("dspark-high", "all")]["verdict"] == HELD
    lines = claim_lines(rows)
    assert lines[0].startswith('claim "the parallel drafter with path selection (dflash2) wins at low '
                               'concurrency with long outputs": HELD on this deployment (low/long: dflash2 won: +20.0% '
                               'goodput over dspark')
    assert lines[1].startswith('claim "the confidence-scheduled hybrid (dspark) wins at high '
                               'concurrency": HELD on this deployment')


def test_claim_did_not_hold_says_what_won(tmp_path):
    _, by, _ = _claims(tmp_path, (syn.AR, DFLASH2, DSPARK_FAST_LOW))
    low = by[("dflash2-low-long", "long")]
    assert low["verdict"] == NOT_HELD and low["winner"] == mn.DSPARK
    assert low["claimed_vs_winner"] == pytest.approx(3.0 / 3.6 - 1, rel=1e-3)
    assert low["shows"].startswith("dspark won instead: +20.0% over dflash2; dflash2 -16.7% vs dspark")
    assert by[("dspark-high", "all")]["verdict"] == HELD


def test_claim_equivalent_is_no_single_winner(tmp_path):
    _, by, _ = _claims(tmp_path, (syn.AR, DFLASH2, DSPARK_AS_DFLASH2))
    low = by[("dflash2-low-long", "long")]
    assert low["status"] == "equivalent" and low["verdict"] == NOT_HELD
    assert low["shows"].startswith("no single winner: ") and "dflash2 among them" in low["shows"]


def test_claim_not_measured_without_the_strategy(tmp_path):
    _, by, rows = _claims(tmp_path, (syn.AR, DFLASH2, syn.NGRAM))
    assert by[("dspark-high", "all")]["verdict"] == NOT_MEASURED
    assert by[("dspark-high", "short")]["shows"] == "dspark not in this run"
    assert by[("dflash2-low-long", "long")]["verdict"] == HELD
    assert "NOT MEASURED" in claim_lines(rows)[1]


def test_report_has_the_claims_section_and_json(tmp_path):
    run = syn.write_run(tmp_path / "run", strats=(syn.AR, DFLASH2, DSPARK_FAST_LOW))
    out = build_report(run, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Claims check" in md and "## Race to a decision" in md
    assert "DID NOT HOLD on this deployment (low/long: dspark won instead" in md
    saved = json.loads((tmp_path / "out" / "recommendation.json").read_text())
    assert saved["schema_version"] == 4
    assert {r["verdict"] for r in saved["claims"] if r["output_class"] == "all"} == {HELD}
    assert saved["race"]["raced"] is False and saved["low"]["long"]["status"] == "decided"
    assert saved["low"]["long"]["repeats"] == 2 and saved["low"]["long"]["time_s"] > 0
