"""Run directory output: per-cell request files, ``requests.parquet``, ``steps.parquet``, ``manifest.json``.

Request rows are written by a separate *writer process* (``python -m
loadgen.results.writer RUN_DIR``, started by ``RowSink``), never in the Locust
process: converting rows to Arrow blocks for 100+ ms at a time and would
delay every in-flight chunk's timestamp in the gevent loop. The driver only
writes each row as one JSON line to the writer's stdin, as the row completes.

The writer keeps one file per cell, ``cells/<NNN>-<strategy>-<tier>-<output>.parquet``,
and every ``flush_every_s`` (1 s) rewrites it atomically (temp file + ``os.replace``)
with one more row group: the file is a complete, readable Parquet file at
every instant, so a ``kill -9`` of the load generator (and of the writer with
it) loses at most the last second of rows. At each cell end and when its stdin
closes (the driver exited, however it exited) the writer also merges every cell
file into ``requests.parquet``. The writer runs in its own session, so a Ctrl-C
or a kill of the driver's process group leaves it to finish the files.
Rows are never dropped: failures carry a status. Both Parquet files follow
``configs.results_schema`` (columns, types, units; ``schema_version`` in the
file metadata).
"""

from __future__ import annotations

import json
import os
import platform
import queue
import socket
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from configs import results_schema as S
from configs.jsonio import write_json
from configs.paths import REPO_ROOT
from configs.results_schema import RequestRow

REQUEST_SCHEMA = S.arrow_schema(S.REQUEST_COLUMNS)   # columns, types, units: configs/results_schema.py
STEP_SCHEMA = S.arrow_schema(S.STEP_COLUMNS)
SERVER_METRICS_SCHEMA = S.arrow_schema(S.SERVER_METRIC_COLUMNS)
SERVER_METRICS_FILE = "server_metrics.parquet"


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

    def add(self, row: RequestRow) -> None:
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


CELLS_DIR = "cells"
REQUESTS_FILE = "requests.parquet"


def _atomic_parquet(path: Path, tables: list[pa.Table]) -> None:
    """Write ``tables`` as row groups of one Parquet file, atomically (readable at every instant)."""
    tmp = Path(str(path) + ".tmp")
    with pq.ParquetWriter(tmp, REQUEST_SCHEMA) as w:
        for t in tables:
            w.write_table(t)
    os.replace(tmp, path)


def cell_files(run_dir: Path) -> list[Path]:
    """The run's per-cell request files, in cell order (their ``NNN-`` prefix)."""
    d = Path(run_dir) / CELLS_DIR
    return sorted(d.glob("*.parquet")) if d.is_dir() else []


def merge_cells(run_dir: Path) -> int:
    """Concatenate every cell file into ``requests.parquet`` (atomically); returns rows."""
    # ParquetFile.read, single-threaded: pq.read_table's dataset path was seen to hang here
    tables = [pq.ParquetFile(p).read(use_threads=False) for p in cell_files(run_dir)]
    _atomic_parquet(Path(run_dir) / REQUESTS_FILE, [t for t in tables if t.num_rows])
    return sum(t.num_rows for t in tables)


class CellFileWriter:
    """Inside the writer process: the current cell's file, rewritten with a new row group per flush.

    ``max_row_groups`` bounds the row groups per file (older ones are merged into one),
    so a long cell still has a small footer.
    """

    def __init__(self, run_dir: Path, flush_every_s: float = 1.0, max_row_groups: int = 64) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / CELLS_DIR).mkdir(parents=True, exist_ok=True)
        self.flush_every_s = flush_every_s
        self.max_row_groups = max_row_groups
        self.path: Path | None = None
        self._groups: list[pa.Table] = []
        self._buf: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self.rows_written = 0

    def start_cell(self, name: str) -> None:
        self.end_cell()
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        self.path = self.run_dir / CELLS_DIR / f"{safe}.parquet"
        self._groups = []
        _atomic_parquet(self.path, [])

    def add(self, row: RequestRow) -> None:
        self._buf.append(S.coerce_row(S.REQUEST_COLUMNS, row))

    def due(self) -> bool:
        return bool(self._buf) and time.monotonic() - self._last_flush >= self.flush_every_s

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._buf:
            return
        if self.path is None:  # rows before any cell: keep them in a file of their own
            self.start_cell("000-unlabelled")
        self._groups.append(pa.Table.from_pylist(self._buf, schema=REQUEST_SCHEMA))
        if len(self._groups) > self.max_row_groups:
            self._groups = [pa.concat_tables(self._groups[:-1]).combine_chunks(), self._groups[-1]]
        _atomic_parquet(self.path, self._groups)
        self.rows_written += len(self._buf)
        self._buf = []

    def end_cell(self) -> None:
        self.flush()
        if self.path is not None:
            merge_cells(self.run_dir)
        self.path = None
        self._groups = []


def writer_main(run_dir: str, flush_every_s: float = 1.0) -> int:
    """The writer process: JSON lines on stdin -> cell files; prints ``ROWS <n>`` on exit.

    Lines: ``{"cell": name}`` starts a cell file, ``{"row": {...}}`` adds a row,
    ``{"end_cell": true}`` flushes it and refreshes ``requests.parquet``. EOF ends.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the driver decides when we stop (stdin EOF)
    w = CellFileWriter(Path(run_dir), flush_every_s)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    # warm up every lazy import (pyarrow's pandas shim among them) now, while the first cell
    # starts, not at the first flush or at exit (seconds on a loaded machine)
    warm = pa.Table.from_pylist([S.coerce_row(S.REQUEST_COLUMNS, {})], schema=REQUEST_SCHEMA)
    _atomic_parquet(Path(run_dir) / REQUESTS_FILE, [warm.slice(0, 0)])
    pq.ParquetFile(Path(run_dir) / REQUESTS_FILE).read(use_threads=False)
    while True:
        try:
            line = lines.get(timeout=max(0.05, flush_every_s / 4))
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line.strip():
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the driver's death
                msg = {}
            if "row" in msg:
                w.add(msg["row"])
            elif "cell" in msg:
                w.start_cell(str(msg["cell"]))
            elif msg.get("end_cell"):
                w.end_cell()
        if w.due():
            w.flush()
    w.flush()
    merge_cells(Path(run_dir))
    print(f"ROWS {w.rows_written}", flush=True)
    return 0


def _close_fd(fd: int) -> None:
    """Close ``fd`` now. gevent (>= 25.8) monkey-patches ``os.close`` into a deferred close that
    was seen never to close a pipe here, so the writer never saw EOF; ``closerange`` is not patched."""
    os.closerange(fd, fd + 1)


class RowSink:
    """Driver side of the writer process: ``add(row)`` writes one JSON line (cheap, non-blocking
    under gevent); ``start_cell`` / ``end_cell`` mark cells; ``close`` waits for the files.

    ``pid`` is the writer process (recorded in the manifest).
    """

    def __init__(self, run_dir: Path, flush_every_s: float = 1.0) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        self.run_dir = Path(run_dir)
        # A plain blocking pipe written with os.write: never a greenlet switch (gevent's
        # cooperative pipe objects may yield inside a killed user's cancel handler, and
        # the cancelled row would then arrive after the cell was closed).
        r, self._fd = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "loadgen.results.writer", str(run_dir), "--flush-every-s", str(flush_every_s)],
                stdin=r, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        finally:
            _close_fd(r)
        self.pid = self._proc.pid
        self.rows_sent = 0
        self.rows_written = 0

    def _send(self, msg: dict[str, Any]) -> None:
        if self._fd < 0:
            return
        data = (json.dumps(msg, default=str) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError:   # the writer died: nothing more can be kept
            _close_fd(self._fd)
            self._fd = -1

    def start_cell(self, name: str) -> None:
        self._send({"cell": name})

    def add(self, row: RequestRow) -> None:
        self.rows_sent += 1
        self._send({"row": row})

    def end_cell(self) -> None:
        self._send({"end_cell": True})

    def close(self, timeout_s: float = 120.0) -> int:
        """Close the pipe, wait for the writer; returns rows written (safe to call twice)."""
        if self._fd >= 0:
            _close_fd(self._fd)
            self._fd = -1
            try:
                out, _ = self._proc.communicate(timeout=timeout_s)
                last = [ln for ln in (out or "").splitlines() if ln.startswith("ROWS ")]
                self.rows_written = int(last[-1].split()[1]) if last else self.rows_sent
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self.rows_written = self.rows_sent
        return self.rows_written


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


def write_server_metrics(path: Path, rows: list[dict[str, Any]]) -> int:
    """Write the target's sampled Prometheus series (``SERVER_METRICS_SCHEMA``,
    ``loadgen.run.server_metrics.RunServerMetrics.rows``) atomically; returns rows written
    (0: nothing written)."""
    if not rows:
        return 0
    tmp = Path(str(path) + ".tmp")
    table = pa.Table.from_pylist([S.coerce_row(S.SERVER_METRIC_COLUMNS, r) for r in rows],
                                 schema=SERVER_METRICS_SCHEMA)
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
    """Package versions, git sha, machine facts and the engine kernels' build status
    (``actors.engine.kernel_build.build_status``) for the manifest."""
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
    from actors.engine.kernel_build import build_status

    # the engine's C kernels as last built on this machine (or their absence and the
    # fallback that ran instead): what the embedded engines of a local run used
    return {"versions": versions, "git": _git_sha(REPO_ROOT), "machine": machine,
            "kernels": build_status()}


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Atomic strict-JSON write (os.replace), so a Ctrl-C never leaves half a manifest.

    Undefined numbers (NaN) are written as ``null``: the file parses with any
    strict JSON reader (configs.jsonio).
    """
    write_json(path, manifest)


if __name__ == "__main__":
    import argparse

    _ap = argparse.ArgumentParser(description="specload request writer process (started by RowSink)")
    _ap.add_argument("run_dir")
    _ap.add_argument("--flush-every-s", type=float, default=1.0)
    _a = _ap.parse_args()
    sys.exit(writer_main(_a.run_dir, _a.flush_every_s))
