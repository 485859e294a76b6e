"""The analysis of a target's own counters (no step log, no per-request stats): per-cell
tau, per-position acceptance, verification / wasted tokens, step time, the step cost
fitted across cells, the backtest and plan model on it, and the report's notes on what a
server did not expose. Synthetic run directories with known answers."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from configs import metric_names as M
from configs import results_schema as S

# two cells of strategy "x" (an external server): users 1 and 4, 10 s each
CELLS = {
    1: {M.SRV_NUM_DRAFTS: 100, M.SRV_NUM_DRAFT_TOKENS: 400, M.SRV_NUM_ACCEPTED_TOKENS: 150,
        M.SRV_NUM_ACCEPTED_PER_POS: [60, 45, 30, 15], M.SRV_GENERATION_TOKENS: 300,
        M.SRV_REQUESTS_FINISHED: 10, M.SRV_PROMPT_TOKENS: 500, M.SRV_ENGINE_STEPS: 150,
        M.SRV_STEP_TOKENS: 800, f"{M.SRV_RUNNING}_mean": 1.0, f"{M.SRV_WAITING}_mean": 0.0,
        "counter_resets": 0, "samples": 22},
    4: {M.SRV_NUM_DRAFTS: 400, M.SRV_NUM_DRAFT_TOKENS: 1600, M.SRV_NUM_ACCEPTED_TOKENS: 600,
        M.SRV_NUM_ACCEPTED_PER_POS: [240, 180, 120, 60], M.SRV_GENERATION_TOKENS: 1200,
        M.SRV_REQUESTS_FINISHED: 40, M.SRV_PROMPT_TOKENS: 2000, M.SRV_ENGINE_STEPS: 120,
        M.SRV_STEP_TOKENS: 3200, f"{M.SRV_RUNNING}_mean": 3.5, f"{M.SRV_WAITING}_mean": 0.5,
        "counter_resets": 1, "samples": 22},
}


def write_run(root: Path, cells: dict = CELLS, facts: dict | None = None) -> Path:
    run = root / "r1"
    run.mkdir(parents=True)
    rows = []
    for users, srv in cells.items():
        n = srv.get(M.SRV_REQUESTS_FINISHED, 10)
        for i in range(n):
            t0 = 1000.0 + (0 if users == 1 else 100) + i * 10.0 / n * users
            rows.append({M.REQ_RUN_ID: "r1", M.REQ_STRATEGY: "x", M.REQ_TIER: "low" if users == 1 else "mid",
                         M.REQ_OUTPUT_CLASS: "short", M.REQ_USERS: users, M.REQ_SCHEDULED_TS: t0,
                         M.REQ_SENT_TS: t0, M.REQ_FIRST_TOKEN_TS: t0 + 0.05, M.REQ_END_TS: t0 + 1.0,
                         M.REQ_TTFT_MS: 50.0, M.REQ_TPOT_MS: 30.0, M.REQ_E2E_MS: 1000.0,
                         M.REQ_OUTPUT_TOKENS: 30, M.REQ_PROMPT_TOKENS: 50, M.REQ_STATUS: M.STATUS_OK})
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([S.coerce_row(S.REQUEST_COLUMNS, r) for r in rows],
                                        schema=S.arrow_schema(S.REQUEST_COLUMNS)), run / "requests.parquet")
    req = pd.DataFrame(rows)
    manifest = {"run_id": "r1", "schema_version": S.SCHEMA_VERSION,
                "config": {"slo": {"low": {"ttft_ms": 1000, "tpot_ms": 100},
                                   "mid": {"ttft_ms": 1000, "tpot_ms": 100}}},
                "server_metrics": facts or {"url": "http://127.0.0.1:1/metrics", "engine": "vllm",
                                            "model_labels": {"x": "x"}, "exposed": [], "missing": []},
                "cells": []}
    for users, srv in cells.items():
        g = req[req[M.REQ_USERS].eq(users)]
        manifest["cells"].append({"strategy": "x", "tier": "low" if users == 1 else "mid",
                                  "output_class": "short", "users": users, "repeat": 0,
                                  "duration_s": float(g[M.REQ_END_TS].max() - g[M.REQ_SCHEDULED_TS].min()),
                                  "n_ok": len(g), "server_metrics": srv})
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_server_cells_give_the_step_log_figures(tmp_path):
    from analysis.data import server
    from analysis.data.load import load_results

    run = write_run(tmp_path)
    srv = server.cell_table(load_results(run)).set_index(M.REQ_USERS)
    a, b = srv.loc[1], srv.loc[4]
    assert a["tau"] == pytest.approx(2.5) and b["tau"] == pytest.approx(2.5)
    # decode request-steps: generation - accepted - finished (>= drafts: ngram-like)
    assert a["request_steps"] == 300 - 150 - 10 and b["request_steps"] == 1200 - 600 - 40
    assert a["verification_tokens_total"] == 400 + 140 and a["wasted_tokens"] == 250
    assert a["wasted_share"] == pytest.approx(250 / 540)
    dur_a, dur_b = a["duration_s"], b["duration_s"]
    assert a["step_ms"] == pytest.approx(1000 * dur_a / 150) and a["steps_per_s"] == pytest.approx(150 / dur_a)
    assert b["batch_tokens_per_step"] == pytest.approx((2160 + 2000) / 120)
    assert b["batch_size_mean"] == 3.5 and b["waiting_mean"] == 0.5
    pos = server.per_position(srv.reset_index())
    assert list(pos["uncond"]) == pytest.approx([0.6, 0.45, 0.3, 0.15])
    assert list(pos["cond"]) == pytest.approx([0.6, 0.75, 30 / 45, 0.5])
    assert server.attribution_notes(srv.reset_index()) == []
    notes = server.missing_figures(load_results(run), srv.reset_index())
    assert any("1 counter reset" in n for n in notes)


def test_draft_model_cells_take_the_drafts_as_steps(tmp_path):
    """vLLM counts accepted tokens cut at max_tokens: gen - acc - finished < drafts."""
    from analysis.data import server
    from analysis.data.load import load_results

    cell = {**CELLS[1], M.SRV_GENERATION_TOKENS: 250}      # 250 - 150 - 10 = 90 < 100 drafts
    srv = server.cell_table(load_results(write_run(tmp_path, {1: cell})))
    assert srv["request_steps"].iloc[0] == 100 and srv["request_steps_from"].iloc[0] == "drafts"
    assert srv["verification_tokens_total"].iloc[0] == 500


def test_report_backtest_and_plan_use_the_server_counters(tmp_path):
    from analysis.data.load import load_results
    from analysis.model import backtest, server_fit
    from analysis.report.build import analyse, build_report

    run = write_run(tmp_path)
    results = load_results(run)
    a = analyse(results)
    assert list(a.cells[M.ACCEPTANCE_LENGTH]) == pytest.approx([2.5, 2.5])
    assert set(a.cells["acceptance_source"]) == {"server"}
    assert set(a.positions["source"]) == {"server /metrics"}
    cap = a.capacity.iloc[0]
    assert cap["source"] == "server /metrics"
    assert cap["wasted_share"] == pytest.approx((250 + 1000) / (540 + 2160))
    titles = [t[0] for t in a.server["tables"]]
    assert "Server metrics per cell" in titles and "Step cost from server metrics (no step log)" in titles
    # two cells, two token counts: the hinge goes through both
    curve = server_fit.fit_curves(__import__("analysis.data.server", fromlist=["x"]).cell_table(results))["x"]
    assert curve.slope_ms_per_token > 0 and curve.r2 == pytest.approx(1.0)
    bt = backtest.backtest(results)
    assert bt["holdout_users"] == 4 and bt["rows"] and all(r["predicted"] > 0 for r in bt["rows"])
    models = backtest.fit_all_levels(results, a.flagged, a.cells)
    assert models[("x", "short")].workload.tau == pytest.approx(2.5)
    assert models[("x", "short")].workload.v == pytest.approx((540 + 2160) / (140 + 560))
    out = build_report(run)
    md = Path(out["paths"]["md"]).read_text()
    assert "## Server metrics per cell" in md and "server /metrics" in md


def test_plan_on_server_counters_does_not_crash_and_uses_their_tau(tmp_path):
    from analysis.decide.plan import plan

    run = write_run(tmp_path)
    out = plan(run, qps=1.0, tier="mid", slo_ttft_ms=1000, slo_tpot_ms=100, gpu="h100", model_params=8e9)
    (row,) = out["gpu_plan"]
    assert row["tau"] == pytest.approx(2.5) and row["v"] == pytest.approx(2160 / 560)
    assert out["model"]   # the queue model ran on the server-fitted step cost


def test_a_server_without_speculative_counters_says_what_it_could_not_compute(tmp_path):
    from analysis.data import server
    from analysis.data.load import load_results
    from analysis.report.build import analyse

    sglang = {M.SRV_GENERATION_TOKENS: 300, M.SRV_PROMPT_TOKENS: 500, M.SRV_REQUESTS_FINISHED: 10,
              f"{M.SRV_RUNNING}_mean": 1.0, f"{M.SRV_ACCEPT_LENGTH}_mean": 2.7, "samples": 20}
    run = write_run(tmp_path, {1: sglang}, facts={"engine": "sglang", "url": "u", "missing": []})
    results = load_results(run)
    notes = server.missing_figures(results, server.cell_table(results))
    assert any(n.startswith("tau (from counters): not computed") and "num_drafts" in n for n in notes)
    assert any(n.startswith("per-position acceptance: not computed") for n in notes)
    assert any(n.startswith("engine steps / step time") for n in notes)
    a = analyse(results)
    # SGLang's own acceptance-length gauge stands in, labelled; no per-position rows invented
    assert list(a.cells[M.ACCEPTANCE_LENGTH]) == [2.7] and list(a.cells["acceptance_source"]) == ["server"]
    assert a.positions.empty
    (row,) = {t[0]: t[2] for t in a.server["tables"]}["Server metrics per cell"]
    assert row["tau_from"] == "engine gauge (mean of samples)"
    text = " ".join(t[1] for t in a.server["tables"])
    assert "tau (from counters): not computed" in text
