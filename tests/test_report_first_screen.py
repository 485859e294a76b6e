"""The report's first screen leads with the answer (issue 39, item 7): the recommendation per
tier and its scope come before the model checks, which are folded (``<details>``) behind a
one-line count; a target's missing Prometheus page that the run did not need reads "not
available (not needed: ...)", as the console says, never as an error."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from analysis.decide.checks import model_checks
from analysis.report.build import build_report
from analysis.report.render import checks_summary
from tests import analysis_synth as syn

SKIPPED = "a specload service: its engine step log (/specload/step_log) is read instead"
NOT_FOUND = "HTTP Error 404: Not Found"


def _report(root, server_metrics: dict):
    run = syn.write_run(root / "run", manifest_extra={"server_metrics": server_metrics})
    out = build_report(run, root / "out")
    return (root / "out" / "report.md").read_text(), (root / "out" / "report.html").read_text(), out


@pytest.fixture(scope="module")
def own_service(tmp_path_factory):
    return _report(tmp_path_factory.mktemp("own"), {
        "mode": "auto", "url": "http://127.0.0.1:8000/metrics", "interval_s": 1.0,
        "error": NOT_FOUND, "skipped": SKIPPED})


def test_markdown_opens_with_the_answer_and_folds_the_checks(own_service):
    md, _, out = own_service
    lines = md.splitlines()
    answer = lines.index("## Answer")
    first = next(i for i, ln in enumerate(lines) if ln.startswith("- low / short: run "))
    summary = next(i for i, ln in enumerate(lines) if ln.startswith("- model checks: "))
    checks = lines.index("## Model checks")
    details = next(i for i, ln in enumerate(lines) if ln.startswith("<details><summary>model checks: "))
    assert answer < first < summary < checks < details < lines.index("## Recommendation")
    assert "on this deployment only" in lines[answer + 2]          # the scope, before any table
    assert first < 12 and summary < 25, (first, summary)            # on the first screen
    # every tier x output class answered on the first screen
    heads = [ln for ln in lines[answer:summary] if ln.startswith("- ") and ": run " in ln]
    assert len(heads) == sum(len(by) for by in out["recommendation"].values()) == 6
    # the synthetic run's one weak fit: counted, and its sentence only inside the fold
    sentence = "The step model of autoregressive has r²"
    assert lines[summary].startswith("- model checks: 1 of ") and lines[summary].endswith(
        " fail (details below)")
    assert int(lines[summary].split(" of ")[1].split()[0]) >= 2
    assert [i for i, ln in enumerate(lines) if sentence in ln] and all(
        i > details for i, ln in enumerate(lines) if sentence in ln)
    assert md.index("</details>") > md.index(sentence)


def test_html_folds_the_checks_below_the_answer(own_service):
    _, html, _ = own_service
    assert html.index('<section id="answer">') < html.index('<section id="checks">')
    checks = html[html.index('<section id="checks">'):]
    assert checks.index("<details><summary>model checks: 1 of ") < checks.index(
        "The step model of autoregressive")
    assert html.index("model checks: 1 of ") < html.index('<table id="recommendation">')


def test_a_page_the_run_did_not_need_is_not_an_error(own_service):
    md, html, _ = own_service
    assert f"- server metrics: not available (not needed: {SKIPPED})" in md.splitlines()
    assert "404" not in md and "404" not in html
    assert "Server metrics: source" not in md


def test_another_targets_missing_page_is_said_once_as_not_available(tmp_path):
    md, _, _ = _report(tmp_path, {"mode": "auto", "url": "http://127.0.0.1:9/metrics",
                                  "interval_s": 1.0, "error": NOT_FOUND})
    line = next(ln for ln in md.splitlines() if ln.startswith("- server metrics: "))
    assert line.startswith(f"- server metrics: not available ({NOT_FOUND}")
    table = md[md.index("## Server metrics: source"):]
    assert f"not available ({NOT_FOUND})" in table.split("\n## ")[0]


def _analysis(**kw):
    cells = pd.DataFrame({"strategy": ["autoregressive"] * 3 + ["draft_model"] * 3 + ["ngram"] * 3,
                          "output_class": ["short"] * 9, "users": [1, 4, 16] * 3,
                          "speedup": [1.0, 1.0, 1.0, 1.2, 1.35, 1.51, 1.1, 0.95, 0.8]})
    crossover = pd.DataFrame({"strategy": ["draft_model", "ngram"], "output_class": ["short"] * 2,
                              "predicted_crossover_users": [10.6, None], "tau": [2.0, 1.5]})
    bt = {"rows": [{"strategy": "ngram", "output_class": "short", "metric": "speedup", "users": 16,
                    "predicted": 1.2, "measured": 0.8},
                   {"strategy": "ngram", "output_class": "short", "metric": "tpot_ms_p50",
                    "users": 16, "predicted": 10.0, "measured": 10.5}]}
    return SimpleNamespace(cells=cells, crossover=crossover, capacity_model={
        "backtest": bt, "step_models": {"ngram": SimpleNamespace(r2_step=0.95),
                                        "draft_model": SimpleNamespace(r2_step=0.28)}}, **kw)


def test_the_checks_count_every_comparison_made():
    """2 crossover predictions, 2 backtest rows, 2 step fits were compared; 4 failed (both
    crossovers, the speedup backtest on the wrong side of 1, the r² 0.28 fit)."""
    a = _analysis()
    tally: list = []
    checks = model_checks(a, tally)
    assert len(tally) == 6
    a.checks, a.checks_run = checks, len(tally)
    assert checks_summary(a) == "model checks: 4 of 6 fail (details below)"
    a.checks = {}
    assert checks_summary(a) == "model checks: all 6 pass"
    a.checks_run = 0
    assert checks_summary(a).startswith("model checks: none run")


def test_the_load_generators_new_facts_read_the_same(tmp_path):
    """Runs written since the console's wording (the probe's error kept as ``probe``, no
    ``error``) give the same line and no error either."""
    md, html, _ = _report(tmp_path, {"mode": "auto", "url": "http://127.0.0.1:8000/metrics",
                                     "interval_s": 1.0, "skipped": SKIPPED,
                                     "probe": "GET http://127.0.0.1:8000/metrics: HTTP 404"})
    assert f"- server metrics: not available (not needed: {SKIPPED})" in md.splitlines()
    assert "404" not in md and "404" not in html
    assert "Server metrics: source" not in md
