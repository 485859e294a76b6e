"""Output consistency arithmetic, and the report's consistency / memory / stability sections
on synthetic runs with known answers."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest

from analysis.data import consistency as cons
from analysis.report import render
from analysis.data.load import load_results
from analysis.report.build import analyse, build_report
from configs import metric_names as mn
from tests import analysis_synth as syn


def test_first_divergence_and_compare():
    assert cons.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert cons.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert cons.first_divergence([1, 2, 3], [1, 2]) == 2          # shorter output
    assert cons.first_divergence("abc", "abd") == 2                # text mode
    out = cons.compare_outputs({"p0": [1, 2], "p1": [3, 4], "p2": [5]},
                               {"p0": [1, 2], "p1": [3, 9], "p2": None}, "short")
    assert out["compared"] == 2 and out["identical"] == 1          # p2 failed: not compared
    assert out["first_divergence"] == [{"prompt_id": "p1", "output_class": "short",
                                        "position": 1, "baseline": 4, "strategy": 9}]


def test_first_token_chi_square_hand_computed():
    # [[30, 10], [10, 30]]: expected 20 everywhere, chi2 = 4 * 10^2 / 20 = 20, 1 d.o.f.
    t = cons.first_token_test(["a"] * 30 + ["b"] * 10, ["a"] * 10 + ["b"] * 30)
    assert t["chi2"] == pytest.approx(20.0) and t["dof"] == 1
    assert t["p_value"] == pytest.approx(7.744216e-06, rel=1e-4)   # P(chi2_1 > 20)
    assert t["tv"] == pytest.approx(0.5)
    same = cons.first_token_test(["a"] * 20 + ["b"] * 20, ["b"] * 20 + ["a"] * 20)
    assert same["chi2"] == pytest.approx(0.0) and same["p_value"] == pytest.approx(1.0)
    # rare tokens (expected < 5) are pooled into one category: 3 categories, 2 d.o.f.
    rare = cons.first_token_test(list("aaaaaaaaaabbbbbbbbbbxyz"), list("aaaaaaaaaabbbbbbbbbbzyx"))
    assert rare["categories"] == 3 and rare["dof"] == 2
    v = cons.sampled_verdict([{"p_value": 0.004}, {"p_value": 0.5}], alpha=0.01)
    assert v["level"] == pytest.approx(0.005) and v["diverges"]            # 0.004 < 0.01 / 2
    assert not cons.sampled_verdict([{"p_value": 0.006}, {"p_value": 0.5}])["diverges"]


def _repeats_run(path, run_id="rep"):
    """A low-tier synthetic run, its requests repeated 3 times (``repeat`` 0, 1, 2); repeat 2
    of dflash runs 1.5x longer (its tokens/s drops to 2/3)."""
    syn.write_run(path, run_id=run_id, tiers={"low": 1})
    base = pd.read_parquet(path / "requests.parquet")
    parts = []
    for r in range(3):
        d = base.copy()
        d["repeat"] = r
        for col in (mn.REQ_SCHEDULED_TS, mn.REQ_SENT_TS, mn.REQ_FIRST_TOKEN_TS, mn.REQ_END_TS):
            if col in d:
                d[col] = d[col] + r * 1e5
        if r == 2:
            slow = d[mn.REQ_STRATEGY].eq(mn.DFLASH)
            start = d.loc[slow].groupby(mn.REQ_OUTPUT_CLASS)[mn.REQ_SCHEDULED_TS].transform("min")
            d.loc[slow, mn.REQ_END_TS] = start + (d.loc[slow, mn.REQ_END_TS] - start) * 1.5
        parts.append(d)
    pd.concat(parts, ignore_index=True).to_parquet(path / "requests.parquet")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["memory"] = {
        mn.AUTOREGRESSIVE: {"device": "cpu", "target_weight_bytes": 2 ** 24, "draft_weight_bytes": 0,
                            "target_kv_bytes_per_token": 6144, "draft_kv_bytes_per_token": 0,
                            "target_kv_allocated_bytes": 2 ** 22},
        mn.DFLASH: {"device": "cpu", "target_weight_bytes": 2 ** 24, "draft_weight_bytes": 2 ** 22,
                    "target_kv_bytes_per_token": 6144, "draft_kv_bytes_per_token": 1024,
                    "target_kv_allocated_bytes": 2 ** 22}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / cons.CONSISTENCY_FILE).write_text(json.dumps({
        mn.AUTOREGRESSIVE: {"compared": 16, "identical": 16, "first_divergence": [],
                            "baseline_self": True, "mode": "token_ids"},
        mn.DFLASH: {"compared": 16, "identical": 15, "mode": "token_ids", "first_divergence": [
            {"prompt_id": "p3", "output_class": "short", "position": 7, "baseline": 11,
             "strategy": 12}]},
        mn.NGRAM: {"compared": 16, "identical": 16, "first_divergence": [], "mode": "token_ids"}}))
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("questions")
    run = _repeats_run(root / "run")
    out = build_report(run, root / "out")
    return root, out


def test_diverging_strategy_flagged_at_the_top_and_marked(report):
    root, out = report
    assert out["diverging"] == [mn.DFLASH]
    md = (root / "out" / "report.md").read_text()
    assert md.index("## Warnings") < md.index("## Recommendation")
    assert "OUTPUT CONSISTENCY: dflash" in md
    rec = json.loads((root / "out" / "recommendation.json").read_text())
    # dflash wins low/long in the synthetic run: the recommendation carries the warning
    assert rec["low"]["long"]["strategy"] == mn.DFLASH
    assert "diverges from autoregressive" in rec["low"]["long"]["consistency_warning"]
    html = (root / "out" / "report.html").read_text()
    assert '<section id="warnings">' in html and html.index("warnings") < html.index("recommendation")
    row = next(r for r in _md_rows(md, "Output consistency") if r["strategy"] == mn.DFLASH)
    assert (row["baseline"], row["compared"], row["identical"]) == ("autoregressive", "16", "15")
    assert row["earliest_divergence"] == "7" and row["diverges"] == "yes"


def _md_rows(md: str, title: str) -> list[dict]:
    """Rows of the markdown table under ``## title`` as {column: cell text}."""
    lines = [ln for ln in md.split(f"## {title}\n")[1].split("\n## ")[0].splitlines()
             if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, [c.strip() for c in ln.strip("|").split("|")])) for ln in lines[2:]]


def test_memory_section_per_sequence(report):
    md = (report[0] / "out" / "report.md").read_text()
    cells = next(r for r in _md_rows(md, "Memory per strategy") if r["strategy"] == mn.DFLASH)
    # synthetic short outputs: 100 prompt + 32 output tokens; (6144 + 1024) B x 132 = 0.9 MiB
    assert cells["context_tokens_short"] == "132"
    assert float(cells["kv_mib_per_seq_short"]) == pytest.approx(7168 * 132 / 2 ** 20, abs=0.01)
    assert cells["draft_weight_mib"] == "4.00" and cells["target_weight_mib"] == "16.0"


def test_stability_intervals_and_flag(report):
    md = (report[0] / "out" / "report.md").read_text()
    assert "STABILITY: 2 cell(s) vary by more than 10%" in md        # dflash short and long
    rows = {(r["strategy"], r["output_class"]): r for r in _md_rows(md, "Stability across repeats")}
    ar = rows[(mn.AUTOREGRESSIVE, "short")]
    assert ar["replicates"] == "3" and ar["flagged"] == "no" and float(ar["output_tokens_per_s_cv"]) == 0.0
    df = rows[(mn.DFLASH, "short")]
    # tokens/s x, x, 2x/3 (repeat 2 takes 1.5x as long): mean 8x/9, CV = sd / mean
    x = syn.AR_TOKENS_PER_S[1] * syn.DFLASH.speedup[1]
    vals = [x, x, x / 1.5]
    mean = sum(vals) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / 2)
    assert float(df["output_tokens_per_s_mean"]) == pytest.approx(mean, rel=2e-2)
    assert float(df["output_tokens_per_s_cv"]) == pytest.approx(sd / mean, abs=0.01)
    assert df["flagged"] == "yes" and df["flag_reason"].startswith("output_tokens_per_s CV")


def test_warmup_cut_said_in_report(tmp_path):
    run = _repeats_run(tmp_path / "run")
    results = load_results(run)
    a = analyse(results, warmup_s=2.0)
    warm = [f for f in a.questions["flags"] if f.startswith("WARM-UP")]
    assert len(warm) == 1 and "first 2 s of every cell" in warm[0]
    dropped = int(re.search(r"\((\d+) requests dropped", warm[0]).group(1))
    assert 0 < dropped < len(results.requests)
    assert len(a.flagged) == len(results.requests) - dropped
    assert "WARM-UP" in render.markdown(a).split("## Recommendation")[0]


def test_degraded_requests_counted_flagged_and_per_cell(tmp_path):
    """Requests that degraded to autoregressive (drafter fault) are counted per strategy x
    reason, flagged at the top, and counted per cell."""
    run = tmp_path / "run"
    syn.write_run(run)
    req = pd.read_parquet(run / "requests.parquet")
    ng = req.index[req[mn.REQ_STRATEGY].eq("ngram")]
    req[mn.DEGRADED_REASON] = ""
    req.loc[ng[:3], mn.DEGRADED_REASON] = "drafter_error"
    req.loc[ng[3:4], mn.DEGRADED_REASON] = "draft_deadline"
    req.to_parquet(run / "requests.parquet")
    a = analyse(load_results(run))
    table = a.questions["degraded"].set_index("reason")
    assert table.loc["drafter_error", "requests"] == 3 and table.loc["draft_deadline", "requests"] == 1
    assert (table[mn.REQ_STRATEGY] == "ngram").all()
    assert any(f.startswith("DEGRADED SPECULATION") and "ngram 3 (drafter_error)" in f
               for f in a.questions["flags"])
    assert a.cells.loc[a.cells[mn.REQ_STRATEGY].eq("ngram"), mn.CELL_DEGRADED_REQUESTS].sum() == 4
    assert a.cells.loc[a.cells[mn.REQ_STRATEGY].ne("ngram"), mn.CELL_DEGRADED_REQUESTS].sum() == 0
