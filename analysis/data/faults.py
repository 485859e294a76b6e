"""Faults seen in a run: failed and rejected requests, outage windows, a time line.

A *failed* request is one the service accepted and did not finish
(``configs.metric_names.FAILURE_STATUSES``: error, timeout, disconnected: a
replica that died mid-stream, an engine error, a hung request). A *rejected*
request was shed on purpose (HTTP 429, ``rejected``): overload, not a fault.

Outage window of a cell (run x strategy x tier x output class x users) with
failures: from the end of its first failed request to the first token of an
``ok`` request after its last failure (service back), in unix seconds. With no
token after the last failure the window runs to the cell's last row end and is
marked ``recovered`` False. A recommendation whose cell had failures rests on a
degraded run; ``annotate_degraded`` says so in its note.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from configs import metric_names as mn

CELL = [mn.REQ_RUN_ID, mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS]
OUTAGE_COLUMNS = CELL + ["n_requests", "n_failed", "n_rejected", "n_retried", "failed_by_status",
                         "outage_start_ts", "outage_end_ts", "outage_s", "recovered"]
TIMELINE_COLUMNS = [mn.REQ_STRATEGY, "t_s", "n_ended", "n_failed", "n_rejected", "error_rate",
                    "output_tokens_per_s"]


def _failed(df: pd.DataFrame) -> pd.Series:
    return df[mn.REQ_STATUS].isin(mn.FAILURE_STATUSES)


def _failure_onset(failed: pd.DataFrame) -> pd.Series:
    """When each failed request last showed life: its end, except for a ``timeout``, which
    ends a full request timeout after its server went silent (nothing crosses a cut link,
    and Serve does not fail requests to a node it declared dead): its first token's time,
    else its send time. The outage then opens at the fault, not one timeout later."""
    onset = failed[mn.REQ_END_TS].astype(float)
    timed_out = failed[mn.REQ_STATUS].eq(mn.STATUS_TIMEOUT)
    if timed_out.any():
        alive = failed[mn.REQ_FIRST_TOKEN_TS].astype(float)
        for col in (mn.REQ_SENT_TS, mn.REQ_SCHEDULED_TS):
            if col in failed:
                alive = alive.fillna(failed[col].astype(float))
        onset = onset.where(~timed_out, alive.fillna(onset).clip(upper=onset))
    return onset


def outages(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per cell with at least one failed or rejected request (``OUTAGE_COLUMNS``).

    The window opens at the first failed request's onset (``_failure_onset``: its end, or
    for a timeout its last sign of life) and closes at the first token of an ``ok`` request
    after the last failure. ``outage_s`` is the window length in seconds (NaN without failures);
    ``failed_by_status`` e.g. ``"disconnected: 3, error: 1"``.
    """
    rows = []
    retries = (requests[mn.REQ_RETRIES] if mn.REQ_RETRIES in requests
               else pd.Series(0, index=requests.index)).fillna(0)
    for key, g in requests.groupby(CELL, sort=True):
        failed = g[_failed(g)]
        rejected = int(g[mn.REQ_STATUS].eq(mn.STATUS_REJECTED).sum())
        if failed.empty and not rejected:
            continue
        row = dict(zip(CELL, key))
        row.update(n_requests=len(g), n_failed=len(failed), n_rejected=rejected,
                   n_retried=int((retries.loc[g.index] > 0).sum()),
                   failed_by_status=", ".join(f"{s}: {n}" for s, n in
                                              failed[mn.REQ_STATUS].value_counts().sort_index().items()),
                   outage_start_ts=np.nan, outage_end_ts=np.nan, outage_s=np.nan, recovered=None)
        if not failed.empty:
            start = float(_failure_onset(failed).min())
            last = float(failed[mn.REQ_END_TS].max())
            ok = g[g[mn.REQ_STATUS].eq(mn.STATUS_OK)]
            after = ok.loc[ok[mn.REQ_FIRST_TOKEN_TS] > last, mn.REQ_FIRST_TOKEN_TS]
            recovered = not after.empty
            end = float(after.min()) if recovered else float(g[mn.REQ_END_TS].max())
            row.update(outage_start_ts=start, outage_end_ts=end, outage_s=end - start,
                       recovered=recovered)
        rows.append(row)
    return pd.DataFrame(rows, columns=OUTAGE_COLUMNS)


def timeline(requests: pd.DataFrame, bin_s: float = 1.0) -> pd.DataFrame:
    """Per strategy and ``bin_s`` time bin (by request end; ``t_s`` = bin start, seconds from
    the run's first scheduled send): requests ended, failed, rejected, error rate (failed /
    ended) and output tokens/s of ``ok`` requests."""
    df = requests[requests[mn.REQ_END_TS].notna()]
    if df.empty:
        return pd.DataFrame(columns=TIMELINE_COLUMNS)
    t0 = float(np.nanmin(df[mn.REQ_SCHEDULED_TS].fillna(df[mn.REQ_END_TS])))
    b = ((df[mn.REQ_END_TS] - t0) // bin_s).astype(int)
    ok_tokens = df[mn.REQ_OUTPUT_TOKENS].fillna(0).where(df[mn.REQ_STATUS].eq(mn.STATUS_OK), 0)
    frame = pd.DataFrame({mn.REQ_STRATEGY: df[mn.REQ_STRATEGY], "bin": b, "failed": _failed(df),
                          "rejected": df[mn.REQ_STATUS].eq(mn.STATUS_REJECTED), "tokens": ok_tokens})
    out = []
    for strategy, g in frame.groupby(mn.REQ_STRATEGY, sort=True):
        agg = g.groupby("bin").agg(n_ended=("failed", "size"), n_failed=("failed", "sum"),
                                   n_rejected=("rejected", "sum"), tokens=("tokens", "sum"))
        agg = agg.reindex(range(int(agg.index.min()), int(agg.index.max()) + 1), fill_value=0)
        n_ended = agg["n_ended"].to_numpy()
        out.append(pd.DataFrame({
            mn.REQ_STRATEGY: strategy, "t_s": agg.index.to_numpy() * bin_s,
            "n_ended": n_ended.astype(int), "n_failed": agg["n_failed"].to_numpy().astype(int),
            "n_rejected": agg["n_rejected"].to_numpy().astype(int),
            "error_rate": np.divide(agg["n_failed"].to_numpy(), n_ended,
                                    out=np.zeros(len(agg)), where=n_ended > 0),
            "output_tokens_per_s": agg["tokens"].to_numpy() / bin_s}))
    out_df = (pd.concat(out, ignore_index=True)[TIMELINE_COLUMNS] if out
              else pd.DataFrame(columns=TIMELINE_COLUMNS))
    out_df.attrs["t0"] = t0
    return out_df


def annotate_degraded(rec: dict, outage: pd.DataFrame) -> dict:
    """Mark each tier x output class recommendation whose cells had failed requests.

    Adds ``degraded`` (bool) and ``degraded_strategies`` ({strategy: {"failed", "outage_s",
    "recovered"}}) to every entry, and prefixes the note. Returns ``rec`` (changed in place).
    """
    bad = outage[outage["n_failed"] > 0] if not outage.empty else outage
    for tier, by_oc in rec.items():
        for oc, r in by_oc.items():
            sel = bad[bad[mn.REQ_TIER].eq(tier) & bad[mn.REQ_OUTPUT_CLASS].eq(oc)] if len(bad) else bad
            info = {}
            for strategy, g in (sel.groupby(mn.REQ_STRATEGY) if len(sel) else []):
                secs = g["outage_s"].dropna()
                info[strategy] = {"failed": int(g["n_failed"].sum()),
                                  "outage_s": float(secs.sum()) if len(secs) else None,
                                  "recovered": bool(g["recovered"].fillna(False).all())}
            r["degraded"] = bool(info)
            r["degraded_strategies"] = info
            if info:
                what = "; ".join(f"{s}: {v['failed']} failed request(s)"
                                 + (f", {v['outage_s']:.1f} s outage" if v["outage_s"] is not None else "")
                                 + ("" if v["recovered"] else ", not recovered in the cell")
                                 for s, v in sorted(info.items()))
                note = f"rests on a degraded run ({what}); re-run this cell for a clean measurement"
                r["note"] = f"{note}. {r['note']}" if r.get("note") else note
    return rec
