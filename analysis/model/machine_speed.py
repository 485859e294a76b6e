"""The machine's speed in each cell of a run: how slow the engine ran its own steps against
the engine profile of the same step shapes (``analysis.model.profiled``).

On a shared machine the same work costs a different CPU time from minute to minute: another
tenant on the host, or the serving path (proxy, streaming, the load generator) on the other
core, evicts the weights the engine reads from the shared cache. The main jobs of
2026-12-06 on a 2-core KVM guest: an autoregressive decode step at batch 1 cost 0.76-0.95x
its profile in one 10-s cell and 1.4-1.9x at 4 users in the next minutes, in two runs; the
engine thread's own CPU time moved with it (wall / CPU time 1.02-1.08 in every cell), so it
is not waits for a core.

Per cell (strategy x output class x users x repeat) the speed index is the median over its
decode-only steps of

    s = measured ms / profiled ms (the profile's verify(B, T, A) + draft(B), same shape)

on the engine thread's CPU time when both the step log and the profile have it, else the
wall clock. s = 1 is the machine as the profile saw it; s = 1.3 a machine 1.3x slower.

The capacity model uses it as a forecaster uses an exogenous predictor (Hyndman &
Athanasopoulos, *Forecasting: Principles and Practice*, 3rd ed., section 7.6, ex-ante
against ex-post forecasts): each held-in cell's figures are brought to s = 1 before the
calibration (``analysis.model.backtest``), so one slow cell does not bend the factors fitted
across levels; a prediction is made at the strategy's typical speed (``reference``: the
median over its held-in cells: ex-ante, what a plan uses) or at the held-out cell's own
measured speed (ex-post: the model's error with the machine's drift taken out). The cells'
spread around their reference is the floor no forecast of this machine goes under.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from configs import metric_names as mn

MIN_STEPS = 20          # a cell with fewer decode-only steps has no speed of its own
CELL_KEYS = (mn.STEP_STRATEGY, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS, mn.REQ_REPEAT)
TIME_COLUMNS = (mn.STEP_MS, mn.STEP_DRAFT_MS, mn.STEP_VERIFY_MS, mn.STEP_CPU_MS,
                mn.STEP_VERIFY_CPU_MS)


@dataclass(frozen=True)
class Speeds:
    """Per-cell speed indexes of one run: ``cells`` has columns strategy, output_class,
    users, repeat, speed, steps (decode-only steps it was read on)."""

    cells: pd.DataFrame

    def at(self, strategy: str, output_class: str, users, repeat=None) -> float:
        """The mean speed over the repeats of a (strategy, output class, users) cell (that
        ``repeat`` only, when given); NaN when the run has none."""
        c = self.cells
        m = c[c["strategy"].eq(strategy) & c["output_class"].eq(output_class)
              & c["users"].eq(float(users))]
        if repeat is not None:
            m = m[m["repeat"].eq(float(repeat))]
        return float(m["speed"].mean()) if len(m) else float("nan")

    def reference(self, strategy: str, levels=None) -> float:
        """The strategy's typical speed: the median over its cells (at ``levels`` when
        given); 1.0 when it has none."""
        c = self.cells[self.cells["strategy"].eq(strategy)]
        if levels is not None:
            c = c[c["users"].isin([float(u) for u in levels])]
        return float(c["speed"].median()) if len(c) else 1.0

    def of_rows(self, steps: pd.DataFrame) -> np.ndarray:
        """The speed of each step row's cell (the strategy's reference where its cell has
        none; 1.0 for a strategy without cells), shape [len(steps)]."""
        out = np.ones(len(steps))
        if steps.empty or self.cells.empty:
            return out
        steps = _with_repeat(steps)
        keys = [k for k in CELL_KEYS if k in steps]
        if len(keys) == len(CELL_KEYS):
            lut = self.cells.rename(columns={"strategy": mn.STEP_STRATEGY,
                                             "output_class": mn.REQ_OUTPUT_CLASS,
                                             "users": mn.REQ_USERS, "repeat": mn.REQ_REPEAT})
            left = steps[list(keys)].reset_index(drop=True).astype(
                {mn.REQ_USERS: float, mn.REQ_REPEAT: float})
            merged = left.merge(lut[list(keys) + ["speed"]].astype(
                {mn.REQ_USERS: float, mn.REQ_REPEAT: float}), on=list(keys), how="left")
            out = merged["speed"].to_numpy(float)
        else:
            out = np.full(len(steps), np.nan)
        ref = steps[mn.STEP_STRATEGY].map(
            {s: self.reference(s) for s in steps[mn.STEP_STRATEGY].unique()}).to_numpy(float)
        return np.where(np.isfinite(out), out, np.where(np.isfinite(ref), ref, 1.0))

    def spread(self) -> dict:
        """How far the cells lie from their strategy's reference: {"median", "worst"} of
        |s / reference - 1| and the cell it is worst in; the floor under an ex-ante error."""
        c = self.cells
        if c.empty:
            return {"median": float("nan"), "worst": float("nan"), "worst_cell": None, "n": 0}
        ref = c["strategy"].map({s: self.reference(s) for s in c["strategy"].unique()})
        dev = (c["speed"] / ref - 1.0).abs()
        i = dev.idxmax()
        w = c.loc[i]
        return {"median": float(dev.median()), "worst": float(dev.max()),
                "worst_cell": f"{w['strategy']} {w['output_class']} at {int(w['users'])} users, "
                              f"repeat {int(w['repeat'])}: {w['speed']:.2f}x against "
                              f"{ref.loc[i]:.2f}x",
                "n": int(len(c))}


def _with_repeat(steps: pd.DataFrame) -> pd.DataFrame:
    """``steps`` with a repeat label (0 where the log has none: one pass per cell)."""
    if mn.REQ_REPEAT in steps and steps[mn.REQ_REPEAT].notna().all():
        return steps
    rep = steps[mn.REQ_REPEAT] if mn.REQ_REPEAT in steps else pd.Series(0.0, index=steps.index)
    return steps.assign(**{mn.REQ_REPEAT: rep.fillna(0.0)})


def _profiled_ms(parts, g: pd.DataFrame) -> np.ndarray:
    from analysis.model import stepcost

    f = stepcost.step_features(g)
    b = np.maximum(f["B"].to_numpy(float), 1.0)
    return (parts.verify(b, np.maximum(f["T"].to_numpy(float), 1.0), f["A"].to_numpy(float))
            + parts.draft(b))


def cell_speeds(steps: pd.DataFrame, profile: dict | None, skip=()) -> Speeds:
    """``Speeds`` of every cell of ``steps`` (step rows with users and repeat labels) against
    ``profile`` (an engine profile dict). Strategies the profile lacks, or in ``skip`` (a
    vLLM backend), and cells with fewer than ``MIN_STEPS`` decode-only steps get no row.
    Empty without a profile."""
    from analysis.model import profiled

    cols = ["strategy", "output_class", "users", "repeat", "speed", "steps"]
    if profile is None or steps is None or steps.empty \
            or any(k not in steps for k in CELL_KEYS if k != mn.REQ_REPEAT):
        return Speeds(pd.DataFrame(columns=cols))
    steps = _with_repeat(steps)
    rows = []
    dec = steps[(steps[mn.STEP_BATCH_SIZE] > 0) & (steps[mn.STEP_PREFILL_TOKENS].fillna(0) == 0)
                & steps[mn.REQ_USERS].notna()]
    for strategy, g in dec.groupby(mn.STEP_STRATEGY):
        if strategy in skip:
            continue
        parts = profiled.parts_from_profile(profile, str(strategy))
        if parts is None:
            continue
        use_cpu = parts.clock == "cpu_ms" and mn.STEP_CPU_MS in g and g[mn.STEP_CPU_MS].notna().all()
        y = g[mn.STEP_CPU_MS if use_cpu else mn.STEP_MS].to_numpy(float)
        ratio = pd.Series(y / np.maximum(_profiled_ms(parts, g), 1e-9), index=g.index)
        for (oc, users, rep), r in ratio.groupby([g[mn.REQ_OUTPUT_CLASS], g[mn.REQ_USERS],
                                                 g[mn.REQ_REPEAT]]):
            if len(r) >= MIN_STEPS:
                rows.append((str(strategy), str(oc), float(users), float(rep),
                             float(r.median()), int(len(r))))
    return Speeds(pd.DataFrame(rows, columns=cols))


def normalized_steps(steps: pd.DataFrame, speeds: Speeds) -> pd.DataFrame:
    """``steps`` as the machine at s = 1 would have run them: every time column over its
    cell's speed, and ``ts`` too (the engine loop's gaps between steps are read off ts
    differences within a cell). For the step model's calibration only: its ts no longer
    lines up with the requests' clock."""
    if speeds.cells.empty or steps.empty:
        return steps
    s = speeds.of_rows(steps)
    out = steps.copy()
    for c in TIME_COLUMNS + (mn.STEP_TS,):
        if c in out:
            out[c] = out[c].astype(float).to_numpy() / s
    return out
