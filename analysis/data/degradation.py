"""Degradation check against a baseline run (for CI pipelines).

For every strategy x domain (the request's ``dataset``) present in both the
current results and the baseline, compare:

- acceptance length tau = 1 + sum(accepted) / sum(drafts) (token-weighted);
- goodput = output tokens of requests meeting the SLOs / wall time, summed
  over the tier cells both sides share (the same SLOs judge both sides).

A relative drop above ``threshold`` (default 10 %) is flagged. The CLI exits
with ``EXIT_DEGRADED`` when anything is flagged.
"""

from __future__ import annotations

import pandas as pd

from analysis.data.metrics import DURATION_S, GOOD, pooled_tau
from analysis.data.dimensions import with_sampling
from configs import metric_names as mn

DEFAULT_THRESHOLD = 0.10
EXIT_DEGRADED = 3
_CELL = [mn.REQ_RUN_ID, *mn.CELL_KEY]


def _by_domain(flagged: pd.DataFrame, cells: pd.DataFrame, shared_cells: set) -> pd.DataFrame:
    """Per strategy x dataset: tau and goodput (tokens/s) over the shared tier cells."""
    dur = cells.set_index(_CELL)[DURATION_S]
    rows = []
    for (strategy, dataset), g in flagged.groupby([mn.REQ_STRATEGY, mn.REQ_DATASET]):
        g = g[[k in shared_cells for k in zip(*(g[c] for c in mn.CELL_KEY))]]
        if g.empty:
            continue
        keys = g[_CELL].drop_duplicates().itertuples(index=False, name=None)
        seconds = float(sum(dur.loc[k] for k in keys))
        good_tokens = g.loc[g[GOOD], mn.REQ_OUTPUT_TOKENS].sum()
        rows.append({mn.REQ_STRATEGY: strategy, mn.REQ_DATASET: dataset,
                     "tau": pooled_tau(g[g[mn.REQ_STATUS].eq("ok")]),
                     "goodput": good_tokens / seconds if seconds > 0 else float("nan")})
    return pd.DataFrame(rows, columns=[mn.REQ_STRATEGY, mn.REQ_DATASET, "tau", "goodput"])


def compare(cur_flagged, cur_cells, base_flagged, base_cells,
            threshold: float = DEFAULT_THRESHOLD) -> pd.DataFrame:
    """One row per strategy x dataset in both sides: baseline and current tau and
    goodput, relative drops (positive = worse) and ``flagged`` with ``reason``.

    Acceptance is only checked where both sides drafted (tau > 1 is possible).
    """
    cur_flagged, base_flagged = with_sampling(cur_flagged), with_sampling(base_flagged)
    cur_cells, base_cells = with_sampling(cur_cells), with_sampling(base_cells)

    def cell_set(f):
        return set(zip(*(f[c] for c in mn.CELL_KEY)))
    shared = cell_set(cur_flagged) & cell_set(base_flagged)
    cur = _by_domain(cur_flagged, cur_cells, shared)
    base = _by_domain(base_flagged, base_cells, shared)
    df = base.merge(cur, on=[mn.REQ_STRATEGY, mn.REQ_DATASET], suffixes=("_base", "_cur"))
    df["tau_drop"] = (df["tau_base"] - df["tau_cur"]) / df["tau_base"]
    df["goodput_drop"] = (df["goodput_base"] - df["goodput_cur"]) / df["goodput_base"]
    spec = df["tau_base"].gt(1.0) & df["tau_cur"].notna()
    tau_bad = spec & df["tau_drop"].gt(threshold)
    gp_bad = df["goodput_base"].gt(0) & df["goodput_drop"].gt(threshold)
    df["flagged"] = tau_bad | gp_bad
    df["reason"] = [", ".join(r for r, on in (
        (f"acceptance length -{t:.0%}", a), (f"goodput -{g:.0%}", b)) if on)
        for t, g, a, b in zip(df["tau_drop"], df["goodput_drop"], tau_bad, gp_bad)]
    return df
