"""analysis plan against hand-computed cases."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from analysis import cli
from analysis.decide.plan import GPUS, PointsCurve, plan, roofline_curve
from configs import metric_names as mn
from tests import analysis_synth as syn


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    # No drafting time in the step log, so draft_ratio = 0 and the GPU plan is hand-computable.
    strats = (syn.AR, dataclasses.replace(syn.DFLASH, draft_ms=0.0), syn.NGRAM)
    return syn.write_run(root / "run", strats=strats)


def _rows(rows, oc="short"):
    return {r["strategy"]: r for r in rows if r["output_class"] == oc}


def test_roofline_curve_numbers():
    c = roofline_curve(GPUS["h100"], 8e9, overhead_ms=1.0)
    assert c.floor_ms == pytest.approx(1000 * 16e9 / 3.35e12 + 1.0)
    assert c.knee_tokens == pytest.approx(989e12 / 3.35e12)
    for tokens in (1, 100, 295, 296, 1000, 5000):
        expect = 1000 * max(2 * 8e9 * tokens / 989e12, 2 * 8e9 / 3.35e12) + 1.0
        assert float(c(tokens)) == pytest.approx(expect, rel=1e-9)
    assert roofline_curve(GPUS["h200"], 8e9, 0.0).floor_ms == pytest.approx(1000 * 16e9 / 4.8e12)


def test_gpu_plan_from_curve_file(run_dir, tmp_path):
    curve_file = tmp_path / "curve.json"
    curve_file.write_text(json.dumps({"gpu": "h100", "model": "test", "points": [
        {"batch_tokens": 1, "step_ms": 10}, {"batch_tokens": 100, "step_ms": 10},
        {"batch_tokens": 1000, "step_ms": 100}]}))
    assert float(PointsCurve.from_file(curve_file)(2000)) == pytest.approx(200.0)
    out = plan(run_dir, qps=1000, tier="low", slo_ttft_ms=30, slo_tpot_ms=20, cost_curve=curve_file)
    rows = _rows(out["gpu_plan"])
    ar = rows[mn.AUTOREGRESSIVE]
    # g(N) = 10 + 0.1 (N - 100): TPOT g(N) <= 20 and TTFT g(100 + N) <= 30 -> N = 200;
    # W = (30 + 31 * 20) ms = 0.65 s; X = 200 / 0.65 req/s; ceil(1000 / X) = 4.
    assert ar["users"] == 200 and ar["tpot_ms"] == pytest.approx(20) and ar["ttft_ms"] == pytest.approx(30)
    assert ar["capacity_rps"] == pytest.approx(200 / 0.65)
    assert ar["replicas"] == 4 and ar["tokens_per_s"] == pytest.approx(10_000)
    d = rows[mn.DFLASH]
    # tau 4, v 8: TTFT g(100 + 8N) <= 30 -> N = 25; step g(200) = 20, TPOT 5;
    # W = (30 + 31 * 5) ms = 0.185 s; X = 25 / 0.185; ceil(1000 / X) = 8; 25*4/20 ms = 5000 tok/s.
    assert (d["tau"], d["v"], d["draft_ratio"]) == (pytest.approx(4.0), pytest.approx(8.0), 0.0)
    assert d["users"] == 25 and d["tpot_ms"] == pytest.approx(5.0)
    assert d["capacity_rps"] == pytest.approx(25 / 0.185)
    assert d["replicas"] == 8 and d["tokens_per_s"] == pytest.approx(5000)
    assert any("measured curve" in a for a in out["assumptions"])


def test_gpu_plan_roofline(run_dir):
    out = plan(run_dir, qps=500, tier="low", slo_ttft_ms=1000, slo_tpot_ms=1.0, gpu="h200",
               model_params=1e9, overhead_ms=0.0)
    ar = _rows(out["gpu_plan"])[mn.AUTOREGRESSIVE]
    per_token_ms = 1000 * 2e9 / 989e12
    n_star = math.floor(1.0 / per_token_ms)                 # compute-bound TPOT <= 1 ms
    assert ar["users"] == n_star == 494
    w = (per_token_ms * (100 + n_star) + 31 * per_token_ms * n_star) / 1000
    assert ar["capacity_rps"] == pytest.approx(n_star / w)
    assert ar["replicas"] == math.ceil(500 / (n_star / w))
    assert any("H200" in a and "989" in a and "4.8 TB/s" in a for a in out["assumptions"])


def test_plan_cli(run_dir, capsys):
    assert cli.main(["plan", str(run_dir), "--qps", "100", "--tier", "high",
                     "--slo-ttft-ms", "500", "--slo-tpot-ms", "1000"]) == 0
    text = capsys.readouterr().out
    assert "step cost model + queue" in text and "autoregressive" in text
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", str(run_dir), "--qps", "1", "--tier", "high", "--slo-ttft-ms", "1",
                  "--slo-tpot-ms", "1", "--gpu", "h100"])
    assert exc.value.code == 2 and "--model-params" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", str(run_dir), "--qps", "1", "--tier", "nope", "--slo-ttft-ms", "1",
                  "--slo-tpot-ms", "1"])
    assert exc.value.code == 2 and "--tier" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", str(run_dir), "--qps", "-3", "--tier", "high", "--slo-ttft-ms", "1",
                  "--slo-tpot-ms", "1"])
    assert exc.value.code == 2 and "--qps" in capsys.readouterr().err


def test_crossover_from_curve_file(run_dir, tmp_path):
    """speedup(N) = tau g(N) / (g(N v) (1 + r)) on a hand-made curve (analysis.decide.crossover)."""
    from analysis.data.load import load_results
    from analysis.decide import crossover as co

    curve_file = tmp_path / "curve.json"
    curve_file.write_text(json.dumps({"gpu": "h100", "model": "test", "points": [
        {"batch_tokens": 1, "step_ms": 10}, {"batch_tokens": 100, "step_ms": 10},
        {"batch_tokens": 1000, "step_ms": 100}]}))
    from analysis.decide.plan import load_curve
    curve, meta, path = load_curve(curve_file)
    rows = {r["strategy"]: r for r in co.crossover_rows(curve, load_results(run_dir), max_batch=300)
            if r["output_class"] == "short"}
    assert mn.AUTOREGRESSIVE not in rows
    d = rows[mn.DFLASH]
    assert (d["tau"], d["v"], d["draft_ratio"], d["k"]) == (pytest.approx(4.0), pytest.approx(8.0), 0.0, 7)
    # g(N) = 10 flat to 100 tokens, then 10 + 0.1 (T - 100): 4 * 10 < g(8N) first at N = 51
    assert d["wins"] and d["crossover_users"] == 51 and d["crossover_step_cost"] == "measured"
    sp = {p["users"]: p for p in d["speedup"]}
    assert sp[8]["speedup"] == pytest.approx(4.0) and sp[8]["step_cost"] == "measured"
    # N = 256: g(2048) past the last measured point (1000 tokens): extrapolated
    assert sp[256]["step_cost"] == "extrapolated"
    assert sp[256]["speedup"] == pytest.approx(4 * (10 + 0.1 * 156) / (10 + 0.1 * 1948))
    by_k = {b["k"]: b for b in d["by_k"]}
    assert by_k[7]["acceptance"] == "measured" and by_k[7]["crossover_users"] == 51
    assert by_k[1]["acceptance"] == "modelled"
    # i.i.d. acceptance (Leviathan et al. eq. 1) through the measured point
    assert co.tau_at_k(d["alpha"], 7) == pytest.approx(4.0, rel=1e-6)
    assert by_k[1]["tau"] == pytest.approx(1 + d["alpha"])
    out = plan(run_dir, qps=1000, tier="low", slo_ttft_ms=30, slo_tpot_ms=20, cost_curve=curve_file)
    assert {r["strategy"] for r in out["crossover"]} == set(rows)
    assert any("extrapolated" in a and "speedup vs concurrency" in a for a in out["assumptions"])


def test_cost_curve_by_committed_name(run_dir, capsys):
    from analysis.data import cost_curve_file

    assert "qwen3-0.6b-cpu" in cost_curve_file.names()
    rc = cli.main(["plan", str(run_dir), "--tier", "low", "--qps", "10", "--slo-ttft-ms", "5000",
                   "--slo-tpot-ms", "1000", "--cost-curve", "qwen3-0.6b-cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and "crossover" in out and "data/cost_curves/qwen3-0.6b-cpu.json" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", str(run_dir), "--tier", "low", "--qps", "10", "--cost-curve", "no-such"])
    assert e.value.code == 2
    assert "--cost-curve" in capsys.readouterr().err
