"""The Locust user that sends streamed completions, and the per-process cell context.

Imports locust (which monkey-patches with gevent): import this module only in
the load-generator process (``python -m loadgen``, ``locust -f
loadgen/run/locustfile.py``), never in a Ray actor or the test process.

Closed loop: each user sends its next request as soon as the previous one ends
(``wait_time = constant(0)``; no waves, no shared barrier). Open loop: each user
takes the next Poisson slot and sleeps until its scheduled time; when every
user is busy the slot is sent late and its latency still counts from the
scheduled time (no coordinated omission).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import gevent
from locust import User, constant, task

from configs import metric_names as M
from loadgen.run.cells import CellPlan, Dispenser, Job, retry_delay_s
from loadgen.run.client import (COMPLETIONS_PATH, CONNECTION_LOST_KEY, REFUSED_KEY, RETRY_AFTER_KEY, make_http_client, path_prefix,
                                stream_completion)

ROWS_MESSAGE = "specload_rows"   # worker -> master: {"cell_id", "rows", "in_flight", "worker", "ts", "node"}
CELL_MESSAGE = "specload_cell"   # master -> workers: {"plan": CellPlan dict, "n_workers": N, "ranks": {index: rank}}


class CellContext:
    """What this process's users need for the current cell: plan, dispenser and row sink."""

    def __init__(self, plan: CellPlan, sink: Callable[[dict[str, Any]], None],
                 worker_index: int = 0, n_workers: int = 1) -> None:
        self.plan = plan
        self.dispenser = Dispenser(plan, worker_index, n_workers)
        self.sink = sink
        self.in_flight = 0
        self.sent = 0
        self._busy_since: float | None = None

    def base_row(self, job: Job) -> dict[str, Any]:
        p = self.plan
        return {M.REQ_RUN_ID: p.run_id, M.REQ_STRATEGY: job.strategy or p.strategy, M.REQ_TIER: p.tier,
                M.REQ_OUTPUT_CLASS: p.output_class, M.REQ_DATASET: p.dataset, M.REQ_PROMPT_ID: job.prompt_id,
                M.REQ_USERS: p.users, M.REQ_ARRIVAL: p.arrival, M.REQ_RATE_RPS: p.rate_rps,
                M.REQ_REQUEST_INDEX: job.index, M.REQ_MAX_TOKENS: job.body.get("max_tokens"),
                M.REQ_REPEAT: p.repeat, M.REQ_SAMPLING: p.sampling_label,
                M.REQ_TEMPERATURE: job.body.get("temperature"),
                M.REQ_IGNORE_EOS: int(bool(job.body.get("ignore_eos"))),
                M.REQ_MIN_TOKENS: job.body.get("min_tokens"),
                M.REQ_CATEGORY: p.categories.get(job.prompt_id) if p.categories else None}

    def emit(self, job: Job, fields: dict[str, Any]) -> dict[str, Any]:
        row = self.base_row(job)
        row.update(fields)
        self.sink(row)
        return row

    def unsent_rows(self) -> list[dict[str, Any]]:
        """Open loop: ``cancelled`` rows for past slots never sent (every user was busy).

        Closes the dispenser: nothing is handed out afterwards. Closed loop: none.
        """
        out: list[dict[str, Any]] = []
        now = time.time()
        for job in self.dispenser.close(now):
            t = job.scheduled_ts or now
            out.append(self.emit(job, {M.REQ_SCHEDULED_TS: t, M.REQ_END_TS: time.time(),
                                       M.REQ_STATUS: M.STATUS_CANCELLED,
                                       M.REQ_ERROR: "never sent: every user was busy (raise users)"}))
        return out


class CompletionUser(User):
    """One simulated client with one keep-alive connection and one request in flight.

    Reads ``self.environment.specload`` (a CellContext), set by the driver or by
    the worker's cell-message handler before users are spawned.
    """

    wait_time = constant(0)
    host = "http://127.0.0.1:8000"  # only used by the standalone locustfile

    def on_start(self) -> None:
        self._http = None
        self._http_base: tuple | None = None
        self._fallback_cell: str | None = None   # the cell in which this user left the direct route

    def on_stop(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def _base_url(self, plan: CellPlan) -> str:
        """Where this user sends in this cell: the plan's URL, or its fallback once the
        plan's direct listener failed this user's connection in this cell."""
        return plan.fallback_url if self._fallback_cell == plan.cell_id else plan.base_url

    def _client(self, plan: CellPlan, base_url: str):
        key = (base_url, tuple(sorted(plan.headers.items())), plan.insecure)
        if self._http is None or self._http_base != key:
            if self._http is not None:
                self._http.close()
            self._http = make_http_client(base_url, plan.request_timeout_s, plan.headers, plan.insecure)
            self._http_base = key
        return self._http

    @task
    def completion(self) -> None:
        ctx: CellContext | None = getattr(self.environment, "specload", None)
        if ctx is None:
            gevent.sleep(0.1)
            return
        if (wait := ctx.plan.start_ts - time.time()) > 0:  # nobody sends before the cell starts
            gevent.sleep(wait)
        job = ctx.dispenser.next()
        if job is None:  # cell over for this process: idle until the runner stops us
            gevent.sleep(0.05)
            return
        if job.scheduled_ts is not None and (delay := job.scheduled_ts - time.time()) > 0:
            gevent.sleep(delay)
        plan = ctx.plan
        ctx.in_flight += 1
        ctx.sent += 1
        retries = 0
        first_ts = job.scheduled_ts if job.scheduled_ts is not None else time.time()
        try:
            while True:
                base = self._base_url(plan)
                route = plan.route if base == plan.base_url else M.ROUTE_STRATEGY
                http = self._client(plan, base)
                fields, conn_ok = stream_completion(
                    http, path_prefix(base) + COMPLETIONS_PATH, job.body, first_ts,
                    plan.request_timeout_s,
                    on_cancel=lambda r: ctx.emit(job, dict(r, **{M.REQ_RETRIES: retries,
                                                                 M.REQ_ROUTE: route or None})))
                fields[M.REQ_ROUTE] = route or None
                if not conn_ok:
                    http.close()
                    self._http = None
                refused = fields.pop(REFUSED_KEY, False)
                if fields.pop(CONNECTION_LOST_KEY, False) and plan.fallback_url and base != plan.fallback_url:
                    # the replica's own listener failed at the connection level (refused, reset, or
                    # closed: the replica is gone or going, and a dying process may still accept a
                    # connection it never answers): this user's next requests take the Serve proxy's
                    # route, whose router finds the live replica
                    self._fallback_cell = plan.cell_id
                    if refused:
                        # nothing was sent: resend at once; latency counts from the first send
                        continue
                retry_after = fields.pop(RETRY_AFTER_KEY, None)
                if fields[M.REQ_STATUS] != M.STATUS_REJECTED or retries >= plan.max_retries:
                    break
                # opt-in retry of a 429: back off, never sooner than Retry-After, never past the
                # deadline; latency keeps counting from the first scheduled send
                delay = retry_delay_s(retries + 1, retry_after, plan.retry_backoff_s)
                if time.time() + delay >= plan.deadline_ts:
                    break
                gevent.sleep(delay)
                retries += 1
        finally:
            ctx.in_flight -= 1
        fields[M.REQ_RETRIES] = retries
        row = ctx.emit(job, fields)
        self._report(row)

    def _report(self, row: dict[str, Any]) -> None:
        """Mirror the row into Locust's own stats (web UI / CSV): e2e and TTFT in ms."""
        ok = row[M.REQ_STATUS] == M.STATUS_OK
        fire = self.environment.events.request.fire
        fire(request_type="POST", name=f"{row[M.REQ_STRATEGY]} e2e", response_time=row[M.REQ_E2E_MS] or 0,
             response_length=row.get(M.REQ_OUTPUT_TOKENS) or 0, response=None, context={},
             exception=None if ok else RuntimeError(f"{row[M.REQ_STATUS]}: {row.get(M.REQ_ERROR)}"))
        if ok and row.get(M.REQ_TTFT_MS) is not None:
            fire(request_type="TTFT", name=f"{row[M.REQ_STRATEGY]} ttft", response_time=row[M.REQ_TTFT_MS],
                 response_length=0, response=None, context={}, exception=None)


def install_worker_hooks(environment: Any, flush_interval_s: float = 0.25) -> None:
    """On a Locust worker: receive cell plans from the specload master, stream rows back.

    Rows are batched and sent every ``flush_interval_s`` seconds with this
    worker's in-flight count (the master drains on it), and flushed on stop,
    before the worker reports "client_stopped", so the master has every row.
    The cell's request indices are split by this worker's rank among the live
    workers (``ranks``; a lost worker's share goes to the others in later cells).
    When the process that started this worker (the Ray actor) dies, the worker
    exits too: a lost actor is a lost worker, never an orphan still sending load.
    """
    parent = os.getppid()
    runner = environment.runner
    buffer: list[dict[str, Any]] = []
    state: dict[str, Any] = {"cell_id": None}

    def flush() -> None:
        ctx = getattr(environment, "specload", None)
        rows = buffer[:]
        del buffer[:]
        runner.send_message(ROWS_MESSAGE, {"cell_id": state["cell_id"], "rows": rows, "worker": runner.worker_index,
                                           "in_flight": ctx.in_flight if ctx else 0, "ts": time.time(),
                                           "pid": os.getpid(),   # the master maps Ray's LOST <i> by it
                                           # set by loadgen.run.ray_workers: the Ray node this worker runs on
                                           "node": os.environ.get("SPECLOAD_RAY_NODE_ID", "")})

    def on_cell(environment: Any, msg: Any, **_: Any) -> None:
        plan = CellPlan.from_dict(msg.data["plan"])
        state["cell_id"] = plan.cell_id
        index = max(runner.worker_index, 0)
        rank = int((msg.data.get("ranks") or {}).get(str(index), index))
        environment.specload = CellContext(plan, buffer.append, rank, int(msg.data["n_workers"]))
        flush()   # at once: the master learns this worker's pid (Ray's LOST <i> maps by it) before any row

    def flusher() -> None:
        while True:
            gevent.sleep(flush_interval_s)
            if os.getppid() != parent:
                os._exit(70)   # our actor died: die with it (rows not yet sent are lost with it)
            if getattr(environment, "specload", None) is not None:
                flush()

    def on_test_stop(environment: Any, **_: Any) -> None:
        ctx = getattr(environment, "specload", None)
        if ctx is not None:
            gevent.sleep(0.05)  # let killed users run their cancel handlers
            ctx.unsent_rows()
            flush()
            environment.specload = None

    runner.register_message(CELL_MESSAGE, on_cell)
    environment.events.test_stop.add_listener(on_test_stop)
    gevent.spawn(flusher)
