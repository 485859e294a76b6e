"""Run directory output: ``requests.parquet`` (incremental), ``steps.parquet``, ``manifest.json``.

``requests.parquet`` is written by a pyarrow ParquetWriter; the driver flushes
buffered rows as a row group at every cell end (not while load is offered:
converting rows blocks the gevent loop and would skew in-flight timestamps),
and the writer is closed (footer written) on normal exit, Ctrl-C and SIGTERM,
so the file is always readable after the process ends and holds every
finished request. Only a hard kill (SIGKILL) loses the current cell's rows.
Rows are never dropped: failures carry a status. Both Parquet files follow
``configs.results_schema`` (columns, types, units; ``schema_version`` in the
file metadata).
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

from configs import results_schema as S
from configs.jsonio import write_json
from configs.paths import REPO_ROOT

REQUEST_SCHEMA = S.arrow_schema(S.REQUEST_COLUMNS)   # columns, types, units: configs/results_schema.py
STEP_SCHEMA = S.arrow_schema(S.STEP_COLUMNS)


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
        self._buf.append(S.coerce_row(S.REQUEST_COLUMNS, row))

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
    """Write the engine step rows (``STEP_SCHEMA``: the engine's columns plus the cell
    labels) atomically; keys outside the schema are dropped. Returns rows written."""
    if not rows:
        return 0
    tmp = Path(str(path) + ".tmp")
    table = pa.Table.from_pylist([S.coerce_row(S.STEP_COLUMNS, r) for r in rows], schema=STEP_SCHEMA)
    pq.write_table(table, tmp)
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
