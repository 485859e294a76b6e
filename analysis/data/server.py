"""Per-cell figures from the target's own Prometheus counters (``--server-metrics``).

The load generator scrapes the target's ``/metrics`` while each cell runs
(``loadgen.run.server_metrics``) and stores each cell's deltas in the manifest
(``cells[i].server_metrics``); the time series is ``server_metrics.parquet``.
This module turns them into what the step log gives for specload's own engine
(docs/design.md "Metric definitions"), per cell (run, strategy, tier, output
class, users; repeats pooled):

- tau = 1 + accepted / drafts (SGLang, which has no counters for it: the mean of its
  ``spec_accept_length`` gauge over the cell's samples, labelled ``tau_from``);
- per-position acceptance: unconditional = accepted at i / drafts (vLLM's
  definition); conditional = accepted at i / accepted at i-1 (position 1: / drafts),
  exact for prefix acceptance (a token at i is only accepted after i-1 was);
- decode request-steps R = generation tokens - accepted tokens - finished requests
  (each request's first token comes from prefill, every decode step of a request
  emits 1 + its accepted tokens), but never fewer than the drafts: vLLM counts
  accepted tokens that ``max_tokens`` or a stop string then cut (measured here: 67
  of 1592 on 48 requests), which makes that difference smaller than the steps
  when every step drafted (``draft_model``); R = drafts then, and also when a counter
  for the difference is missing (a lower bound for ``ngram``, which drafts nothing
  without a match);
- verification tokens = draft tokens + R (sum over the batch of draft length + 1);
  wasted tokens = draft tokens - accepted tokens; wasted share = wasted / verification;
- engine steps = the delta of the iteration-tokens histogram's count (vLLM) or of
  the step-time histogram's count (specload); tokens per step = its sum / count
  (vLLM counts prompt tokens computed + output tokens emitted per step, not the
  verification tokens); step_ms = cell wall time / steps (the engine is busy through
  a closed-loop cell; an idle engine makes this an upper bound); specload's own
  step-time histogram gives step_ms directly;
- mean running batch and queue: the mean of the sampled gauges.

Where the server exposes no counter for a figure, the figure is missing and
``missing_figures`` says which counter it needed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from configs import metric_names as mn

SERVER_KEY = "server_metrics"          # a manifest cell's dict of deltas; the manifest's run-level facts
CELL_KEYS = [mn.REQ_RUN_ID, mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS]
SUM_KEYS = tuple(k for k in mn.SRV_COUNTERS if k != mn.SRV_NUM_ACCEPTED_PER_POS) + (
    "unattributed_drafts", "requests_num_drafts", "requests_without_stats")

# figure -> the server counters it needs (the report names what is missing)
NEEDS = {
    "tau (from counters)": (mn.SRV_NUM_DRAFTS, mn.SRV_NUM_ACCEPTED_TOKENS),
    "per-position acceptance": (mn.SRV_NUM_ACCEPTED_PER_POS, mn.SRV_NUM_DRAFTS),
    "wasted tokens": (mn.SRV_NUM_DRAFT_TOKENS, mn.SRV_NUM_ACCEPTED_TOKENS),
    "verification tokens": (mn.SRV_NUM_DRAFT_TOKENS, mn.SRV_GENERATION_TOKENS, mn.SRV_REQUESTS_FINISHED),
    "engine steps / step time": (mn.SRV_ENGINE_STEPS,),
    "mean running batch": (mn.SRV_RUNNING,),
    "queueing": (mn.SRV_WAITING,),
}


def server_facts(results) -> list[dict]:
    """Per run: the manifest's ``server_metrics`` facts (url, engine, models, missing, ...)."""
    return [dict(run.manifest.get(SERVER_KEY) or {}, run_id=run.run_id) for run in results.runs
            if run.manifest.get(SERVER_KEY)]


def cell_rows(results) -> pd.DataFrame:
    """One row per manifest cell that carries server deltas (a repeat is its own row)."""
    rows = []
    for run in results.runs:
        for c in run.manifest.get("cells") or []:
            srv = c.get(SERVER_KEY)
            if not srv:
                continue
            row = {mn.REQ_RUN_ID: run.run_id, mn.REQ_STRATEGY: c.get("strategy"),
                   mn.REQ_TIER: c.get("tier"), mn.REQ_OUTPUT_CLASS: c.get("output_class"),
                   mn.REQ_USERS: c.get("users"), mn.REQ_REPEAT: c.get("repeat", 0),
                   mn.CELL_DURATION_S: c.get("duration_s"), mn.CELL_N_OK: c.get("n_ok")}
            row.update({k: v for k, v in srv.items()})
            rows.append(row)
    return pd.DataFrame(rows)


def _sum_lists(series: pd.Series) -> list[float] | None:
    lists = [list(v) for v in series if isinstance(v, (list, tuple, np.ndarray)) and len(v)]
    if not lists:
        return None
    width = max(len(v) for v in lists)
    return [float(sum(v[i] for v in lists if i < len(v))) for i in range(width)]


def cell_table(results) -> pd.DataFrame:
    """Per cell (``CELL_KEYS``, repeats pooled): the counters summed, gauge means averaged,
    and the derived figures (module docstring). Empty when no cell has server deltas."""
    raw = cell_rows(results)
    if raw.empty:
        return raw
    out = []
    for key, g in raw.groupby(CELL_KEYS, sort=True, dropna=False):
        row = dict(zip(CELL_KEYS, key))
        for k in SUM_KEYS:
            row[k] = g[k].sum(min_count=1) if k in g else np.nan
        row[mn.SRV_NUM_ACCEPTED_PER_POS] = (_sum_lists(g[mn.SRV_NUM_ACCEPTED_PER_POS])
                                            if mn.SRV_NUM_ACCEPTED_PER_POS in g else None)
        for gauge in mn.SRV_GAUGES:
            for stat in ("mean", "max"):
                col = f"{gauge}_{stat}"
                if col in g:
                    row[col] = g[col].mean() if stat == "mean" else g[col].max()
        row["duration_s"] = g[mn.CELL_DURATION_S].sum(min_count=1)
        row["counter_resets"] = int(g["counter_resets"].fillna(0).sum()) if "counter_resets" in g else 0
        row["samples"] = int(g["samples"].fillna(0).sum()) if "samples" in g else 0
        out.append(_derive(row))
    return pd.DataFrame(out)


def _num(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return float("nan")
    return f


def _derive(row: dict) -> dict:
    drafts, dtok = _num(row.get(mn.SRV_NUM_DRAFTS)), _num(row.get(mn.SRV_NUM_DRAFT_TOKENS))
    acc = _num(row.get(mn.SRV_NUM_ACCEPTED_TOKENS))
    gen, fin = _num(row.get(mn.SRV_GENERATION_TOKENS)), _num(row.get(mn.SRV_REQUESTS_FINISHED))
    steps, stok = _num(row.get(mn.SRV_ENGINE_STEPS)), _num(row.get(mn.SRV_STEP_TOKENS))
    prompt = _num(row.get(mn.SRV_PROMPT_TOKENS))
    dur = _num(row.get("duration_s"))
    row["tau"] = 1.0 + acc / drafts if drafts > 0 else (1.0 if drafts == 0 else np.nan)
    row["tau_from"] = "drafts / accepted counters" if np.isfinite(row["tau"]) else None
    gauge_tau = _num(row.get(f"{mn.SRV_ACCEPT_LENGTH}_mean"))
    if not np.isfinite(row["tau"]) and np.isfinite(gauge_tau):
        # SGLang publishes no counters for it, only its own running mean acceptance length
        row["tau"], row["tau_from"] = gauge_tau, "engine gauge (mean of samples)"
    # decode request-steps: each emits 1 + its accepted tokens; the first token is prefill's
    req_steps, basis = np.nan, None
    if np.isfinite(gen) and np.isfinite(fin):
        req_steps, basis = gen - (acc if np.isfinite(acc) else 0.0) - fin, "generation - accepted - finished"
    if np.isfinite(drafts) and (not np.isfinite(req_steps) or req_steps < drafts):
        # fewer than the drafts: the server counts accepted tokens that max_tokens / a stop then
        # cut (vLLM does), so every decode step drafted and the drafts are the steps
        req_steps, basis = drafts, "drafts"
    row["request_steps"], row["request_steps_from"] = req_steps, basis
    verif = (dtok if np.isfinite(dtok) else 0.0) + req_steps if np.isfinite(req_steps) else np.nan
    if mn.SRV_VERIFICATION_TOKENS in row and np.isfinite(_num(row[mn.SRV_VERIFICATION_TOKENS])):
        verif = _num(row[mn.SRV_VERIFICATION_TOKENS])   # specload's own histogram: exact
    row["verification_tokens_total"] = verif
    wasted = dtok - acc if np.isfinite(dtok) and np.isfinite(acc) else np.nan
    row["wasted_tokens"] = wasted
    row["wasted_share"] = wasted / verif if np.isfinite(wasted) and verif > 0 else np.nan
    row["verification_per_request_step"] = verif / req_steps if req_steps and req_steps > 0 else np.nan
    row["steps"] = steps
    row["tokens_per_step"] = stok / steps if steps > 0 else np.nan
    row["verification_tokens_per_step"] = verif / steps if steps > 0 and np.isfinite(verif) else np.nan
    row["batch_tokens_per_step"] = ((verif + (prompt if np.isfinite(prompt) else 0.0)) / steps
                                    if steps > 0 and np.isfinite(verif) else np.nan)
    step_ms_sum = _num(row.get(mn.SRV_STEP_MS))
    itl_s, itl_n = _num(row.get(mn.SRV_ITL_SUM_S)), _num(row.get(mn.SRV_ITL_COUNT))
    row["step_ms"] = (step_ms_sum / steps if steps > 0 and np.isfinite(step_ms_sum) else
                      1000.0 * itl_s / itl_n if itl_n > 0 and np.isfinite(itl_s) else
                      1000.0 * dur / steps if steps > 0 and dur > 0 else np.nan)
    row["step_ms_from"] = ("step-time histogram" if np.isfinite(step_ms_sum) else
                           "inter-token latency histogram" if itl_n > 0 and np.isfinite(itl_s) else
                           "cell wall / steps" if np.isfinite(row["step_ms"]) else None)
    row["wall_ms_per_step"] = 1000.0 * dur / steps if steps > 0 and dur > 0 else np.nan
    row["engine_busy_share"] = (row["step_ms"] * steps / (1000.0 * dur)
                                if row["step_ms_from"] == "inter-token latency histogram" and dur > 0 else np.nan)
    row["steps_per_s"] = steps / dur if steps > 0 and dur > 0 else np.nan
    row["batch_size_mean"] = _num(row.get(f"{mn.SRV_RUNNING}_mean"))
    if not np.isfinite(row["batch_size_mean"]) and np.isfinite(_num(row.get(mn.SRV_DECODE_ROWS))) and steps > 0:
        row["batch_size_mean"] = _num(row[mn.SRV_DECODE_ROWS]) / steps
    row["waiting_mean"] = _num(row.get(f"{mn.SRV_WAITING}_mean"))
    row["ms_per_emitted_token"] = (1000.0 * dur / gen if dur > 0 and gen > 0 else np.nan)
    return row


def per_position(srv: pd.DataFrame, by: str = mn.REQ_STRATEGY) -> pd.DataFrame:
    """Per-position acceptance from the server's per-position counters, per ``by`` group;
    the columns of ``analysis.data.metrics.per_position`` plus ``source``."""
    rows = []
    if srv.empty or mn.SRV_NUM_ACCEPTED_PER_POS not in srv:
        return pd.DataFrame(columns=[by, "position", "accepted", "uncond", "cond", "source"])
    for key, g in srv.groupby(by, sort=True):
        acc = _sum_lists(g[mn.SRV_NUM_ACCEPTED_PER_POS])
        has = g[mn.SRV_NUM_ACCEPTED_PER_POS].map(lambda v: isinstance(v, (list, tuple, np.ndarray)) and len(v) > 0)
        drafts = float(g.loc[has, mn.SRV_NUM_DRAFTS].sum()) if mn.SRV_NUM_DRAFTS in g else np.nan
        if not acc:
            continue
        prev = drafts
        for i, a in enumerate(acc):
            rows.append({by: key, "position": i + 1, "accepted": a,
                         "uncond": a / drafts if drafts else np.nan,
                         "cond": a / prev if prev else np.nan, "source": "server /metrics"})
            prev = a
    return pd.DataFrame(rows, columns=[by, "position", "accepted", "uncond", "cond", "source"])


def missing_figures(results, srv: pd.DataFrame) -> list[str]:
    """Sentences: which counter the server did not expose and what could not be computed."""
    notes = []
    for facts in server_facts(results):
        if facts.get("error") and not facts.get("skipped"):   # skipped: not needed, not a failure
            notes.append(f"run {facts['run_id']}: server metrics not available ({facts['error']})")
    if srv.empty:
        return notes
    for figure, needs in NEEDS.items():
        absent = [n for n in needs if n not in srv.columns and f"{n}_mean" not in srv.columns
                  or (n in srv.columns and srv[n].isna().all())]
        if figure == "verification tokens" and mn.SRV_VERIFICATION_TOKENS in srv and srv[
                mn.SRV_VERIFICATION_TOKENS].notna().any():
            continue
        if absent:
            notes.append(f"{figure}: not computed from the server (it exposes no "
                         f"{', '.join(absent)})")
    if "request_steps_from" in srv and srv["request_steps_from"].eq("drafts").any() and (
            mn.SRV_GENERATION_TOKENS not in srv or srv[mn.SRV_GENERATION_TOKENS].isna().any()):
        notes.append("verification tokens: decode steps taken as drafts (no generation-token or "
                     "finished-request counter): a lower bound where steps drafted nothing")
    if srv.get("counter_resets") is not None and srv["counter_resets"].fillna(0).sum() > 0:
        notes.append(f"{int(srv['counter_resets'].sum())} counter reset(s) (a server restart) inside "
                     "cells: the increments after each restart are counted from 0")
    return notes


def table_rows(srv: pd.DataFrame) -> list[dict]:
    """The report's per-cell server table."""
    cols = [mn.REQ_RUN_ID, mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS,
            mn.SRV_NUM_DRAFTS, mn.SRV_NUM_DRAFT_TOKENS, mn.SRV_NUM_ACCEPTED_TOKENS, "tau", "tau_from",
            "request_steps", "verification_tokens_total", "wasted_tokens", "wasted_share",
            "steps", "tokens_per_step", "step_ms", "step_ms_from", "wall_ms_per_step", "engine_busy_share",
            "batch_size_mean", "waiting_mean",
            f"{mn.SRV_KV_USAGE}_max", mn.SRV_PREEMPTIONS, "counter_resets"]
    if srv.empty:
        return []
    df = srv[[c for c in cols if c in srv.columns]].sort_values([mn.REQ_RUN_ID, mn.REQ_STRATEGY, mn.REQ_USERS])
    return [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
            for r in df.to_dict("records")]


def fill_cells(cells: pd.DataFrame, srv: pd.DataFrame) -> pd.DataFrame:
    """The per-cell table with tau from the server where the requests carried none, and
    ``acceptance_source`` saying where each cell's tau comes from (requests | server | None)."""
    out = cells.copy()
    src = pd.Series(np.where(out[mn.ACCEPTANCE_LENGTH].notna(), "requests", None), index=out.index,
                    dtype=object)
    if not srv.empty and "tau" in srv:
        m = out[CELL_KEYS].merge(srv[CELL_KEYS + ["tau"]], on=CELL_KEYS, how="left")
        fill = out[mn.ACCEPTANCE_LENGTH].isna().to_numpy() & m["tau"].notna().to_numpy()
        out.loc[fill, mn.ACCEPTANCE_LENGTH] = m.loc[fill, "tau"].to_numpy()
        src[fill] = "server"
    out["acceptance_source"] = src
    return out


def merge_positions(positions: pd.DataFrame, srv: pd.DataFrame) -> pd.DataFrame:
    """Request-based per-position rows (``source`` = requests) plus the server's for the
    strategies the requests gave none for."""
    pos = positions.copy()
    pos["source"] = "requests"
    have = set(pos.loc[pos["accepted"].notna(), mn.REQ_STRATEGY])
    extra = per_position(srv)
    extra = extra[~extra[mn.REQ_STRATEGY].isin(have)]
    return pd.concat([pos, extra], ignore_index=True) if not extra.empty else pos


def capacity_rows(srv: pd.DataFrame) -> pd.DataFrame:
    """``analysis.model.capacity.capacity_table``'s columns per strategy from the server's
    counters (``source`` = server /metrics): steps, mean running batch, verification tokens
    per step and per decode request-step, emitted tokens per request-step, wasted share,
    verification per emitted token, engine ms per emitted token (cell wall / generation tokens)."""
    rows = []
    if srv.empty:
        return pd.DataFrame()
    for strategy, g in srv.groupby(mn.REQ_STRATEGY, sort=True):
        f = {c: g[c].astype(float).sum(min_count=1) if c in g else np.nan
             for c in ("steps", "request_steps", "verification_tokens_total", "wasted_tokens",
                       mn.SRV_NUM_ACCEPTED_TOKENS, mn.SRV_GENERATION_TOKENS, "duration_s")}
        rs, verif, acc = f["request_steps"], f["verification_tokens_total"], f[mn.SRV_NUM_ACCEPTED_TOKENS]
        emitted = rs + acc if np.isfinite(rs) and np.isfinite(acc) else np.nan
        rows.append({mn.STEP_STRATEGY: strategy, "steps": f["steps"],
                     "batch_size_mean": g["batch_size_mean"].astype(float).mean(),
                     "verification_tokens_per_step": verif / f["steps"] if f["steps"] > 0 else np.nan,
                     "verification_tokens_per_request": verif / rs if rs > 0 else np.nan,
                     "emitted_tokens_per_request": emitted / rs if rs > 0 else np.nan,
                     "wasted_share": f["wasted_tokens"] / verif if verif > 0 else np.nan,
                     "verification_per_emitted": verif / emitted if emitted > 0 else np.nan,
                     "ms_per_emitted_token": (1000.0 * f["duration_s"] / f[mn.SRV_GENERATION_TOKENS]
                                              if f[mn.SRV_GENERATION_TOKENS] > 0 else np.nan),
                     "source": "server /metrics"})
    return pd.DataFrame(rows)


def merge_capacity(cap: pd.DataFrame, srv: pd.DataFrame) -> pd.DataFrame:
    """Step-log capacity rows (``source`` = step log) plus the server's for strategies
    without a step log."""
    cap = cap.copy()
    if not cap.empty:
        cap["source"] = "step log"
    extra = capacity_rows(srv)
    if extra.empty:
        return cap
    if not cap.empty:
        extra = extra[~extra[mn.STEP_STRATEGY].isin(set(cap[mn.STEP_STRATEGY]))]
    return pd.concat([cap, extra], ignore_index=True) if not cap.empty else extra


def timeseries(results) -> pd.DataFrame:
    """Every run's ``server_metrics.parquet`` (the sampled series), concatenated; empty
    when no run wrote one. Raises ``analysis.data.load.ResultsError`` for a newer schema."""
    from analysis.data.load import read_results_parquet

    frames = [read_results_parquet(run.path / SERVER_METRICS_FILE) for run in results.runs
              if (run.path / SERVER_METRICS_FILE).is_file()]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


SERVER_METRICS_FILE = "server_metrics.parquet"


def attribution_notes(srv: pd.DataFrame) -> list[str]:
    """Cells where the server counted drafts the cell's own requests did not report (other
    traffic to the engine during the cell: vLLM's counters carry one label per engine)."""
    if srv.empty or "unattributed_drafts" not in srv:
        return []
    without = (srv["requests_without_stats"].fillna(0).astype(float) if "requests_without_stats" in srv
               else pd.Series(0.0, index=srv.index))
    bad = srv[(srv["unattributed_drafts"].fillna(0).astype(float) != 0) & (without == 0)]
    return [f"{r[mn.REQ_STRATEGY]} {r[mn.REQ_TIER]}/{r[mn.REQ_OUTPUT_CLASS]} u{r[mn.REQ_USERS]}: the server "
            f"counted {int(r['unattributed_drafts'])} drafts more than the cell's requests report "
            "(other traffic reached the engine during the cell; its counters cannot tell it apart)"
            for _, r in bad.iterrows()]


def acceptance_by_class(srv: pd.DataFrame | None, tier: str | None = None) -> tuple[dict, dict]:
    """({(strategy, output class): tau}, {(strategy, output class): v}) pooled over the cells
    of ``tier`` (every tier when None): tau = 1 + accepted / drafts, v = verification tokens
    per decode request-step. Empty dicts without server cells."""
    taus: dict = {}
    vs: dict = {}
    if srv is None or srv.empty or mn.SRV_NUM_DRAFTS not in srv:
        return taus, vs
    df = srv if tier is None else srv[srv[mn.REQ_TIER].eq(tier)]
    for key, g in df.groupby([mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS]):
        drafts = g[mn.SRV_NUM_DRAFTS].astype(float).sum()
        acc = g[mn.SRV_NUM_ACCEPTED_TOKENS].astype(float).sum() if mn.SRV_NUM_ACCEPTED_TOKENS in g else np.nan
        if drafts > 0 and np.isfinite(acc):
            taus[key] = 1.0 + acc / drafts
        rs, verif = g["request_steps"].astype(float).sum(), g["verification_tokens_total"].astype(float).sum()
        if rs > 0 and np.isfinite(verif):
            vs[key] = verif / rs
    return taus, vs
