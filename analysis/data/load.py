"""Load the load generator's results: ``requests.parquet``, ``steps.parquet`` and
``manifest.json`` from one run directory or from a parent of several.

A run directory is any directory that holds ``requests.parquet`` or per-cell files
``cells/*.parquet`` (the load generator's writer keeps every cell file readable
while the cell runs and merges them into ``requests.parquet``; after a ``kill -9``
the cell files hold rows up to the last second, so they are read when present).
Columns the
server did not report (third-party engines report no speculative statistics
and write no step log) are added as missing values, so every later stage can
rely on the full column set of ``configs.results_schema``. A file written
with a newer ``schema_version`` than this reader knows is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.data.dimensions import add_dimensions, profile_sampling
from configs import metric_names as mn
from configs import results_schema as S

REQUESTS_FILE = "requests.parquet"
STEPS_FILE = "steps.parquet"
MANIFEST_FILE = "manifest.json"
CELLS_DIR = "cells"

# Columns and types come from configs/results_schema.py (the writer's schema too).
REQUIRED_COLUMNS = S.required(S.REQUEST_COLUMNS)
NUMERIC_REQUEST_COLUMNS = S.numeric(S.REQUEST_COLUMNS)
LIST_COLUMNS = tuple(c.name for c in S.REQUEST_COLUMNS if c.type.startswith("list"))
# In the analysis frames, a step's ``strategy`` is its deployment's served name (the
# key request rows carry); the engine's strategy id moves to ``proposer``.
STEP_PROPOSER = "proposer"


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
    if (root / REQUESTS_FILE).is_file() or _cell_files(root):
        return [root]
    found = {p.parent for p in root.rglob(REQUESTS_FILE)}
    found |= {p.parent.parent for p in root.rglob(f"{CELLS_DIR}/*.parquet")}
    return sorted(found)


def _cell_files(path: Path) -> list[Path]:
    d = path / CELLS_DIR
    return sorted(d.glob("*.parquet")) if d.is_dir() else []


def read_requests(path: Path) -> pd.DataFrame:
    """A run's request rows: its cell files when present (complete even after a kill), else
    ``requests.parquet``."""
    cells = _cell_files(path)
    if cells:
        frames = [read_results_parquet(p) for p in cells]
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else read_results_parquet(cells[0])
    return read_results_parquet(path / REQUESTS_FILE)


def _check_version(path: Path, version: int | None) -> None:
    if version is not None and version > S.SCHEMA_VERSION:
        raise ResultsError(f"{path}: results schema_version {version} is newer than this "
                           f"analysis reads ({S.SCHEMA_VERSION}); upgrade specload.")


def read_results_parquet(path: Path) -> pd.DataFrame:
    """A Parquet file as a DataFrame; raises ResultsError for a newer schema_version."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    _check_version(path, S.file_version(table.schema.metadata))
    return table.to_pandas()


def _normalise_requests(df: pd.DataFrame, run_id: str, path: Path) -> pd.DataFrame:
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ResultsError(
            f"{path / REQUESTS_FILE}: missing required columns {missing}; expected the "
            f"load generator's columns (configs/results_schema.py). Re-run the load "
            f"generator or fix the writer.")
    df = df.copy()
    if mn.REQ_RUN_ID not in df.columns:
        df[mn.REQ_RUN_ID] = run_id
    df[mn.REQ_RUN_ID] = df[mn.REQ_RUN_ID].fillna(run_id).astype(str)
    for col in NUMERIC_REQUEST_COLUMNS:
        df[col] = pd.to_numeric(df[col], errors="coerce") if col in df.columns else np.nan
    for col in LIST_COLUMNS:
        if col not in df.columns:
            df[col] = None
    df[mn.REQ_RETRIES] = (pd.to_numeric(df[mn.REQ_RETRIES], errors="coerce").fillna(0).astype(int)
                          if mn.REQ_RETRIES in df.columns else 0)
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


def requests_frame(rows: list[dict], run_id: str) -> pd.DataFrame:
    """Request rows as the load generator holds them (dicts) -> the frame ``load_run`` gives
    for the same rows once written (the racing loop decides on what the report will read).
    Raises ResultsError as ``load_run`` does for rows without the required columns."""
    return _normalise_requests(pd.DataFrame(rows), run_id, Path("<in memory>"))


def _normalise_steps(df: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """Step rows with every engine column, keyed for the join with request rows.

    ``strategy`` becomes the served model name (``model``; logs written before
    rows carried it fall back to the engine's id) and the engine's strategy id
    is kept in ``proposer``: requests and steps of one deployment then share
    ``strategy``, even when its name is not its strategy id.
    """
    df = df.copy()
    text = (mn.STEP_STRATEGY, mn.STEP_MODEL, mn.STEP_REPLICA)
    for col in S.names(S.ENGINE_STEP_COLUMNS):
        if col not in df.columns:
            df[col] = np.nan if col not in text else None
    df[mn.STEP_STRATEGY] = df[mn.STEP_STRATEGY].fillna("unknown").astype(str)
    df[mn.STEP_REPLICA] = df[mn.STEP_REPLICA].fillna("unknown").astype(str)
    df[mn.STEP_MODEL] = df[mn.STEP_MODEL].fillna(df[mn.STEP_STRATEGY]).astype(str)
    for col in S.numeric(S.ENGINE_STEP_COLUMNS):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    df[STEP_PROPOSER] = df[mn.STEP_STRATEGY]
    df[mn.STEP_STRATEGY] = df[mn.STEP_MODEL]
    df["run_id"] = run_id
    return df


def load_run(path: Path) -> Run:
    """Read one run directory. Raises ``ResultsError`` when requests.parquet is absent."""
    path = Path(path)
    req_path = path / REQUESTS_FILE
    if not req_path.is_file() and not _cell_files(path):
        raise ResultsError(f"{path}: no {REQUESTS_FILE}; expected a run directory written "
                           f"by `python -m loadgen`.")
    manifest: dict = {}
    if (path / MANIFEST_FILE).is_file():
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    _check_version(path / MANIFEST_FILE, manifest.get("schema_version"))
    raw = read_requests(path)
    run_id = str(manifest.get("run_id") or
                 (raw[mn.REQ_RUN_ID].dropna().iloc[0] if mn.REQ_RUN_ID in raw.columns
                  and raw[mn.REQ_RUN_ID].notna().any() else path.name))
    requests = add_dimensions(_normalise_requests(raw, run_id, path), manifest)
    steps_path = path / STEPS_FILE
    steps = (_normalise_steps(read_results_parquet(steps_path), run_id) if steps_path.is_file()
             else _normalise_steps(pd.DataFrame(columns=list(mn.STEP_LOG_COLUMNS)), run_id))
    if mn.REQ_SAMPLING not in steps.columns:   # runs before schema 4: the profile's one setting
        steps[mn.REQ_SAMPLING] = None
    in_cell = (steps[mn.REQ_TIER].notna() if mn.REQ_TIER in steps.columns
               else pd.Series(False, index=steps.index))
    steps.loc[in_cell & steps[mn.REQ_SAMPLING].isna(), mn.REQ_SAMPLING] = profile_sampling(manifest)[0]
    return Run(run_id=run_id, path=path, requests=requests, steps=steps, manifest=manifest)


def check_results_dir(root: str | Path) -> list[Path]:
    """The run directories under ``root`` (``find_run_dirs``); a CLI checks this first.

    Raises ``ResultsError`` naming ``root`` when it does not exist, is not a
    directory or holds no run."""
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
    return dirs


def load_results(root: str | Path) -> Results:
    """Load every run under ``root`` (a run directory or a parent of several).

    Raises ``ResultsError`` with a message naming the directory when it does not
    exist, holds no run, or every run is empty.
    """
    root = Path(root)
    dirs = check_results_dir(root)
    runs = tuple(load_run(d) for d in dirs)
    requests = pd.concat([r.requests for r in runs], ignore_index=True)
    if requests.empty:
        raise ResultsError(f"results directory {root}: every {REQUESTS_FILE} is empty "
                           f"(0 requests); the load run produced no rows.")
    non_empty = [r.steps for r in runs if not r.steps.empty]
    steps = (pd.concat(non_empty, ignore_index=True) if non_empty
             else runs[0].steps.iloc[0:0].copy())
    return Results(root=root, runs=runs, requests=requests, steps=steps)
