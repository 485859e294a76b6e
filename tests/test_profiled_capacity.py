"""The profiled step cost (``analysis.model.profiled``), the leave-one-level-out backtest
and the plan's ranking against the measured decision, on synthetic runs with known answers
(tests/capacity_synth.py: a hinge step cost whose knee the lower users levels never reach;
tests/analysis_synth.py: measured winners per tier with an A/A)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from analysis.data import metrics
from analysis.data.load import load_results
from analysis.model import backtest as bt
from analysis.model import profiled
from configs import metric_names as mn
from tests import analysis_synth as S
from tests import capacity_synth as cs

PROFILE_SPEED = 1.25          # the profile ran 1.25x faster than the run (another clock)
BATCHES, QS, CTXS = (1, 2, 4, 8, 16, 32), (1, 2, 4, 8), (50, 150)


def _forward_ms(b, q) -> float:
    """capacity_synth's verify cost at B rows x q tokens per row (no draft)."""
    return cs.FLOOR + cs.ROW_MS * b + cs.TOKEN_MS * max(0.0, b * q - cs.KNEE)


def synth_profile() -> dict:
    """An engine profile of capacity_synth's engine measured on a clock PROFILE_SPEED faster:
    the forward grid, the engine's own steps (verify = forward: no acceptance cost; the
    drafter's DRAFT_MS) and no prefill cost."""
    strategies = {}
    for s, k in cs.K.items():
        fwd = [{"batch_size": b, "tokens_per_row": q, "context_len": c,
                "step_ms": _forward_ms(b, q) / PROFILE_SPEED, "cpu_ms": None}
               for b in BATCHES for q in QS for c in CTXS]
        steps = [{"batch_size": b, "context_len": 100, "tokens_per_row": k + 1,
                  "context_per_row": 100.0, "draft_ms": cs.DRAFT_MS[s] / PROFILE_SPEED,
                  "verify_ms": _forward_ms(b, k + 1) / PROFILE_SPEED,
                  "step_ms": (_forward_ms(b, k + 1) + cs.DRAFT_MS[s]) / PROFILE_SPEED,
                  "overhead_ms": 0.0, "cpu_ms": None, "steps": 10} for b in BATCHES]
        strategies[s] = {"strategy": s, "forward": fwd, "prefill": [], "engine_steps": steps}
    return {"kind": profiled.PROFILE_KIND, "shape": "synthetic", "device": "cpu",
            "points": strategies[mn.AUTOREGRESSIVE]["forward"], "strategies": strategies}


def test_profiled_model_recovers_the_known_cost_from_levels_below_the_knee(tmp_path):
    """Calibrated on users 1 and 4 only (T <= 32 tokens, below the knee at 48), the profiled
    model finds the profile's clock ratio and predicts the 16-user step (dflash: T = 128,
    past the knee) within 2 %; the step-log fit of the same levels cannot see the knee."""
    results = load_results(cs.write_sweep_run(tmp_path / "run", levels=(1, 4, 16)))
    steps = bt.steps_with_users(results.steps, results.requests)
    low = steps[steps[mn.REQ_USERS].isin([1, 4])]
    models = profiled.fit_step_models(low, synth_profile())
    fitted = bt.stepcost.fit_step_models(low)
    for s in (mn.AUTOREGRESSIVE, mn.DFLASH):
        m = models[s]
        assert m.source == "profiled" and fitted[s].source == "fitted"
        # the clock ratio, within 3 %: the joint fit also has a per-step constant, which the
        # 1 % step noise can trade against the scale
        assert m.decode.scale == pytest.approx(PROFILE_SPEED, rel=0.03)
        b, t = 16.0, 16.0 * (cs.K[s] + 1)
        true = float(cs.true_step_ms(s, 16))
        assert float(m.step_ms(b, t, t * 0.1)) == pytest.approx(true, rel=0.02)
    b, t = 16.0, 128.0
    true = float(cs.true_step_ms(mn.DFLASH, 16))
    miss = abs(float(fitted[mn.DFLASH].step_ms(b, t, t * 0.1)) - true) / true
    assert miss > 0.2   # the fit extrapolated a line the knee bends away from


def test_leave_one_level_out_is_small_with_the_profile_and_not_without(tmp_path):
    run = cs.write_sweep_run(tmp_path / "run", levels=(1, 4, 16))
    (run / profiled.PROFILE_FILE).write_text(json.dumps(synth_profile()))
    results = load_results(run)
    loo = bt.loo_backtest(results)                      # finds RUN_DIR/cost_curve.json
    assert loo["profile"] == str(run / profiled.PROFILE_FILE)
    assert loo["levels"] == [1, 4, 16]
    assert {r["users"] for r in loo["rows"]} == {1, 4, 16}
    assert all(r["model"] == "profiled" for r in loo["rows"])
    # (3 % / 15 %: this synthetic world keeps every user in the batch and gives the first
    # token after one TPOT; the model's closed loop waits 1.5 steps for it, which weighs most
    # on short outputs of few steps, dflash's 10; the calibration takes most of that)
    for metric in (metrics.OUTPUT_TOKENS_PER_S, "tpot_ms_p50"):
        assert loo["overall"][metric]["median_abs_error"] < 0.03
        assert loo["overall"][metric]["worst_abs_error"] < 0.15
    # 1 % step noise: the model holds out at the noise ceiling (the mean of each step's own
    # shape group, in sample), within 0.01
    for s, r2 in loo["r2_holdout"].items():
        assert r2 > 0.95 and loo["r2_ceiling"][s] - 0.01 <= r2 <= loo["r2_ceiling"][s] + 1e-3
    plain = bt.loo_backtest(results, profile=None)
    assert plain["profile"] is None and all(r["model"] == "fitted" for r in plain["rows"])
    assert plain["overall"][metrics.OUTPUT_TOKENS_PER_S]["worst_abs_error"] > 0.2
    # the backtest command's dict carries both (the report's model checks read it)
    full = bt.backtest(results)
    assert full["loo"]["overall"] == loo["overall"]
    assert full["step_model"] == {mn.AUTOREGRESSIVE: "profiled", mn.DFLASH: "profiled"}


def test_profile_file_must_be_an_engine_profile(tmp_path):
    bad = tmp_path / "curve.json"
    bad.write_text(json.dumps({"shape": "x", "device": "cpu", "points": []}))
    with pytest.raises(ValueError, match="not an engine profile"):
        profiled.find_profile(None, bad)


def test_loo_checks_name_the_worst_cell_and_the_noise_ceiling():
    from analysis.decide.checks import loo_checks

    loo = {"overall": {"output_tokens_per_s": {"median_abs_error": 0.05, "worst_abs_error": 0.3},
                       "tpot_ms_p50": {"median_abs_error": 0.04, "worst_abs_error": 0.1}},
           "rows": [{"strategy": "ngram", "output_class": "long", "metric": "output_tokens_per_s",
                     "users": 16, "predicted": 1000.0, "measured": 1430.0, "abs_error": 0.3}],
           "r2_holdout": {"ngram": 0.6, "dflash": 0.95}, "r2_ceiling": {"ngram": 0.7}}
    out = loo_checks({"loo": loo})["step_residuals"]
    assert len(out) == 2
    assert "output_tokens_per_s" in out[0] and "ngram long at 16 users" in out[0]
    assert "r² 0.60" in out[1] and "at most r² 0.70" in out[1] and "30%" in out[1]


def _synth_plan(tmp_path, tier="high"):
    from analysis.decide.plan import plan

    run = S.write_run(tmp_path / "run")
    slo = S.SLO[tier]
    return plan(run, 5.0, tier, slo["ttft_ms"], slo["tpot_ms"])


def test_plan_never_ranks_a_strategy_the_run_decided_worse_above_the_winner(tmp_path):
    """analysis_synth: at the high tier autoregressive beats dflash (0.6x) and ngram (0.9x),
    decided against the run's A/A. Whatever the model's replicas say, autoregressive is the
    tier's answer and every row says measured / interpolated / extrapolated."""
    out = _synth_plan(tmp_path, "high")
    for oc in S.OUTPUT_TOKENS:
        rows = sorted((r for r in out["model"] if r["output_class"] == oc), key=lambda r: r["rank"])
        assert rows[0]["strategy"] == mn.AUTOREGRESSIVE
        assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
        assert all(r["measured_decision"] == "decided worse" for r in rows[1:])
        assert all(r["basis"] in ("measured", "interpolated", "extrapolated") for r in rows)
    answer = {a["output_class"]: a for a in out["answer"]}
    assert set(answer) == set(S.OUTPUT_TOKENS)
    assert all(a["strategy"] == mn.AUTOREGRESSIVE for a in answer.values())


def test_rank_rows_overrides_a_model_ranking_that_contradicts_the_measurement(tmp_path):
    """The same run, the model's rows rigged so dflash needs fewer replicas than
    autoregressive: the measured decision (autoregressive, decided) still ranks first and the
    row and the assumptions say the model alone preferred dflash."""
    from analysis.decide import plan as P
    from analysis.model.replica_model import fit_replica_models
    from configs.tiers import Slo

    results = load_results(S.write_run(tmp_path / "run"))
    slo = Slo(ttft_ms=S.SLO["high"]["ttft_ms"], tpot_ms=S.SLO["high"]["tpot_ms"], source="test")
    flagged = metrics.with_slo_flags(results.requests, {t: slo for t in S.TIERS})
    cells = metrics.cell_table(flagged)
    models = fit_replica_models(results, flagged, cells)
    rows = [{"strategy": s, "output_class": "short", "replicas": n, "goodput_tok_s": g,
             "mean_in_system": 2.0, "p99_in_system": 8, "predicted_attainment": 0.95, "note": ""}
            for s, n, g in ((mn.AUTOREGRESSIVE, 3, 100.0), (mn.DFLASH, 1, 300.0),
                            (mn.NGRAM, 2, 200.0))]
    notes: list[str] = []
    ranked = P.rank_rows(rows, models, flagged, cells, "high", slo, notes)
    assert [r["strategy"] for r in ranked] == [mn.AUTOREGRESSIVE, mn.DFLASH, mn.NGRAM]
    assert "the model alone preferred dflash" in ranked[0]["note"]
    assert any("contradicts the run's measured decision" in n for n in notes)
    assert P.tier_answer(ranked)[0]["strategy"] == mn.AUTOREGRESSIVE


def test_row_basis_from_the_operating_point(tmp_path):
    from analysis.decide.plan import row_basis
    from analysis.model.replica_model import fit_replica_models

    run = cs.write_sweep_run(tmp_path / "run", levels=(1, 4, 16))
    results = load_results(run)
    from configs.tiers import Slo

    flagged = metrics.with_slo_flags(results.requests, {"sweep": Slo(ttft_ms=1e9, tpot_ms=1e9,
                                                                     source="t")})
    m = fit_replica_models(results, flagged, metrics.cell_table(flagged))[(mn.DFLASH, "long")]
    levels = [1.0, 4.0, 16.0]
    assert row_basis({"mean_in_system": 5.0, "p99_in_system": 9}, m, levels) == "measured"
    assert row_basis({"mean_in_system": 8.0, "p99_in_system": 12}, m, levels) == "interpolated"
    assert row_basis({"mean_in_system": 30.0, "p99_in_system": 40}, m, levels) == "extrapolated"
    assert np.isfinite(m.saturation_rps())


def test_engine_profile_of_the_embedded_engine_is_read_back(tmp_path):
    """``python -m bench.step_cost --engine`` on a tiny grid: every grid point, the prefill
    points and the engine's own steps at each batch; ``parts_from_profile`` interpolates it
    (the forward at a grid point is the file's CPU time there); an unknown strategy exits 2."""
    from bench.step_cost import main as cost_curve_main

    out = tmp_path / "cost_curve.json"
    rc = cost_curve_main(["--engine", "--strategies", mn.AUTOREGRESSIVE, "--batches", "1,2",
                          "--tokens-per-row", "1,2", "--contexts", "16,32", "--repeats", "1",
                          "--out", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())
    assert prof["kind"] == profiled.PROFILE_KIND and prof["shape"] == "embedded"
    entry = prof["strategies"][mn.AUTOREGRESSIVE]
    assert {(p["batch_size"], p["tokens_per_row"], p["context_len"]) for p in entry["forward"]} == {
        (b, q, c) for b in (1, 2) for q in (1, 2) for c in (16, 32)}
    assert all(p["step_ms"] > 0 and p["cpu_ms"] > 0 for p in entry["forward"])
    assert [p["prefill_tokens"] for p in entry["prefill"]] == [16, 64, 256]
    steps = {p["batch_size"]: p for p in entry["engine_steps"] if p["context_len"] == 64}
    assert set(steps) == {1, 2} and all(s["tokens_per_row"] == 1.0 for s in steps.values())
    assert all(s["draft_ms"] < s["verify_ms"] for s in steps.values())   # no drafter
    parts = profiled.parts_from_profile(prof, mn.AUTOREGRESSIVE)
    p = next(x for x in entry["forward"] if (x["batch_size"], x["tokens_per_row"], x["context_len"])
             == (2, 2, 32))
    assert float(parts.forward(2, 2, 32)) == pytest.approx(p["cpu_ms"])
    with pytest.raises(SystemExit) as e:
        cost_curve_main(["--engine", "--strategies", "nope", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2


def _two_repeat_run(path, slower: float):
    """capacity_synth's sweep run measured twice: repeat 1 a copy of repeat 0 with every
    request and step ``slower`` times as long (the same cells on a busier machine)."""
    import pandas as pd

    base = cs.write_sweep_run(path, levels=(1, 4, 16))
    req, st = pd.read_parquet(base / "requests.parquet"), pd.read_parquet(base / "steps.parquet")
    r1, s1 = req.copy(), st.copy()
    for c in (mn.REQ_TTFT_MS, mn.REQ_TPOT_MS, mn.REQ_ITL_P50_MS, mn.REQ_ITL_P99_MS, mn.REQ_E2E_MS):
        r1[c] = r1[c] * slower
    t0 = r1[mn.REQ_SCHEDULED_TS].min()
    for c in (mn.REQ_SCHEDULED_TS, mn.REQ_SENT_TS, mn.REQ_FIRST_TOKEN_TS, mn.REQ_END_TS):
        r1[c] = t0 + (r1[c] - t0) * slower + 1e6
    for c in (mn.STEP_MS, mn.STEP_DRAFT_MS, mn.STEP_VERIFY_MS):
        s1[c] = s1[c] * slower
    s1[mn.STEP_TS] = s1[mn.STEP_TS] + 1e6
    pd.concat([req.assign(**{mn.REQ_REPEAT: 0}), r1.assign(**{mn.REQ_REPEAT: 1})],
              ignore_index=True).to_parquet(base / "requests.parquet")
    pd.concat([st.assign(**{mn.REQ_REPEAT: 0}), s1.assign(**{mn.REQ_REPEAT: 1})],
              ignore_index=True).to_parquet(base / "steps.parquet")
    return base


@pytest.mark.parametrize("slower", [1.0, 1.25])
def test_leave_one_repeat_out_errs_by_the_repeats_own_difference(tmp_path, slower):
    """Every cell measured twice, the second time ``slower`` x as long: holding out either
    repeat, the model fitted on the other predicts it off by exactly their difference (1.25 x:
    tokens/s 25 % high for repeat 1, 20 % low for repeat 0; TPOT the same the other way) and
    within 2 % when the repeats agree. Every held cell of both repeats is predicted."""
    run = _two_repeat_run(tmp_path / "run", slower)
    (run / profiled.PROFILE_FILE).write_text(json.dumps(synth_profile()))
    lro = bt.lro_backtest(load_results(run))
    cells = 2 * 2 * 3                       # strategies x output classes x users levels
    assert lro["held_cells"] == 2 * cells
    rows = lro["rows"]
    for metric in (metrics.OUTPUT_TOKENS_PER_S, "tpot_ms_p50"):
        got = {(r["repeat"], r["strategy"], r["output_class"], r["users"]): r
               for r in rows if r["metric"] == metric}
        assert len(got) == 2 * cells
        for (rep, *_), r in got.items():
            ratio = r["predicted"] / r["measured"]
            faster_held = (rep == 0) == (metric == metrics.OUTPUT_TOKENS_PER_S)
            want = 1.0 / slower if faster_held else slower
            assert ratio == pytest.approx(want, rel=0.02), (rep, r)
    summary = {(s["strategy"], s["output_class"], s["metric"]) for s in lro["summary"]}
    assert len(summary) == 2 * 2 + 2 * 3       # autoregressive: no speedup; dflash: speedup too
    # one repeat only: nothing to hold out
    single = cs.write_sweep_run(tmp_path / "one", levels=(1, 4, 16))
    assert bt.lro_backtest(load_results(single)) is None


def test_loo_checks_place_the_worst_case_against_the_runs_own_repeats():
    """With a leave-one-repeat-out in the backtest, a leave-one-level-out failure says whether
    its worst case is within the run's own repeat-to-repeat noise."""
    from analysis.decide.checks import loo_checks

    loo = {"overall": {"tpot_ms_p50": {"median_abs_error": 0.06, "worst_abs_error": 0.3}},
           "rows": [{"strategy": "autoregressive", "output_class": "short", "metric": "tpot_ms_p50",
                     "users": 16, "predicted": 5.8, "measured": 4.3, "abs_error": 0.3}],
           "r2_holdout": {}}
    noisy = {"overall": {"tpot_ms_p50": {"median_abs_error": 0.1, "worst_abs_error": 0.38, "n": 55}}}
    quiet = {"overall": {"tpot_ms_p50": {"median_abs_error": 0.02, "worst_abs_error": 0.05, "n": 40}}}
    within = loo_checks({"loo": loo, "lro": noisy})["step_residuals"]
    beyond = loo_checks({"loo": loo, "lro": quiet})["step_residuals"]
    bare = loo_checks({"loo": loo})["step_residuals"]
    assert len(within) == len(beyond) == len(bare) == 1
    assert "median 10%, worst 38%" in within[0] and "55 predictions" in within[0]
    assert "is within the run's own noise" in within[0]
    assert "is beyond the run's own noise" in beyond[0] and "worst 5%" in beyond[0]
    assert "repeat" not in bare[0]
