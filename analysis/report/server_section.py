"""The report's "Server metrics" section: what the target's own Prometheus counters say
(``analysis.data.server``), the step cost fitted from them (``analysis.model.server_fit``)
and what the server did not expose. Empty when no run read server metrics."""

from __future__ import annotations

import pandas as pd

from analysis.data import server
from analysis.model import server_fit
from analysis.report.plots import server_timeline


def server_section(results, srv: pd.DataFrame) -> dict:
    """{"tables": [(title, text, rows)], "notes": [str], "figures": {name: png}}."""
    out: dict = {"tables": [], "notes": [], "figures": {}}
    # a run that did not need the page (specload's own service: its step log has it all) is
    # said once on the first screen (render.server_metrics_line), not listed as a failure here
    facts = [f for f in server.server_facts(results) if not f.get("skipped")]
    if not facts:
        return out
    out["notes"] = server.missing_figures(results, srv) + server.attribution_notes(srv)
    out["tables"].append((
        "Server metrics: source",
        "The target's own Prometheus page, read during the run (python -m loadgen "
        "--server-metrics): engine kind detected from the names it exposes, the model label "
        "each served name was read under, the canonical series it exposed and those its kind "
        "publishes but the page lacked (configs/metric_names.py SERVER_METRIC_NAMES). "
        + (" ".join(out["notes"]) if out["notes"] else "Every figure below could be computed."),
        [{"run_id": f.get("run_id"), "url": f.get("url"), "engine": f.get("engine"),
          "models": ", ".join(f"{k}: {v}" for k, v in (f.get("model_labels") or {}).items()),
          "exposed": ", ".join(f.get("exposed") or []), "missing": ", ".join(f.get("missing") or []),
          "samples": f.get("samples"), "failed_scrapes": f.get("failed_scrapes"),
          "status": f"not available ({f['error']})" if f.get("error") else "read"}
         for f in facts]))
    if srv.empty:
        return out
    out["tables"].append((
        "Server metrics per cell",
        "Deltas of the server's counters over each cell (a scrape at its start and end; a "
        "counter that went down, a restart, counts from 0). tau = 1 + accepted / drafts; "
        "request_steps = decode steps summed over requests (generation - accepted - finished, "
        "never below drafts); verification_tokens_total = draft tokens + request_steps; "
        "wasted_tokens = draft - accepted tokens, wasted_share = wasted / verification; steps = "
        "engine iterations (vLLM: the iteration-tokens histogram's count); tokens_per_step = "
        "prompt tokens computed + output tokens emitted per step (vLLM's histogram); step_ms = "
        "the mean inter-token latency (vLLM observes one per request per step: the step as its "
        "running requests saw it), else cell wall / steps (step_ms_from says which); "
        "wall_ms_per_step = cell wall / steps; engine_busy_share = step_ms x steps / cell wall; "
        "batch_size_mean / waiting_mean = sampled running / waiting gauges.",
        server.table_rows(srv)))
    fit = server_fit.fit_table(srv)
    if fit:
        out["tables"].append((
            "Step cost from server metrics (no step log)",
            "One sample per cell: step_ms (above) against the batch tokens of a mean step "
            "(verification + prompt tokens per step), fitted as a hinge floor + slope * max(0, T - "
            "knee) from 4 cells with distinct T, a line from 2 or 3, flat from one "
            "(knee_observed = no: run more tiers or users levels to see the knee). vLLM publishes "
            "no per-phase time, so this is the whole step (draft, verify, prefill and scheduling "
            "together).", fit))
    ts = server.timeseries(results)
    out["figures"]["server_timeline"] = server_timeline(ts)
    return out
