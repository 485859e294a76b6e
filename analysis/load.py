"""Load the load generator's results: ``requests.parquet``, ``steps.parquet`` and
``manifest.json`` from one run directory or from a parent of several.

A run directory is any directory that holds ``requests.parquet``. Columns the
server did not report (third-party engines report no speculative statistics
and write no step log) are added as missing values, so every later stage can
rely on the full column set of ``configs.metric_names``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from configs import metric_names as mn

REQUESTS_FILE = "requests.parquet"
STEPS_FILE = "steps.parquet"
MANIFEST_FILE = "manifest.json"

# Optional per-request columns (reported only by servers with speculative stats).
TOP1_COV_PER_POS = "top1_cov_per_pos"      # list[float], P(target in draft top-1 at i | prefix ok)
TOPK_COV_PER_POS = "topk_cov_per_pos"      # list[float], same for the drafter's top-k
SPEC_NUMERIC_COLUMNS = (mn.NUM_DRAFTS, mn.NUM_DRAFT_TOKENS, mn.NUM_ACCEPTED_TOKENS,
                        mn.DRAFT_MS, mn.VERIFY_MS, mn.QUEUE_MS)
LIST_COLUMNS = (mn.NUM_ACCEPTED_TOKENS_PER_POS, TOP1_COV_PER_POS, TOPK_COV_PER_POS)
REQUIRED_COLUMNS = (mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS,
                    mn.REQ_OUTPUT_TOKENS, mn.REQ_END_TS)
NUMERIC_REQUEST_COLUMNS = (mn.REQ_SCHEDULED_TS, mn.REQ_SENT_TS, mn.REQ_FIRST_TOKEN_TS,
                           mn.REQ_END_TS, mn.REQ_TTFT_MS, mn.REQ_TPOT_MS, mn.REQ_ITL_P50_MS,
                           mn.REQ_ITL_P99_MS, mn.REQ_E2E_MS, mn.REQ_OUTPUT_TOKENS,
                           mn.REQ_PROMPT_TOKENS)


class ResultsError(ValueError):
    """The results directory is missing, empty or malformed (CLI exit code 2)."""


@dataclass(frozen=True)
class Run:
    """One run directory: its request rows, its step log (may be empty) and manifest."""

    run_id: str
    path: Path
    requests: pd.DataFrame
    steps: pd.DataFrame
    manifest: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Results:
    """Every run found under a results directory, plus the concatenated tables."""

    root: Path
    runs: tuple[Run, ...]
    requests: pd.DataFrame  # all runs' request rows, column run_id set
    steps: pd.DataFrame     # all runs' step rows, column run_id added; may be empty

    @property
    def manifest_config(self) -> dict:
        """The first run manifest's ``config`` (runs in one directory share a config)."""
        for run in self.runs:
            if run.manifest.get("config"):
                return run.manifest["config"]
        return {}


def find_run_dirs(root: Path) -> list[Path]:
    """Directories under (or equal to) ``root`` holding ``requests.parquet``, sorted."""
    if (root / REQUESTS_FILE).is_file():
        return [root]
    return sorted(p.parent for p in root.rglob(REQUESTS_FILE))


def _normalise_requests(df: pd.DataFrame, run_id: str, path: Path) -> pd.DataFrame:
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ResultsError(
            f"{path / REQUESTS_FILE}: missing required columns {missing}; expected the "
            f"load generator's columns (configs/metric_names.py REQ_*). Re-run the load "
            f"generator or fix the writer.")
    df = df.copy()
    if mn.REQ_RUN_ID not in df.columns:
        df[mn.REQ_RUN_ID] = run_id
    df[mn.REQ_RUN_ID] = df[mn.REQ_RUN_ID].fillna(run_id).astype(str)
    for col in NUMERIC_REQUEST_COLUMNS + SPEC_NUMERIC_COLUMNS:
        df[col] = pd.to_numeric(df[col], errors="coerce") if col in df.columns else np.nan
    for col in LIST_COLUMNS:
        if col not in df.columns:
            df[col] = None
    for col, default in ((mn.REQ_STATUS, "ok"), (mn.REQ_DATASET, "unknown"),
                         (mn.REQ_ERROR, None), (mn.REQ_PROMPT_ID, None)):
        if col not in df.columns:
            df[col] = default
    df[mn.REQ_DATASET] = df[mn.REQ_DATASET].fillna("unknown").astype(str)
    df[mn.REQ_USERS] = pd.to_numeric(df[mn.REQ_USERS]).astype(int)
    # Closed-loop generators may leave scheduled_ts empty: then the send time is
    # the schedule (no coordinated-omission correction is possible anyway).
    df[mn.REQ_SCHEDULED_TS] = df[mn.REQ_SCHEDULED_TS].fillna(df[mn.REQ_SENT_TS])
    return df


def _normalise_steps(df: pd.DataFrame, run_id: str) -> pd.DataFrame:
    df = df.copy()
    text = (mn.STEP_STRATEGY, mn.STEP_MODEL, mn.STEP_REPLICA)
    for col in mn.STEP_LOG_COLUMNS:
        if col not in df.columns:
            df[col] = np.nan if col not in text else "unknown"
    if (df[mn.STEP_MODEL] == "unknown").all():  # logs from before rows carried the served name
        df[mn.STEP_MODEL] = df[mn.STEP_STRATEGY]
    for col in mn.STEP_LOG_COLUMNS:
        if col not in text:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    df["run_id"] = run_id
    return df


def load_run(path: Path) -> Run:
    """Read one run directory. Raises ``ResultsError`` when requests.parquet is absent."""
    path = Path(path)
    req_path = path / REQUESTS_FILE
    if not req_path.is_file():
        raise ResultsError(f"{path}: no {REQUESTS_FILE}; expected a run directory written "
                           f"by `python -m loadgen`.")
    manifest: dict = {}
    if (path / MANIFEST_FILE).is_file():
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    raw = pd.read_parquet(req_path)
    run_id = str(manifest.get("run_id") or
                 (raw[mn.REQ_RUN_ID].dropna().iloc[0] if mn.REQ_RUN_ID in raw.columns
                  and raw[mn.REQ_RUN_ID].notna().any() else path.name))
    requests = _normalise_requests(raw, run_id, path)
    steps_path = path / STEPS_FILE
    steps = (_normalise_steps(pd.read_parquet(steps_path), run_id) if steps_path.is_file()
             else _normalise_steps(pd.DataFrame(columns=list(mn.STEP_LOG_COLUMNS)), run_id))
    return Run(run_id=run_id, path=path, requests=requests, steps=steps, manifest=manifest)


def load_results(root: str | Path) -> Results:
    """Load every run under ``root`` (a run directory or a parent of several).

    Raises ``ResultsError`` with a message naming the directory when it does not
    exist, holds no run, or every run is empty.
    """
    root = Path(root)
    if not root.exists():
        raise ResultsError(f"results directory {root} does not exist; pass the directory "
                           f"`python -m loadgen` wrote (it holds {REQUESTS_FILE}).")
    if not root.is_dir():
        raise ResultsError(f"{root} is not a directory; pass a run directory or a parent "
                           f"of run directories.")
    dirs = find_run_dirs(root)
    if not dirs:
        raise ResultsError(f"results directory {root} holds no {REQUESTS_FILE}; run "
                           f"`python -m loadgen` first or point at its output directory.")
    runs = tuple(load_run(d) for d in dirs)
    requests = pd.concat([r.requests for r in runs], ignore_index=True)
    if requests.empty:
        raise ResultsError(f"results directory {root}: every {REQUESTS_FILE} is empty "
                           f"(0 requests); the load run produced no rows.")
    non_empty = [r.steps for r in runs if not r.steps.empty]
    steps = (pd.concat(non_empty, ignore_index=True) if non_empty
             else runs[0].steps.iloc[0:0].copy())
    return Results(root=root, runs=runs, requests=requests, steps=steps)
