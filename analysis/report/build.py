"""``build_report``: results directory -> report.md, report.html, recommendation.json.

Stages: load (analysis.data.load) -> per-request SLO flags and per-cell metrics
(analysis.data.metrics; the target's own counters where it published them, analysis.data.server)
-> step-log capacity tables (analysis.model.capacity) and the step cost
model (analysis.model.stepcost, via analysis.model.backtest) ->
recommendation (analysis.decide.recommend) -> optional baseline comparison
(analysis.data.degradation) -> output consistency, memory and stability
(analysis.decide.questions) -> figures (analysis.report.plots) -> rendering (analysis.report.render).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pandas as pd

from analysis.model import backtest as bt_mod
from analysis.model import capacity
from analysis.data import faults
from analysis.data import metrics
from analysis.data import server as server_data
from analysis.report.server_section import server_section
from analysis.report import plots
from analysis.report import render
from analysis.data import stability
from analysis.data.analysis import Analysis
from analysis.report.capacity_section import capacity_figures
from analysis.decide.checks import model_checks
from analysis.data.degradation import DEFAULT_THRESHOLD, EXIT_DEGRADED, compare
from analysis.data.consistency import annotate_recommendation
from analysis.data.load import Results, ResultsError, load_results
from analysis.decide.questions import questions_section
from analysis.report.dimensions import dimensions_section
from analysis.report.surface_section import surface_section
from analysis.data.scope import run_scope, scope_line
from analysis.decide import race as race_mod
from analysis.decide.claims import claims_check
from analysis.decide.recommend import (RECOMMENDATION_SCHEMA_VERSION,
                                       recommend_by_sampling, recommendation_rows)
from analysis.data.slo import resolve_slos
from configs import metric_names as mn
from configs.jsonio import write_json


def recommendation_json_rows(rec: dict) -> list[dict]:
    """recommendation.json ``rows``: per tier x output class x sampling label the recommended
    ``strategy`` (served name; ``tie`` with ``tied``), its ``base_strategy`` and ``k``
    (draft length; ``top_k_candidates`` where varied), the sampling label and temperature,
    goodput (tokens/s), speedup, margin and confidence (fractions)."""
    from analysis.decide.recommend import entries

    keys = ("strategy", "leader", "tied", "base_strategy", "k", "top_k_candidates", "sampling",
            "temperature", "goodput", "speedup", "runner_up", "margin", "confidence", "users")
    return [{"tier": t, "output_class": oc, **{k: r.get(k) for k in keys}} for t, oc, r in entries(rec)]


def predict_crossovers(results: Results, flagged: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """Per strategy x output class: tau, verification tokens per row v and the predicted
    crossover users, from the step cost model fitted on every users level
    (``analysis.model.backtest.fit_all_levels``, the model ``analysis plan`` uses too)."""
    from analysis.data.dimensions import primary_sampling

    cols = [mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS, "tau", "verification_per_request",
            "predicted_crossover_users"]
    # one sampling setting (greedy first), as the backtest: acceptance differs by setting, and
    # a model pooled over greedy and sampled cells at one level predicts neither curve
    models = bt_mod.fit_all_levels(bt_mod.one_sampling(results), primary_sampling(flagged),
                                   primary_sampling(cells))
    rows = [(s, oc, m.workload.tau, m.workload.v, bt_mod.predicted_crossover(models, s, oc))
            for (s, oc), m in sorted(models.items()) if s != mn.AUTOREGRESSIVE]
    return pd.DataFrame(rows, columns=cols)


def race_settings(results: Results) -> dict:
    """The decision settings the report uses: a single raced run's own (manifest ``race``:
    confidence, equivalence margin, the looks to replay (``race.looks``: an older manifest
    without them gets one evaluation), why it stopped), else the defaults with one
    evaluation over every replicate. Returns {"raced", "confidence", "equivalence_margin",
    "first_pass_repeats", "looks", "stopped", "budget_s", "rounds", "undecided_reason",
    "noise"}."""
    entries = [r.manifest.get("race") for r in results.runs]
    entry = entries[0] if len(entries) == 1 and isinstance(entries[0], dict) else None
    if entry is None:
        reason = ("several runs merged: no racing replayed" if len(entries) > 1
                  else "no racing: budget 0 (--budget auto races only the main job, --tier all)")
        return {"raced": False, "confidence": race_mod.DEFAULT_CONFIDENCE,
                "equivalence_margin": race_mod.DEFAULT_MARGIN, "first_pass_repeats": None,
                "looks": None, "noise": None, "stopped": None, "budget_s": None, "rounds": 0, "undecided_reason": reason}
    stopped = str(entry.get("stopped") or "")
    reason = ("budget spent" if stopped.startswith("budget") else
              stopped.split(":")[0] if stopped else "the run ended before racing finished")
    return {"raced": True, "confidence": float(entry.get("confidence", race_mod.DEFAULT_CONFIDENCE)),
            "equivalence_margin": float(entry.get("equivalence_margin", race_mod.DEFAULT_MARGIN)),
            "first_pass_repeats": int(entry.get("first_pass_repeats") or 1), "stopped": stopped,
            "looks": [float(t) for t in entry.get("looks") or []] or None,
            "noise": entry.get("noise"),
            "budget_s": entry.get("budget_s"), "rounds": len(entry.get("rounds") or []),
            "undecided_reason": reason}


def prepare(results: Results, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
            warmup_s: float | None = None):
    """The rows every figure of a report is computed from: the warm-up cut (``warmup_s``;
    None: the run manifest's ``args.warmup_s``, else 0), SLO flags, the server's counters and
    the cell table (one row per cell, repeats pooled: ``analysis.data.metrics.cell_table``).
    Returns (results, warmup_s, requests dropped, slos, flagged, server cells, cells). Raises
    ResultsError when the cut leaves no request."""
    if warmup_s is None:
        warmup_s = float(next((r.manifest.get("args", {}).get("warmup_s") or 0
                               for r in results.runs if r.manifest.get("args")), 0) or 0)
    dropped = 0
    if warmup_s:
        req, steps, dropped = stability.apply_warmup(results.requests, results.steps, warmup_s)
        if req.empty:
            raise ResultsError(f"--warmup-s {warmup_s:g} drops every request (each cell is "
                               "shorter); pass a smaller warm-up")
        results = dataclasses.replace(results, requests=req, steps=steps)
    tiers = sorted(results.requests[mn.REQ_TIER].unique())
    slos = resolve_slos(tiers, results.manifest_config, slo_ttft_ms, slo_tpot_ms)
    flagged = metrics.with_slo_flags(results.requests, slos)
    srv = server_data.cell_table(results)   # the target's own counters (--server-metrics)
    cells = server_data.fill_cells(metrics.cell_table(flagged), srv)
    return results, warmup_s, dropped, slos, flagged, srv, cells


def crossover_table(results: Results, flagged: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """The crossover table: measured per sampling label (speedup and tau); the model's columns
    are fitted on the first label (greedy) of a strategy x output class (model_tau,
    verification per request, prediction; ``predict_crossovers``)."""
    return metrics.crossover_measured(cells).merge(
        metrics.curve_tau(flagged), on=metrics.CURVE_KEY, how="left").merge(
        predict_crossovers(results, flagged, cells).rename(columns={"tau": "model_tau"}),
        on=[mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS], how="outer")


def question_sections(results: Results, flagged: pd.DataFrame, cells: pd.DataFrame,
                      warmup_s: float, dropped: int) -> dict:
    """The "questions" part of the report: output consistency, memory and stability
    (``questions_section``), speedup / tau against k and temperature when varied
    (``dimensions_section``), the verification-cost surface of synthetic deployments
    (``surface_section``, with a top-of-report flag naming them). Returns
    {"tables", "figures", "flags", "diverging", ...}."""
    answers = questions_section(results, flagged, warmup_s, dropped)
    dims = dimensions_section(cells)
    answers.setdefault("tables", []).extend(dims["tables"])
    answers.setdefault("figures", {}).update({k: v for k, v in dims["figures"].items() if v})
    surf = surface_section(results)   # --acceptance-length: the verification-cost surface
    answers["tables"].extend(surf["tables"])
    answers["figures"].update(surf["figures"])
    synthetic = sorted(surf["data"]["surface"]["strategy"].unique()) if not surf["data"]["surface"].empty else []
    if synthetic:
        answers.setdefault("flags", []).append(
            f"SYNTHETIC deployments ({len(synthetic)}: {', '.join(synthetic[:6])}"
            f"{', ...' if len(synthetic) > 6 else ''}): forced acceptance (--acceptance-length), "
            "their text is not the target's; they measure the verification-cost surface and are "
            "never recommended or consistency-checked.")
    return answers


def baseline_degradation(baseline, results: Results, slos: dict, flagged: pd.DataFrame,
                         cells: pd.DataFrame, slo_ttft_ms, slo_tpot_ms,
                         threshold: float) -> pd.DataFrame | None:
    """``report --baseline``: the baseline's acceptance length and goodput against this run's
    (``analysis.data.degradation.compare``), under the same SLOs; None without a baseline."""
    if baseline is None:
        return None
    base = load_results(baseline)
    base_slos = {t: slos.get(t) or resolve_slos([t], results.manifest_config,
                                                slo_ttft_ms, slo_tpot_ms)[t]
                 for t in base.requests[mn.REQ_TIER].unique()}
    base_flagged = metrics.with_slo_flags(base.requests, base_slos)
    return compare(flagged, cells, base_flagged, metrics.cell_table(base_flagged), threshold)


def analyse(results: Results, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
            baseline: str | Path | None = None, threshold: float = DEFAULT_THRESHOLD,
            warmup_s: float | None = None) -> Analysis:
    """Compute every table of the report (no files written).

    warmup_s: seconds excluded from the start of every cell replicate (requests and
    step rows, ``analysis.data.stability.apply_warmup``); None: the run manifest's
    ``args.warmup_s``, else 0. Raises ResultsError when the cut leaves no request.
    """
    # failures count whenever they happened: the warm-up cut never hides an outage
    uncut = results.requests
    results, warmup_s, dropped, slos, flagged, srv, cells = prepare(results, slo_ttft_ms, slo_tpot_ms,
                                                                    warmup_s)
    cap = server_data.merge_capacity(capacity.capacity_table(results.steps), srv)
    settings = race_settings(results)
    settings["scope"] = run_scope([r.manifest for r in results.runs], warmup_s)
    rec = recommend_by_sampling(flagged, cells, slos, confidence=settings["confidence"],
                                margin=settings["equivalence_margin"], looks=settings["looks"])
    outage = faults.outages(uncut)
    faults.annotate_degraded(rec, outage)
    answers = question_sections(results, flagged, cells, warmup_s, dropped)
    annotate_recommendation(rec, answers["diverging"])
    degradation = baseline_degradation(baseline, results, slos, flagged, cells, slo_ttft_ms,
                                       slo_tpot_ms, threshold)
    from analysis.report.capacity_section import capacity_section
    return Analysis(results=results, slos=slos, flagged=flagged, cells=cells,
                    positions=server_data.merge_positions(metrics.per_position(flagged), srv),
                    crossover=crossover_table(results, flagged, cells),
                    knees=metrics.throughput_latency_knee(cells), capacity=cap,
                    recommendation=rec, degradation=degradation,
                    outages=outage, timeline=faults.timeline(uncut),
                    baseline_root=str(baseline) if baseline is not None else None,
                    capacity_model=capacity_section(results), questions=answers,
                    warmup_s=warmup_s, server=server_section(results, srv), race=settings,
                    claims=claims_check(rec))


def make_figures(a: Analysis) -> dict[str, bytes | None]:
    """All report figures as PNG bytes (None where the data is absent)."""
    return {
        "goodput": plots.goodput_bars(recommendation_rows(a.recommendation), a.recommendation),
        "speedup": plots.speedup_vs_users(a.cells, a.crossover),
        "throughput_latency": plots.throughput_latency(a.cells, a.knees),
        "latency_ecdf": plots.latency_ecdf(a.flagged),
        "acceptance": plots.acceptance_hist(a.flagged),
        "per_position": plots.per_position_plot(a.positions),
        "verification": plots.verification_vs_batch(a.results.steps),
        "step_cost": plots.step_cost(a.results.steps),
        **capacity_figures(a.capacity_model),
        "timeline": plots.outage_timeline(a.timeline, a.outages),
        **a.server.get("figures", {}),
        **a.questions.get("figures", {}),
    }


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


REPORT_DIR = "report"   # the one place a report goes: <run dir>/report/


def default_out_dir(results_dir) -> Path:
    """Where a report on ``results_dir`` is written unless ``--out`` says otherwise:
    ``<results_dir>/report/``, for ``python -m loadgen --report`` and ``python -m
    analysis report`` alike."""
    return Path(results_dir) / REPORT_DIR


def build_report(results_dir, out_dir=None, baseline=None, slo_ttft_ms=None, slo_tpot_ms=None,
                 warmup_s: float | None = None) -> dict:
    """Write report.md, report.html and recommendation.json; return a summary.

    ``out_dir`` defaults to ``<results_dir>/report/`` (``default_out_dir``). Returns {"recommendation": {tier:
    {output_class: {...}}}, "paths": {"md", "html", "json"}, "crossover": [rows],
    "degradation": [rows] or None, "degraded": bool, "exit_code": 0 or
    EXIT_DEGRADED, "slos": {tier: {...}}, "flags": [str], "diverging": [strategy]}. Raises analysis.data.load.ResultsError
    for a missing or empty results directory.
    """
    results = load_results(results_dir)
    a = analyse(results, slo_ttft_ms, slo_tpot_ms, baseline, warmup_s=warmup_s)
    a.figures = make_figures(a)
    tally: list = []
    a.checks = model_checks(a, tally)
    a.checks_run = len(tally)
    out = Path(out_dir) if out_dir is not None else default_out_dir(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "report.md", "html": out / "report.html",
             "json": out / "recommendation.json"}
    _write_atomic(paths["md"], render.markdown(a))
    _write_atomic(paths["html"], render.html(a))
    # "rows": one per tier x output class x sampling label, with the deployment's
    # strategy (served name), base_strategy and k (python -m loadgen --k)
    write_json(paths["json"], {"schema_version": RECOMMENDATION_SCHEMA_VERSION, **a.recommendation,
                               "rows": recommendation_json_rows(a.recommendation),
                               "race": a.race, "claims": a.claims,
                               "scope": {**a.race.get("scope", {}),
                                         "line": scope_line(a.race.get("scope", {}))}},
               sort_keys=True)
    degraded = bool(a.degradation is not None and a.degradation["flagged"].any())
    return {
        "recommendation": a.recommendation,
        "paths": {k: str(v) for k, v in paths.items()},
        "crossover": render.records(a.crossover),
        "degradation": render.records(a.degradation) if a.degradation is not None else None,
        "degraded": degraded,
        "exit_code": EXIT_DEGRADED if degraded else 0,
        "slos": {t: s.model_dump() for t, s in a.slos.items()},
        "flags": list(a.questions.get("flags", [])),       # top-of-report warnings
        "diverging": list(a.questions.get("diverging", [])),
        "race": a.race,
        "claims": a.claims,
        "scope": scope_line(a.race.get("scope", {})),
    }
