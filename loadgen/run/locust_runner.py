"""Drive Locust from Python: one Environment for the run, one cell at a time.

``--workers 0``: a LocalRunner; users live in this process. ``--workers N``: a
MasterRunner here, N ``locust --worker`` processes hosted by Ray actors (started
through ``loadgen.run.ray_workers`` in a separate process, so Ray never shares a
process with gevent's monkey-patching). Workers receive each cell's plan as a
custom message and stream rows back; the master drains on their in-flight
counts before stopping the cell.

A worker whose Ray actor died (the helper's ``LOST <i>`` line: Ray reported the
actor dead) or that stops sending heartbeats (marked missing by Locust after
about 4 s) is lost; the runner then records a loss in
``worker_losses`` (worker index, pids, when, its last reported in-flight count
= requests lost without a row, rows it had delivered, which are all kept), stops
waiting for it in the drain, and later cells split the requests over the live
workers only.

Imports locust: only the ``python -m loadgen`` process imports this module.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import gevent
import psutil
from locust.env import Environment

from configs import metric_names as M
from configs.net import LOOPBACK, free_port
from loadgen.run.cells import CellPlan
from loadgen.run.users import CELL_MESSAGE, ROWS_MESSAGE, CellContext, CompletionUser

log = logging.getLogger("loadgen")


@dataclass
class CellRun:
    """What one cell produced: its rows, the measurement window and CPU samples (% of one core)."""

    rows: list[dict[str, Any]]
    window: tuple[float, float]        # unix s: spawn complete (or start) .. deadline
    cpu_samples: list[float] = field(default_factory=list)
    interrupted: bool = False
    # --workers N: per Locust worker {worker_index, client_id, ray_node_id, cpu_percent_mean,
    # cpu_percent_max (its own heartbeat: % of one core), users_max, users_last, rows, lost}
    workers: list[dict[str, Any]] = field(default_factory=list)


class LoadRunner:
    """Owns the Locust environment (and the Ray worker helper) for a whole run."""

    def __init__(self, n_workers: int = 0, on_row: Callable[[dict[str, Any]], None] | None = None,
                 worker_start_timeout_s: float = 300.0, should_stop: Callable[[], bool] = lambda: False,
                 ray_address: str = "", worker_placement: str = "spread") -> None:
        self.n_workers = n_workers
        self.worker_placement = worker_placement   # loadgen.run.ray_workers --placement
        self._node_by_worker: dict[int, str] = {}  # Locust worker index -> Ray node id (its rows say)
        self._worker_samples: dict[str, dict[str, list]] = {}   # client id -> {"cpu": [...], "users": [...]}
        self.should_stop = should_stop
        self.ray_address = ray_address
        self.on_row = on_row or (lambda r: None)
        self.env = Environment(user_classes=[CompletionUser], events=None)
        self._cell_rows: list[dict[str, Any]] = []
        self.cell_ok = 0
        self._cell_id = ""
        self._worker_inflight: dict[int, tuple[float, int]] = {}
        self._helper: subprocess.Popen | None = None
        self.worker_info: list[dict[str, Any]] = []       # per worker: index, actor_pid, locust_pid, node_ip
        self.worker_losses: list[dict[str, Any]] = []
        self._rows_by_worker: dict[int, int] = {}
        self._rows_at_start: dict[int, int] = {}
        self._lost: set[str] = set()
        self._last_beat: dict[str, float] = {}   # client id -> when the master last heard its heartbeat
        self._actors_lost: set[int] = set()       # Ray actor indices the helper reported dead (LOST <i>)
        self._helper_round_ts: float | None = None  # when the helper's newest liveness round began
        self._client_by_pid: dict[int, str] = {}  # locust --worker pid -> Locust client id (from its rows)
        self._helper_ready = False
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        if n_workers <= 0:
            self.runner = self.env.create_local_runner()
        else:
            port = free_port()
            # workers of a private, single-node Ray dial 127.0.0.1; a cluster's from other hosts
            bind = "*" if self.ray_address else LOOPBACK
            self.runner = self.env.create_master_runner(master_bind_host=bind, master_bind_port=port)
            self.runner.register_message(ROWS_MESSAGE, self._on_rows)
            self.env.events.heartbeat_sent.add_listener(self._on_heartbeat)
            self._start_workers(port, worker_start_timeout_s)
        self._spawned_at: float | None = None
        self.env.events.spawning_complete.add_listener(lambda user_count, **_: self._mark_spawned())

    def _mark_spawned(self) -> None:
        self._spawned_at = time.time()

    # --- distributed ---------------------------------------------------------
    def _start_workers(self, port: int, timeout_s: float) -> None:
        cmd = [sys.executable, "-m", "loadgen.run.ray_workers", "--n", str(self.n_workers), "--master-port", str(port)]
        if self.ray_address:
            cmd += ["--address", self.ray_address]
        cmd += ["--placement", self.worker_placement]
        self._helper = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        gevent.spawn(self._read_helper)
        deadline = time.time() + timeout_s
        while self.runner.worker_count < self.n_workers or not self._helper_ready:
            if self._helper.poll() is not None:
                out = self._helper.stdout.read() if self._helper.stdout else ""
                raise RuntimeError(f"Ray worker helper exited ({self._helper.returncode}) with "
                                   f"{self.runner.worker_count}/{self.n_workers} workers connected: {out[-500:]}")
            if time.time() > deadline:
                raise RuntimeError(f"only {self.runner.worker_count}/{self.n_workers} Locust workers connected "
                                   f"within {timeout_s:g} s (Ray could not place the actors, or the master port "
                                   f"{port} is unreachable from the worker nodes)")
            if self.should_stop():
                raise KeyboardInterrupt("stopped while waiting for workers")
            gevent.sleep(0.5)

    def _read_helper(self) -> None:
        """Collect the helper's ``WORKER i actor_pid locust_pid ip`` and ``READY`` lines."""
        out = self._helper.stdout if self._helper else None
        if out is None:
            return
        for line in out:
            parts = line.split()
            if parts[:1] == ["WORKER"] and len(parts) >= 5:
                self.worker_info.append({"actor": int(parts[1]), "actor_pid": int(parts[2]),
                                         "locust_pid": int(parts[3]), "node_ip": parts[4],
                                         "ray_node_id": parts[5] if len(parts) > 5 else None})
            elif parts[:1] == ["READY"]:
                self._helper_ready = True
            elif parts[:1] == ["LOST"] and len(parts) >= 2:
                self._actors_lost.add(int(parts[1]))
            elif parts[:1] == ["ROUND"] and len(parts) >= 2:
                self._helper_round_ts = float(parts[1])
            elif parts[:1] == ["ERROR"]:
                log.error("Ray worker helper: %s", line.strip())

    def _dead_by_ray(self) -> set[str]:
        """Locust client ids of the workers whose Ray actor the helper reported dead."""
        pids = {w["actor"]: w["locust_pid"] for w in self.worker_info}
        return {self._client_by_pid[pids[i]] for i in self._actors_lost
                if i in pids and pids[i] in self._client_by_pid}

    def _is_lost(self, client: Any, dead_by_ray: set[str] | None = None) -> bool:
        """True for a worker marked missing by Locust or whose actor Ray reported dead."""
        dead = self._dead_by_ray() if dead_by_ray is None else dead_by_ray
        return client.state == "missing" or client.id in dead

    def _live_indices(self) -> list[int]:
        """Locust worker indices of the workers not lost (``_is_lost``)."""
        idx = self.runner.worker_indexes
        dead = self._dead_by_ray()
        return sorted(idx[c.id] for c in self.runner.clients.values()
                      if not self._is_lost(c, dead) and c.id in idx)

    def _check_workers(self, cell_id: str) -> None:
        """Record each worker newly lost (``_is_lost``: its actor died, or no heartbeat for ~4 s)."""
        if self.n_workers <= 0:
            return
        dead = self._dead_by_ray()
        # a client Ray reports dead counts even once Locust has dropped it from its clients
        lost_now = [c.id for c in list(self.runner.clients.values()) if self._is_lost(c, dead)]
        lost_now += sorted(cid for cid in dead if cid not in lost_now)
        for cid in lost_now:
            if cid in self._lost:
                continue
            self._lost.add(cid)
            index = self.runner.worker_indexes.get(cid, -1)
            last_ts, in_flight = self._worker_inflight.get(index, (None, 0))
            loss = {"worker_index": index, "client_id": cid, "cell_id": cell_id, "lost_ts": time.time(),
                    "last_report_ts": last_ts, "in_flight_at_last_report": in_flight,
                    "rows_delivered": self._rows_by_worker.get(index, 0),
                    "live_workers": len(self._live_indices()),
                    "detected_by": "ray" if cid in dead else "heartbeat"}
            self._worker_inflight.pop(index, None)
            log.warning("load worker %d (%s) lost: %d in-flight request(s) lost, %d rows kept",
                        index, cid, in_flight, loss["rows_delivered"])
            self.worker_losses.append(loss)

    def _check_stop(self) -> None:
        if self.should_stop():
            raise KeyboardInterrupt("stop requested")

    def _on_rows(self, environment: Any, msg: Any, **_: Any) -> None:
        data = msg.data
        if data.get("pid") and getattr(msg, "node_id", None):
            self._client_by_pid[int(data["pid"])] = str(msg.node_id)
        if data.get("cell_id") != self._cell_id:
            log.warning("dropping %d late rows of cell %s", len(data.get("rows", [])), data.get("cell_id"))
            return
        worker = int(data.get("worker", -1))
        if data.get("node"):
            self._node_by_worker[worker] = str(data["node"])
        rows = data.get("rows", [])
        for row in rows:
            self._sink(row)
        self._rows_by_worker[worker] = self._rows_by_worker.get(worker, 0) + len(rows)
        if self.runner.worker_indexes and worker not in self._live_indices():
            return   # a report that raced the loss: keep its rows, not its in-flight count
        self._worker_inflight[worker] = (float(data.get("ts", 0)), int(data.get("in_flight", 0)))

    # --- one cell --------------------------------------------------------------
    def _sink(self, row: dict[str, Any]) -> None:
        self._cell_rows.append(row)
        if row.get(M.REQ_STATUS) == M.STATUS_OK:
            self.cell_ok += 1
        self.on_row(row)

    @property
    def cell_rows(self) -> int:
        """Rows received so far in the current cell (all statuses)."""
        return len(self._cell_rows)

    def in_flight(self) -> int:
        """Requests in flight right now (workers: as of their latest report)."""
        if self.n_workers <= 0:
            ctx = getattr(self.env, "specload", None)
            return ctx.in_flight if ctx else 0
        return sum(n for _, n in self._worker_inflight.values())

    def _cpu_sample(self) -> float:
        own = self._proc.cpu_percent(None)
        if self.n_workers > 0:
            dead = self._dead_by_ray()
            live = [c for c in self.runner.clients.values() if not self._is_lost(c, dead)]
            for c in live:   # per worker: its CPU (own heartbeat) and the users it runs
                smp = self._worker_samples.setdefault(str(c.id), {"cpu": [], "users": []})
                smp["cpu"].append(float(c.cpu_usage))
                smp["users"].append(int(c.user_count))
            return max([own] + [c.cpu_usage for c in live])
        return own

    def _worker_stats(self) -> list[dict[str, Any]]:
        """This cell's per-worker figures (CellRun.workers)."""
        out = []
        for cid, smp in self._worker_samples.items():
            index = self.runner.worker_indexes.get(cid, -1)
            cpu = smp["cpu"] or [0.0]
            out.append({"worker_index": index, "client_id": cid,
                        "ray_node_id": self._node_by_worker.get(index),
                        "cpu_percent_mean": round(sum(cpu) / len(cpu), 1), "cpu_percent_max": round(max(cpu), 1),
                        "users_max": max(smp["users"] or [0]),
                        "users_last": smp["users"][-1] if smp["users"] else 0,
                        "rows": self._rows_by_worker.get(index, 0) - self._rows_at_start.get(index, 0),
                        "lost": cid in self._lost})
        return sorted(out, key=lambda w: w["worker_index"])

    def run_cell(self, plan: CellPlan, spawn_rate: float, drain_timeout_s: float,
                 tick: Callable[[float, "LoadRunner"], None] | None = None) -> CellRun:
        """Run one cell: spawn ``plan.users``, offer load until ``plan.deadline_ts``, drain, stop.

        ``tick(now, self)`` is called about twice a second (progress display).
        Rows reach ``on_row`` as they complete. KeyboardInterrupt stops the cell
        (in-flight requests become ``cancelled`` rows) and is re-raised, as is a
        ``should_stop()`` that turned True (the CLI's SIGINT/SIGTERM flag).
        """
        self._begin_cell(plan)
        cpu: list[float] = []
        start = time.time()
        self._proc.cpu_percent(None)
        interrupted = False
        try:
            self.runner.start(plan.users, spawn_rate=spawn_rate)
            while (now := time.time()) < plan.deadline_ts:
                gevent.sleep(min(0.5, max(0.0, plan.deadline_ts - now)))
                cpu.append(self._cpu_sample())
                self._check_workers(plan.cell_id)
                self._check_stop()
                if tick:
                    tick(time.time(), self)
            self._drain(plan, drain_timeout_s, tick)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            self._stop_cell()
        # measure concurrency once every user is up (ramp excluded) and the cell has started
        window_start = max(self._spawned_at or start, plan.start_ts)
        if window_start >= plan.deadline_ts:
            window_start = max(start, plan.start_ts)
        run = CellRun(list(self._cell_rows), (window_start, plan.deadline_ts), cpu, interrupted,
                      self._worker_stats() if self.n_workers > 0 else [])
        if interrupted:
            raise KeyboardInterrupt(run)
        return run

    def _begin_cell(self, plan: CellPlan) -> None:
        """Reset the per-cell counters and hand ``plan`` to the users: in this process, or to
        the live workers (each its rank). Raises RuntimeError when every worker is lost."""
        self._cell_rows = []
        self.cell_ok = 0
        self._cell_id = plan.cell_id
        self._worker_inflight = {}
        self._spawned_at = None
        self._worker_samples = {}
        self._rows_at_start = dict(self._rows_by_worker)
        if self.n_workers <= 0:
            self.env.specload = CellContext(plan, self._sink)
        else:
            live = self._live_indices()
            if not live:
                raise RuntimeError(f"every load worker is lost ({len(self.worker_losses)} losses); "
                                   "nothing can send this cell")
            self.runner.send_message(CELL_MESSAGE, {"plan": plan.to_dict(), "n_workers": len(live),
                                                    "ranks": {str(i): r for r, i in enumerate(live)}})
        self.env.host = plan.base_url

    def _drain(self, plan: CellPlan, drain_timeout_s: float,
               tick: Callable[[float, "LoadRunner"], None] | None) -> None:
        """After the deadline: wait up to ``drain_timeout_s`` for the requests in flight (every
        live worker past the deadline with none in flight); stop flags and ticks as in the cell."""
        drain_end = time.time() + drain_timeout_s
        while time.time() < drain_end:
            if self.n_workers <= 0:
                if self.in_flight() == 0:
                    break
            else:
                self._check_workers(plan.cell_id)
                live = self._live_indices()
                if live and all(i in self._worker_inflight and self._worker_inflight[i][0] >= plan.deadline_ts
                                and self._worker_inflight[i][1] == 0 for i in live):
                    break
            gevent.sleep(0.1)
            self._check_stop()
            if tick:
                tick(time.time(), self)

    def _stop_cell(self) -> None:
        self.runner.stop()
        if self.n_workers <= 0:
            gevent.sleep(0.05)  # killed users run their cancel handlers
            ctx = getattr(self.env, "specload", None)
            if ctx is not None:
                ctx.unsent_rows()
            self.env.specload = None
        else:
            # rows are flushed before each worker's "client_stopped"; allow for late frames
            t_end = time.time() + 2.0
            while time.time() < t_end and any(n for _, n in self._worker_inflight.values()):
                gevent.sleep(0.1)
            gevent.sleep(0.3)

    def _on_heartbeat(self, client_id: str, timestamp: float, **_: Any) -> None:
        self._last_beat[str(client_id)] = float(timestamp)

    def _settle_losses(self, max_wait_s: float = 8.0) -> None:
        """Before quitting: tell each worker alive from one that died late in the last cell.

        A worker counts as alive once the master hears a heartbeat from it more than one beat
        interval after this call began (a beat already on the wire when a worker died arrives
        within that interval) and, when the Ray helper watches the actors, once a helper round
        that began after this call has passed without ``LOST`` for it; until then it is pending.
        A dead actor is reported by that round; a silent worker is marked missing by Locust after
        ``HEARTBEAT_LIVENESS`` missed 1 s beats (about 4 s). ``_check_workers`` then records the
        loss. Returns once no worker is pending, or after ``max_wait_s``.
        """
        if self.n_workers <= 0:
            return
        from locust.runners import HEARTBEAT_INTERVAL

        t0 = time.time()
        t_end = t0 + max_wait_s
        cell = self._cell_id or "after-run"
        while time.time() < t_end:
            self._check_workers(cell)
            dead = self._dead_by_ray()
            round_pending = self._helper_round_ts is not None and self._helper_round_ts < t0
            pending = [c for c in self.runner.clients.values() if not self._is_lost(c, dead) and (
                round_pending or self._last_beat.get(str(c.id), 0.0) <= t0 + HEARTBEAT_INTERVAL)]
            if not pending:
                return
            gevent.sleep(0.25)
        self._check_workers(cell)

    def close(self) -> None:
        """Stop runners and workers; shut down the Ray helper (which shuts Ray down if it started it)."""
        try:
            self._settle_losses()
        except Exception:  # noqa: BLE001  (closing after an interrupt)
            pass
        try:
            self.runner.quit()
        except Exception:  # noqa: BLE001  (closing after an interrupt)
            pass
        if self._helper is not None:
            try:
                if self._helper.stdin:
                    self._helper.stdin.close()
                self._helper.wait(60)
            except (subprocess.TimeoutExpired, OSError):
                self._helper.terminate()
            self._helper = None
