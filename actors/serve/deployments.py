"""Ray Serve deployments that run inside the cluster: one engine per strategy replica.

- ``StrategyServer`` (the deployment of ``StrategyReplica``): one class, bound
  once per strategy with a different engine config (``actors.serve.app``).
  Each replica owns a ``ProcessAsyncLLMEngine`` (continuous batching in the
  replica's own engine process) or, with ``engine_process: false`` (and "auto" on
  fewer than 4 cores), an ``AsyncLLMEngine`` on a thread and streams the typed messages of ``actors.serve.protocol`` to the
  HTTP ingress; as the ingress of its own application (the one-hop layout) it
  answers the OpenAI routes itself, with the ingress's code.
- ``StepLogStore``: one replica holding the app-wide step log (a bounded ring
  buffer). Every strategy replica keeps its own ring buffer too and pushes new
  rows to the store every ``STEP_FLUSH_S`` seconds, so
  ``GET /specload/step_log`` sees every replica with at most that lag.

Prometheus metrics go through ``ray.serve.metrics`` (Ray adds the deployment,
replica and application tags); names are ``configs.metric_names.PROM_*``
with the ``specload_`` prefix (Ray exports them as ``ray_specload_...``).
"""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations
# (Request) at run time, in the replica
import asyncio
import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from actors.engine.errors import InvalidRequest, QueueFull
from actors.engine.types import MemoryReport, RequestOutput, SamplingParams, SyncEngine
from actors.serve.engine_core import import_object
from actors.serve.openai_request import (API_KEY_ENV, api_key_error, error_response,
                                         install_error_handlers, read_request, request_id)
from actors.serve.openai_response import health_response, model_card, respond
from actors.serve.protocol import Admitted, Delta, ErrorMessage, Finished, ReplicaMessage
from configs import metric_names as mn
from configs.results_schema import StepRow
from configs.serve_config import (DEFAULT_ENGINE_FACTORY, DEFAULT_STREAM_INTERVAL_MS, STEP_FLUSH_S,
                                  resolve_engine_process)

logger = logging.getLogger("ray.serve")

STEP_PUSH_TIMEOUT_S = 10.0         # a push the store does not take within this is dropped
# Ray refuses ':' in metric names since 2.4x (FutureWarning, then dropped), so
# the shared "specload:" prefix is exported as "specload_".
PROM_PREFIX = mn.PROM_PREFIX.replace(":", "_")
STEP_MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
TOKEN_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]



@dataclass
class _Chunk:
    """The tokens of one request not yet sent (``StrategyServer.generate``): ids, their
    engine emit times (unix s), text pieces and logprobs (kept when ``want_lps``)."""

    want_lps: bool
    ids: list[int] = field(default_factory=list)
    ts: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    lps: list = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.ids.extend(out.new_token_ids)
        self.ts.extend(out.token_ts or [])
        self.text.append(out.new_text)
        self.lps.extend(out.logprobs or [])

    def delta(self) -> Delta:
        """The held tokens as one ``Delta``; the chunk starts empty again."""
        d = Delta(self.ids, "".join(self.text), self.ts, self.lps if self.want_lps else None)
        self.ids, self.ts, self.text, self.lps = [], [], [], []
        return d


async def _next_batch(queue: asyncio.Queue, deadline: float | None) -> tuple[list, bool]:
    """The engine outputs queued for a request: wait for one (until ``deadline``,
    ``time.monotonic()`` seconds, when tokens are held; None: no limit), then take what
    queued up meanwhile. Returns (outputs, whether the wait ran out: the held tokens leave)."""
    if deadline is not None:
        try:
            batch = [await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0.0))]
        except asyncio.TimeoutError:
            batch = []
            while not queue.empty():
                batch.append(queue.get_nowait())
            return batch, True
    else:
        batch = [await queue.get()]
    while not queue.empty():       # coalesce what queued up meanwhile
        batch.append(queue.get_nowait())
    return batch, False

class ReplicaMetrics:
    """The replica's Prometheus instruments (created inside the replica process)."""

    def __init__(self, strategy: str):
        from ray.serve import metrics as m

        # ray.serve.metrics adds deployment / replica / application tags itself
        # (and mutates the default-tag dict it is given: one fresh dict each).
        def make(cls, name, desc, extra_keys=(), **kw):
            metric = cls(PROM_PREFIX + name, desc, tag_keys=("strategy",) + extra_keys, **kw)
            metric.set_default_tags({"strategy": strategy})
            return metric

        self.num_drafts = make(m.Counter, mn.PROM_SPEC_NUM_DRAFTS,
                               "verification steps that carried >= 1 draft token")
        self.num_draft_tokens = make(m.Counter, mn.PROM_SPEC_NUM_DRAFT_TOKENS,
                                     "draft tokens proposed")
        self.num_accepted = make(m.Counter, mn.PROM_SPEC_NUM_ACCEPTED_TOKENS,
                                 "draft tokens accepted")
        self.per_pos = make(m.Counter, mn.PROM_SPEC_NUM_ACCEPTED_PER_POS,
                            "draft tokens accepted at each draft position (0-based)",
                            ("position",))
        self.batch_size = make(m.Histogram, mn.PROM_BATCH_SIZE,
                               "running requests per engine step", boundaries=BATCH_BUCKETS)
        self.verif_tokens = make(m.Histogram, mn.PROM_VERIFICATION_TOKENS,
                                 "verification tokens per step, sum(draft_len + 1)",
                                 boundaries=TOKEN_BUCKETS)
        self.step_ms = make(m.Histogram, mn.PROM_STEP_TIME_MS, "engine step wall time, ms",
                            boundaries=STEP_MS_BUCKETS)
        self.queue_depth = make(m.Gauge, mn.PROM_QUEUE_DEPTH,
                                "requests waiting for a batch slot")
        self.requests_finished = make(m.Counter, mn.PROM_REQUEST_SUCCESS,
                                      "requests finished with their output (stop, length), as vLLM's "
                                      "request_success")
        self.generation_tokens = make(m.Counter, mn.PROM_GENERATION_TOKENS,
                                      "output tokens generated by finished requests")
        self.degraded = make(m.Counter, mn.PROM_DEGRADED_REQUESTS,
                             "finished requests whose drafter was dropped (they decoded "
                             "autoregressively from then on), by reason", ("reason",))

    def observe_step(self, row: StepRow) -> None:
        self.batch_size.observe(row.get(mn.STEP_BATCH_SIZE, 0))
        self.verif_tokens.observe(row.get(mn.STEP_VERIFICATION_TOKENS, 0))
        self.step_ms.observe(row.get(mn.STEP_MS, 0.0))
        self.queue_depth.set(row.get(mn.STEP_QUEUE_DEPTH, 0))

    def observe_request(self, stats: dict, output_tokens: int | None = None) -> None:
        self.requests_finished.inc(1)
        if output_tokens:
            self.generation_tokens.inc(output_tokens)
        if stats.get(mn.NUM_DRAFTS):
            self.num_drafts.inc(stats[mn.NUM_DRAFTS])
        if stats.get(mn.NUM_DRAFT_TOKENS):
            self.num_draft_tokens.inc(stats[mn.NUM_DRAFT_TOKENS])
        if stats.get(mn.NUM_ACCEPTED_TOKENS):
            self.num_accepted.inc(stats[mn.NUM_ACCEPTED_TOKENS])
        for pos, n in enumerate(stats.get(mn.NUM_ACCEPTED_TOKENS_PER_POS) or []):
            if n:
                self.per_pos.inc(n, tags={"position": str(pos)})
        if stats.get(mn.DEGRADED_REASON):
            self.degraded.inc(1, tags={"reason": stats[mn.DEGRADED_REASON]})


@serve.deployment
class StepLogStore:
    """App-wide step log: a bounded ring buffer of rows from every strategy replica."""

    def __init__(self, capacity: int = 100_000):
        self._rows: collections.deque[dict] = collections.deque(maxlen=max(capacity, 1))
        self._appended = 0   # rows ever appended: the arrival number of the next row
        self._by_model: collections.Counter[str] = collections.Counter()   # served name -> rows
        # Serve runs these sync methods on a thread pool: a query iterating the deque
        # while a replica's push extends it raised "deque mutated during iteration"
        # (an HTTP 500, a cell's step rows lost). Both hold the lock; a query copies
        # under it and filters outside.
        self._lock = threading.Lock()

    def append(self, rows: list[dict]) -> int:
        """Add rows (each carries strategy, replica, ts); returns rows held."""
        with self._lock:
            self._rows.extend(rows)
            self._appended += len(rows)
            self._by_model.update(str(r.get(mn.STEP_MODEL)) for r in rows)
            return len(self._rows)

    def query(self, strategy: str | None = None, since: float | None = None,
              limit: int | None = None) -> list[dict]:
        """Rows with ``ts > since`` (unix seconds) of the deployment served as
        ``strategy`` (its served model name, ``STEP_MODEL``; all when None),
        oldest first; with ``limit``, the newest ``limit`` of them."""
        with self._lock:
            snapshot = list(self._rows)
        rows = [r for r in snapshot
                if (strategy is None or r.get(mn.STEP_MODEL) == strategy)
                and (since is None or r.get(mn.STEP_TS, 0.0) > since)]
        return rows[-limit:] if limit else rows

    def page(self, strategy: str | None = None, since: float | None = None,
             after: int | None = None) -> dict:
        """Rows by arrival, not by step time: with ``after`` (the ``next`` of an earlier
        page), every row that arrived since that page, whatever its ``ts`` (replicas push
        every ``STEP_FLUSH_S`` each on its own clock, so a row of an earlier step can
        arrive after a later one: a ``since`` cursor skipped it); ``since`` still filters
        by ts when given. -> ``{"rows": [...], "next": int, "total": int}``: ``next`` is
        the cursor for the following page; ``total`` the rows of ``strategy`` (of all, when
        None) the store ever took, so a reader of consecutive pages can count rows evicted
        (past the capacity) before it fetched them: the growth of ``total`` less the rows."""
        with self._lock:
            snapshot, end = list(self._rows), self._appended
            total = self._appended if strategy is None else self._by_model[strategy]
        first = end - len(snapshot)             # arrival number of the oldest row held
        # a cursor past the end is from before this store restarted (Serve replaced it):
        # every row it holds is new to that reader
        start = first if after is None or int(after) > end else max(int(after), first)
        rows = [r for r in snapshot[start - first:]
                if (strategy is None or r.get(mn.STEP_MODEL) == strategy)
                and (since is None or r.get(mn.STEP_TS, 0.0) > since)]
        return {"rows": rows, "next": end, "total": total}


# A strategy's own HTTP routes: served when the strategy is the ingress of its own
# Serve application (``actors.serve.app.applications``, route ``<ingress>/strategies/
# <name>``), so the proxy streams straight from this replica (no second Ray hop per
# chunk). Parsing and answering are the model-field ingress's own functions.
strategy_api = install_error_handlers(FastAPI(
    title="specload strategy", description="one strategy's OpenAI-compatible routes"))


def chunk_rule(stream_interval: int, stream_interval_ms: float | None) -> tuple[float, float | None]:
    """How a stream's deltas are chunked -> (tokens that send a delta, seconds that send one).

    ``stream_interval`` (vLLM's name): tokens per delta; ``stream_interval_ms``: a delta
    once that many ms passed since the last (Ray Serve LLM's stream batching window).
    Only ms (interval 1): the window alone decides (tokens: inf). Both: whichever comes
    first. Only tokens: ``(stream_interval, None)``; (1, None) is one delta per engine step.
    """
    interval = max(1, int(stream_interval))
    if not stream_interval_ms:
        return float(interval), None
    return (float("inf") if interval == 1 else float(interval)), float(stream_interval_ms) / 1e3


class StrategyReplica:
    """One replica of one strategy: an AsyncLLMEngine plus its metrics and step log.
    (The plain class; ``StrategyServer`` is its Serve deployment, an HTTP ingress too.)

    strategy: the public name (OpenAI ``model``). engine_config: EngineConfig
    fields (dict). engine_factory: import path of ``(engine_config) -> engine``.
    step_store: handle of the StepLogStore; or ``(app_name, deployment_name)`` of
    it in another application (looked up at the first push); None: keep the log
    local only. stream_interval, stream_interval_ms: how the streamed deltas are
    chunked unless a request says otherwise (``chunk_rule``). engine_process: run
    the engine step in its own process (``ProcessAsyncLLMEngine``, vLLM V1's
    engine-core process), else on a thread of the replica's; "auto"
    (``configs.serve_config.resolve_engine_process``): its own process on a machine
    with at least 2 cores. retry_after_s, api_key: as the ingress's, for this replica's own
    routes (api_key default ``$SPECLOAD_API_KEY``; none: open). An engine config with
    ``backend: vllm`` runs vLLM's engine (``actors.engine.vllm_backend``) in its own
    process started by the vLLM venv's python, whatever engine_process and
    engine_factory say; everything else here is the same for both backends.

    The model-field ingress calls ``generate`` through a handle. Deployed as its
    own application's ingress, the replica also answers HTTP itself, like the
    ingress (same validation, bodies, errors, API key): ``POST /v1/completions``,
    ``POST /v1/chat/completions`` (``model`` must name this strategy, else 404
    ``model_not_found``), ``GET /v1/models``, ``GET /health``.
    """

    def __init__(self, strategy: str, engine_config: dict,
                 engine_factory: str = DEFAULT_ENGINE_FACTORY,
                 step_store: Any = None, step_log_capacity: int = 8192,
                 stream_interval: int = 1, retry_after_s: int = 1,
                 api_key: str | None = None, engine_process: bool | str = "auto",
                 stream_interval_ms: float | None = DEFAULT_STREAM_INTERVAL_MS):
        from actors.serve.async_engine import AsyncLLMEngine, ProcessAsyncLLMEngine

        cfg = dict(engine_config)
        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use)
            replica = str(os.getpid())
        cfg.setdefault("replica_id", replica)
        cfg.setdefault("served_model_name", strategy)  # step rows carry it beside the strategy
        threads = int(cfg.get("torch_threads") or 1)
        python = None
        if cfg.get("backend") == "vllm":
            # vLLM's engine in its own venv: always its own process, whatever
            # engine_process says (vLLM cannot be imported in this environment)
            from actors.engine.config import EngineConfig
            from actors.engine.vllm_backend import VLLM_FACTORY

            ec = EngineConfig(**cfg)
            python = ec.resolved_vllm_python()
            cfg = ec.model_dump()
            engine_factory, engine_process = VLLM_FACTORY, True
        engine_process = resolve_engine_process(engine_process)
        if not engine_process:
            import torch

            torch.set_num_threads(threads)   # one replica must not take every core
        self.strategy = strategy
        self.stream_interval = max(1, int(stream_interval))  # tokens per streamed delta
        # or a delta per this many ms (Ray Serve LLM's stream batching); None: per step
        self.stream_interval_ms = float(stream_interval_ms) if stream_interval_ms else None
        self._retry_after_s = retry_after_s
        self._api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self._created = int(time.time())
        self._metrics = ReplicaMetrics(strategy)
        self._pending_rows: collections.deque[dict] = collections.deque(maxlen=100_000)
        capacity = max(step_log_capacity, 1)
        # the asyncio side of a ``SyncEngine`` (``actors.engine.types``): in its own process
        # or on a thread of this one
        self.engine: AsyncLLMEngine
        if engine_process:   # the engine step in its own process: no GIL shared with HTTP
            self.engine = ProcessAsyncLLMEngine(engine_factory, cfg, torch_threads=threads,
                                                step_log_capacity=capacity,
                                                step_sink=self._pending_rows.append,
                                                python=python)
        else:
            factory: Callable[[dict], SyncEngine] = import_object(engine_factory)
            self.engine = AsyncLLMEngine(factory(cfg), step_log_capacity=capacity,
                                         step_sink=self._pending_rows.append)
        self._store = step_store
        self._flusher = asyncio.get_event_loop().create_task(self._flush_loop())
        logger.info("strategy %s replica %s ready (max_model_len=%d)", strategy, replica,
                    self.engine.max_model_len)

    async def _flush_loop(self) -> None:
        """Every STEP_FLUSH_S: observe step rows in Prometheus, push them to the store."""
        while True:
            await asyncio.sleep(STEP_FLUSH_S)
            rows = []
            while self._pending_rows:
                rows.append(self._pending_rows.popleft())
            if not rows:
                continue
            for r in rows:
                self._metrics.observe_step(r)
            if self._store is not None:
                try:
                    if isinstance(self._store, (tuple, list)):   # in another application
                        self._store = serve.get_deployment_handle(
                            self._store[1], self._store[0], _check_exists=False)
                    # bounded: a store application not (yet) deployed must not stall the loop
                    await asyncio.wait_for(self._store.append.remote(rows), STEP_PUSH_TIMEOUT_S)
                except Exception:
                    logger.exception("step-log push failed (%d rows dropped)", len(rows))

    def check_health(self) -> None:
        """Serve health check: raises EngineDead when the engine loop died, so Serve
        replaces the replica (after 3 failed checks, ``health_check_period_s`` apart)."""
        self.engine.check_health()

    async def health(self) -> dict:
        """For the ingress's ``GET /health``: {"alive": bool, "error": str | None}."""
        try:
            self.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - EngineDead with the cause
            return {"alive": False, "error": str(exc)}
        return {"alive": True, "error": None}

    # ------------------------------------------------------------ own HTTP routes
    @strategy_api.get("/health")
    async def http_health(self):
        """200 while this replica's engine loop is alive, else 503 (the ingress's
        ``GET /health`` for this one strategy)."""
        return health_response({self.strategy: await self.health()})

    @strategy_api.get("/v1/models")
    async def http_models(self, request: Request):
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        return {"object": "list", "data": [
            model_card(self.strategy, self._created, self.engine.max_model_len)]}

    @strategy_api.post("/reset_prefix_cache")
    async def http_reset_prefix_cache(self, request: Request):
        """vLLM's ``POST /reset_prefix_cache`` (its dev-mode route): ``{"success": bool}``.
        Reaches the one replica Serve routes the call to."""
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        return {"success": await self.reset_prefix_cache()}

    @strategy_api.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._http_generate(request, chat=False)

    @strategy_api.post("/v1/chat/completions")
    async def http_chat_completions(self, request: Request):
        return await self._http_generate(request, chat=True)

    async def _http_generate(self, request: Request, chat: bool):
        req = await read_request(request, chat, self._api_key)
        if isinstance(req, JSONResponse):
            return req
        if req.model != self.strategy:
            return error_response(404, f"model {req.model!r} is not served on this route; it "
                                  f"serves {self.strategy!r} (GET /v1/models)", param="model",
                                  code="model_not_found")
        rid = request_id(chat)
        return await respond(lambda: self.generate(
            rid, req.prompt, req.params, req.stream_interval, req.stream_interval_ms),
            req, rid, chat, self._retry_after_s)

    async def info(self) -> dict:
        """Static and live facts: strategy, max_model_len (tokens), waiting, running, and for
        fault and soak checks the replica's process id, step-log rows held / capacity and
        step rows not yet pushed to the store (all bounded)."""
        return {"strategy": self.strategy, "max_model_len": self.engine.max_model_len,
                "num_waiting": self.engine.num_waiting, "num_running": self.engine.num_running,
                "pid": os.getpid(), "engine_pid": self.engine.engine_pid,
                "step_log_rows": self.engine.step_log_size,
                "step_log_capacity": self.engine.step_log_capacity,
                "pending_step_rows": len(self._pending_rows)}

    async def memory(self, reset_peak: bool = False) -> MemoryReport:
        """This replica's memory report (``LLMEngine.memory``: weight, KV-cache and process
        bytes); ``reset_peak`` restarts the peak counters afterwards. ``{}`` for an engine
        without a memory report (fake engines)."""
        return await self.engine.memory(reset_peak)

    async def reset_prefix_cache(self) -> bool:
        """Forget this replica's stored prefixes (vLLM's ``/reset_prefix_cache``); True when
        done. An engine without prefix caching has nothing to forget (True)."""
        fn = getattr(self.engine, "reset_prefix_cache", None)
        return True if fn is None else bool(await fn())

    async def step_log(self, since: float | None = None, limit: int | None = None) -> list[dict]:
        """This replica's own ring buffer (rows with ts > since, unix seconds)."""
        return self.engine.step_log(since_ts=since, limit=limit)

    async def generate(self, request_id: str, prompt: str | list[int], params: dict,
                       stream_interval: int | None = None,
                       stream_interval_ms: float | None = None
                       ) -> AsyncIterator[ReplicaMessage]:
        """Stream one request as typed messages (``actors.serve.protocol``).

        First ``Admitted`` or an ``ErrorMessage`` (then nothing follows). Then
        ``Delta`` messages (with each token's engine emit time, ``token_ts``, and
        its ``TokenLogprob`` when the request asked for logprobs);
        deltas that queued up while the consumer was busy are merged, so one
        may carry several tokens. How deltas are chunked: ``chunk_rule`` of the
        request's ``stream_interval`` (vLLM's name) and ``stream_interval_ms``
        when it gives either, else of the deployment's; the first token and the
        last are never held, and a held token leaves by the end of its window
        even when no other token follows. The last message is a
        ``Finished`` (finish reason, completion tokens, SpecStats dict) or an
        ``ErrorMessage`` when the request failed part-way (the engine and the
        other requests go on). Cancelling the consumer aborts the request
        (frees its batch slot and KV cache).
        """
        admitted = await self._add_request(request_id, prompt, params)
        if isinstance(admitted, ErrorMessage):
            yield admitted
            return
        sp, n_prompt, queue = admitted
        yield Admitted(n_prompt)
        if stream_interval is None and stream_interval_ms is None:
            interval, every_s = chunk_rule(self.stream_interval, self.stream_interval_ms)
        else:
            interval, every_s = chunk_rule(stream_interval or 1, stream_interval_ms)
        finished = False
        chunk = _Chunk(want_lps=sp.logprobs is not None)
        sent_any, last_sent = False, time.monotonic()
        try:
            while not finished:
                batch, window_over = await _next_batch(
                    queue, last_sent + every_s if chunk.ids and every_s is not None else None)
                msg = self._absorb(batch, chunk)
                finished = msg is not None
                if finished:
                    yield msg
                    break
                now = time.monotonic()
                if sent_any and len(chunk.ids) < interval and not window_over and not (
                        every_s is not None and now - last_sent >= every_s):
                    continue                    # hold the tokens for a fuller chunk
                yield chunk.delta()
                sent_any, last_sent = True, now
        finally:
            if not finished:
                self.engine.abort(request_id)

    async def _add_request(self, request_id: str, prompt: str | list[int], params: dict
                           ) -> tuple[SamplingParams, int, asyncio.Queue] | ErrorMessage:
        """Queue the request in the engine: (its SamplingParams, prompt tokens, its output
        queue), or the ``ErrorMessage`` to answer (400 a bad keyword or value, 429 queue
        full, 503 engine dead)."""
        try:
            sp = SamplingParams(**params)
            n_prompt, queue = await self.engine.add_request(request_id, prompt, sp)
        except TypeError as exc:  # an unexpected SamplingParams keyword
            return ErrorMessage(400, str(exc), "invalid_request_error")
        except Exception as exc:  # InvalidRequest 400, QueueFull 429, EngineDead 503
            if not isinstance(exc, (InvalidRequest, QueueFull)):
                logger.exception("add_request failed")
            return ErrorMessage.from_exception(exc, self.strategy)
        return sp, n_prompt, queue

    def _absorb(self, batch: list, chunk: "_Chunk") -> ReplicaMessage | None:
        """Add a batch of engine outputs (``RequestOutput`` deltas, or the exception that
        ended the request) to ``chunk``; returns the last message when the request ended
        (``Finished``, with its stats observed, or an ``ErrorMessage``), else None."""
        for out in batch:
            if isinstance(out, BaseException):
                return ErrorMessage.from_exception(out, self.strategy)
            if out.finish_reason == "error":
                return ErrorMessage(500, f"{self.strategy}: generation failed: {out.error}",
                                    "server_error", None, "engine_error")
            chunk.add(out)
            if out.finished:
                stats = out.stats.to_dict()
                self._metrics.observe_request(stats, out.num_output_tokens)
                return Finished(chunk.ids, "".join(chunk.text), chunk.ts,
                                chunk.lps if chunk.want_lps else None,
                                finish_reason=out.finish_reason,
                                num_output_tokens=out.num_output_tokens,
                                spec_decode=stats, stop_reason=getattr(out, "stop_reason", None))
        return None

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout_s=1.0)


StrategyServer = serve.deployment(serve.ingress(strategy_api)(StrategyReplica))
"""The Serve deployment of ``StrategyReplica`` (``.options(...).bind(...)``)."""
