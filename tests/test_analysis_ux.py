"""``python -m analysis`` as a user meets it: plan SLOs from the manifest, every
argument error at once, one place for reports, merging runs only with --merge."""

from __future__ import annotations

import pytest

from analysis import cli
from tests import analysis_synth as syn


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ux")
    slo = {t: {"ttft_ms": 700.0, "tpot_ms": 900.0} for t in syn.TIERS}
    syn.write_run(root / "run-a", run_id="run-a", manifest_slo=slo)
    syn.write_run(root / "run-b", run_id="run-b", manifest_slo=slo)
    return root


def test_plan_takes_slos_from_the_manifest(two_runs, capsys):
    assert cli.main(["plan", str(two_runs / "run-a"), "--qps", "100", "--tier", "high"]) == 0
    out = capsys.readouterr().out
    assert "SLO for tier high: TTFT <= 700 ms, TPOT <= 900 ms (from the run manifest" in out
    assert "SLO TTFT <= 700 ms, TPOT <= 900 ms" in out          # the plan used them
    # a flag overrides its own field only, and the output says so
    assert cli.main(["plan", str(two_runs / "run-a"), "--qps", "100", "--tier", "high",
                     "--slo-ttft-ms", "300"]) == 0
    out = capsys.readouterr().out
    assert "TTFT <= 300 ms, TPOT <= 900 ms (flag + manifest" in out


def test_plan_reports_every_argument_error_at_once(two_runs, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", str(two_runs / "run-a"), "--qps", "-3", "--slo-tpot-ms", "fast",
                  "--max-batch", "0", "--model-params", "8e9"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "5 argument error(s)" in err
    for text in ("--tier is required", "--qps must be > 0", "--slo-tpot-ms expects a number",
                 "--max-batch must be > 0", "--model-params only applies with --gpu"):
        assert text in err, text


def test_report_merges_only_with_merge(two_runs, capsys, monkeypatch):
    """The guard and the one report location; build_report itself is tested elsewhere
    (a stand-in records what the CLI asks for, so no figures are rendered here)."""
    from analysis.report import build as report

    calls = []

    def fake_build(root, out_dir, *args, **kw):
        calls.append((root, out_dir))
        rec = {t: {"short": {"strategy": "ngram", "runner_up": "autoregressive", "margin": 0.25,
                             "confidence": 0.99, "note": "", "users": [1], "goodput": 10.0,
                             "goodput_rps": 1.0, "speedup": 1.2}} for t in ("high", "low", "mid")}
        return {"recommendation": rec, "crossover": [], "degradation": None, "exit_code": 0,
                "paths": {"html": "h", "md": "m", "json": "j"}}

    monkeypatch.setattr(report, "build_report", fake_build)
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", str(two_runs)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "holds 2 runs" in err and "--merge" in err
    assert str(two_runs / "run-a") in err and str(two_runs / "run-b") in err and not calls
    assert cli.main(["report", str(two_runs), "--merge"]) == 0
    out = capsys.readouterr().out
    assert "merging 2 runs:" in out and str(two_runs / "run-b") in out
    assert calls[-1] == (two_runs, two_runs / "report")
    # one run: <run>/report/, where `python -m loadgen --report` writes too
    assert cli.main(["report", str(two_runs / "run-a")]) == 0
    out = capsys.readouterr().out
    assert calls[-1] == (two_runs / "run-a", two_runs / "run-a" / "report")
    # the answer first: low, mid, high; the margin as a percent
    lines = [ln.strip() for ln in out.splitlines() if " / short: " in ln]
    assert [ln.split()[0] for ln in lines] == ["low", "mid", "high"]
    assert "run ngram; 25.0% more goodput than autoregressive (sure: confidence 99%)" in lines[0]


def test_checks_flag_contradictions_and_weak_fits():
    """The issue's case: predicted to stop winning at 10.6 users, measured 1.51x at 16; r² 0.28."""
    from types import SimpleNamespace

    import pandas as pd

    from analysis.decide.checks import model_checks

    cells = pd.DataFrame({"strategy": ["autoregressive"] * 3 + ["draft_model"] * 3 + ["ngram"] * 3,
                          "output_class": ["short"] * 9, "users": [1, 4, 16] * 3,
                          "speedup": [1.0, 1.0, 1.0, 1.2, 1.35, 1.51, 1.1, 0.95, 0.8]})
    crossover = pd.DataFrame({"strategy": ["draft_model", "ngram"], "output_class": ["short"] * 2,
                              "predicted_crossover_users": [10.6, None], "tau": [2.0, 1.5]})
    bt = {"rows": [{"strategy": "ngram", "output_class": "short", "metric": "speedup", "users": 16,
                    "predicted": 1.2, "measured": 0.8},
                   {"strategy": "ngram", "output_class": "short", "metric": "tpot_ms_p50", "users": 16,
                    "predicted": 10.0, "measured": 10.5}]}
    a = SimpleNamespace(cells=cells, crossover=crossover,
                        capacity_model={"backtest": bt, "step_models": {
                            "ngram": SimpleNamespace(r2_step=0.95), "draft_model": SimpleNamespace(r2_step=0.28)}})
    checks = model_checks(a)
    assert checks["speedup"] == [
        "The model predicts draft_model stops beating autoregressive at 10.6 users (short outputs), but "
        "its measured speedup is 1.51x at 16 users: the prediction contradicts the measurement.",
        "The model predicts ngram keeps beating autoregressive at every concurrency (short outputs), but "
        "its measured speedup is 0.95x at 4 users: the prediction contradicts the measurement."]
    assert len(checks["backtest_speedup_short"]) == 1 and "1.20x, measured 0.80x" in checks[
        "backtest_speedup_short"][0]
    assert "step_cost" not in checks   # one cost model: its r² is the step model's
    assert len(checks["step_residuals"]) == 1 and "draft_model has r² 0.28" in checks["step_residuals"][0]
