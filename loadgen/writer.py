"""Run directory output: ``requests.parquet`` (incremental), ``steps.parquet``, ``manifest.json``.

``requests.parquet`` is written by a pyarrow ParquetWriter; the driver flushes
buffered rows as a row group at every cell end (not while load is offered:
converting rows blocks the gevent loop and would skew in-flight timestamps),
and the writer is closed (footer written) on normal exit, Ctrl-C and SIGTERM,
so the file is always readable after the process ends and holds every
finished request. Only a hard kill (SIGKILL) loses the current cell's rows.
Rows are never dropped: failures carry a status.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from configs import metric_names as M
from configs.jsonio import write_json
from configs.paths import REPO_ROOT

REQUEST_SCHEMA = pa.schema([
    (M.REQ_RUN_ID, pa.string()), (M.REQ_STRATEGY, pa.string()), (M.REQ_TIER, pa.string()),
    (M.REQ_OUTPUT_CLASS, pa.string()), (M.REQ_DATASET, pa.string()), (M.REQ_PROMPT_ID, pa.string()),
    (M.REQ_USERS, pa.int32()), (M.REQ_ARRIVAL, pa.string()), (M.REQ_RATE_RPS, pa.float64()),
    (M.REQ_REQUEST_INDEX, pa.int64()), (M.REQ_MAX_TOKENS, pa.int32()),
    (M.REQ_SCHEDULED_TS, pa.float64()), (M.REQ_SENT_TS, pa.float64()), (M.REQ_FIRST_TOKEN_TS, pa.float64()),
    (M.REQ_END_TS, pa.float64()),
    (M.REQ_TTFT_MS, pa.float64()), (M.REQ_TPOT_MS, pa.float64()), (M.REQ_ITL_P50_MS, pa.float64()),
    (M.REQ_ITL_P99_MS, pa.float64()), (M.REQ_E2E_MS, pa.float64()),
    (M.REQ_OUTPUT_TOKENS, pa.int64()), (M.REQ_PROMPT_TOKENS, pa.int64()), (M.REQ_NUM_CHUNKS, pa.int32()),
    (M.REQ_FINISH_REASON, pa.string()), (M.REQ_STATUS, pa.string()), (M.REQ_ERROR, pa.string()),
    (M.NUM_DRAFTS, pa.int64()), (M.NUM_DRAFT_TOKENS, pa.int64()), (M.NUM_ACCEPTED_TOKENS, pa.int64()),
    (M.NUM_ACCEPTED_TOKENS_PER_POS, pa.list_(pa.int64())), (M.ACCEPTANCE_LENGTH, pa.float64()),
    (M.DRAFT_MS, pa.float64()), (M.VERIFY_MS, pa.float64()), (M.QUEUE_MS, pa.float64()),
    (M.REQ_REPEAT, pa.int32()),
])


def _coerce(row: dict[str, Any]) -> dict[str, Any]:
    """Fit a row to REQUEST_SCHEMA: missing -> null, NaN -> null, wrong types -> null/str."""
    out: dict[str, Any] = {}
    for f in REQUEST_SCHEMA:
        v = row.get(f.name)
        if v is None or (isinstance(v, float) and v != v):
            out[f.name] = None
        elif pa.types.is_integer(f.type):
            out[f.name] = int(v) if isinstance(v, (int, float)) else None
        elif pa.types.is_floating(f.type):
            out[f.name] = float(v) if isinstance(v, (int, float)) else None
        elif pa.types.is_list(f.type):
            out[f.name] = [int(x) for x in v] if isinstance(v, (list, tuple)) else None
        else:
            out[f.name] = str(v)
    return out


class RequestWriter:
    """Incremental ``requests.parquet``; ``add`` is cheap, ``flush`` writes a row group."""

    def __init__(self, path: Path, flush_rows: int = 2000, flush_every_s: float = 10.0) -> None:
        self.path = Path(path)
        self.flush_rows = flush_rows
        self.flush_every_s = flush_every_s
        self._buf: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(self.path, REQUEST_SCHEMA)
        self._last_flush = time.monotonic()
        self.rows_written = 0

    def add(self, row: dict[str, Any]) -> None:
        self._buf.append(_coerce(row))

    def maybe_flush(self) -> None:
        """Flush when the buffer or its age passed its limit (call from the driver loop)."""
        if len(self._buf) >= self.flush_rows or (
                self._buf and time.monotonic() - self._last_flush >= self.flush_every_s):
            self.flush()

    def flush(self) -> None:
        if self._writer is None or not self._buf:
            return
        table = pa.Table.from_pylist(self._buf, schema=REQUEST_SCHEMA)
        self._writer.write_table(table)
        self.rows_written += len(self._buf)
        self._buf = []
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Flush and write the footer; safe to call twice."""
        if self._writer is None:
            return
        try:
            self.flush()
        finally:
            self._writer.close()
            self._writer = None


def write_steps(path: Path, rows: list[dict[str, Any]]) -> int:
    """Write the engine step rows (STEP_* columns, as the server sent them) atomically; returns rows."""
    if not rows:
        return 0
    tmp = Path(str(path) + ".tmp")
    columns: dict[str, None] = {}
    for r in rows:  # union of keys, first-seen order (from_pylist alone infers from row 0)
        columns.update(dict.fromkeys(r))
    pq.write_table(pa.Table.from_pydict({c: [r.get(c) for r in rows] for c in columns}), tmp)
    os.replace(tmp, path)
    return len(rows)


def _git_sha(repo: Path) -> dict[str, Any]:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": dirty}


def environment_info() -> dict[str, Any]:
    """Package versions, git sha and machine facts for the manifest."""
    versions = {}
    for pkg in ("locust", "gevent", "geventhttpclient", "ray", "pyarrow", "pandas", "pydantic", "rich",
                "psutil", "torch", "specload"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    machine: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                               "machine": platform.machine(), "cpu_count": os.cpu_count(),
                               "python": sys.version.split()[0]}
    try:
        import psutil
        machine["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return {"versions": versions, "git": _git_sha(REPO_ROOT), "machine": machine}


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Atomic strict-JSON write (os.replace), so a Ctrl-C never leaves half a manifest.

    Undefined numbers (NaN) are written as ``null``: the file parses with any
    strict JSON reader (configs.jsonio).
    """
    write_json(path, manifest)
