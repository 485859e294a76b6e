"""AsyncLLMEngine: the engine's step loop on a background thread (or, with
``ProcessAsyncLLMEngine``, in its own process), asyncio on the outside.

One ``LLMEngine`` per replica is driven by one daemon thread (the *engine
thread*). Everything that touches the engine (``add_request``,
``abort_request``, ``step``) runs on that thread only, so the engine needs no
locking of its own; callers on the asyncio side post commands to a small
queue guarded by a lock and condition variable and get their answers back
through ``loop.call_soon_threadsafe``. The thread sleeps on the condition when
no request is unfinished and no command is pending (0 % CPU when idle).

Outputs of each step are routed to per-request ``asyncio.Queue`` objects on
the caller's event loop. ``generate`` is an async generator: when its consumer
stops early (client disconnect, task cancellation, ``aclose``), its
``finally`` posts an abort, which frees the request's batch slot and KV cache
before the next step.

Every engine step also appends one row (``configs.metric_names.STEP_LOG_COLUMNS``)
to a bounded in-memory ring buffer (``step_log``) and hands it to an optional
``step_sink`` callback (the Serve deployment uses it for Prometheus and for
the central step-log store).

``ProcessAsyncLLMEngine`` (what strategy replicas run by default) keeps this
asyncio side and moves the step loop to a child process
(``actors.serve.engine_core``): a reader thread receives each step's outputs and
step rows as one message, so the replica's HTTP work and the engine step do not
share a GIL.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from actors.engine.errors import EngineDead
from actors.engine.types import MemoryReport, RequestOutput, SamplingParams, SpecStats, SyncEngine
from configs.results_schema import StepRow

if TYPE_CHECKING:   # annotations only: pydantic's config model is the engine's to import
    from actors.engine.config import EngineConfig
from configs import metric_names as mn

logger = logging.getLogger(__name__)

DEFAULT_STEP_LOG_CAPACITY = 8192   # rows kept per replica (about 1 MB of dicts)


EngineDeadError = EngineDead  # the engine thread has stopped (shutdown or a crash)


@dataclass
class _Command:
    kind: str                      # "add" | "abort" | "call" (request_id: the engine method)
    request_id: str
    prompt: Any = None
    params: SamplingParams | None = None
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _resolve(fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Set a future's outcome unless its waiter was cancelled meanwhile (runs on the loop)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class AsyncLLMEngine:
    """Asyncio front of one synchronous engine (``actors.engine.types.SyncEngine``:
    ``actors.engine.llm_engine.LLMEngine``, ``actors.engine.vllm_backend.VllmEngine``).

    engine: the synchronous engine, owned by this object from now on.
    step_log_capacity: rows kept in the ring buffer (older rows are dropped).
    step_sink: called on the engine thread with each step row (keep it cheap;
    exceptions are logged and swallowed).
    """

    def __init__(self, engine: SyncEngine, *, step_log_capacity: int = DEFAULT_STEP_LOG_CAPACITY,
                 step_sink: Callable[[dict], None] | None = None):
        self.engine = engine
        self._init_common(step_log_capacity, step_sink)
        engine.on_step = self._on_step
        self._thread = threading.Thread(target=self._run, name="specload-engine", daemon=True)
        self._thread.start()

    def _init_common(self, step_log_capacity: int, step_sink: Callable[[dict], None] | None
                     ) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._commands: collections.deque[_Command] = collections.deque()
        self._streams: dict[str, _Stream] = {}   # the engine (or reader) thread's
        self._stop = False
        self._error: BaseException | None = None
        self._step_log: collections.deque[dict] = collections.deque(maxlen=step_log_capacity)
        # the engine (or reader) thread appends while HTTP routes read: both hold it
        self._step_lock = threading.Lock()
        self._step_seq = 0
        self._step_sink = step_sink

    # ------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> "AsyncLLMEngine":
        """Build the real engine from an ``EngineConfig`` and wrap it.

        Torch threads are the hosting process's to set (``StrategyServer`` in
        a replica, ``main`` in a CLI), once, before this.
        """
        from actors.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), **kwargs)

    # ------------------------------------------------------------ properties
    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def num_waiting(self) -> int:
        return int(self.engine.num_waiting)

    @property
    def num_running(self) -> int:
        return int(self.engine.num_running)

    @property
    def step_log_size(self) -> int:
        """Rows in the step-log ring buffer now (<= step_log_capacity)."""
        return len(self._step_log)

    @property
    def step_log_capacity(self) -> int:
        """Rows the step-log ring buffer keeps at most."""
        return int(self._step_log.maxlen or 0)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stop

    @property
    def engine_pid(self) -> int:
        """The process that runs the engine step (this one, on a thread)."""
        return os.getpid()

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine thread is gone."""
        if not self.is_alive:
            raise EngineDeadError(f"engine thread stopped: {self._error!r}")

    async def memory(self, reset_peak: bool = False) -> MemoryReport:
        """The engine's memory report (``LLMEngine.memory``; ``{}`` for an engine
        without one); ``reset_peak`` restarts its peak counters afterwards."""
        report = self.engine.memory() if hasattr(self.engine, "memory") else {}
        if reset_peak and hasattr(self.engine, "reset_peak_memory"):
            self.engine.reset_peak_memory()
        return report

    async def reset_prefix_cache(self) -> bool:
        """Forget the engine's stored prefixes (``LLMEngine.reset_prefix_cache``), applied
        between two steps; True when done (an engine without the method: nothing to forget).
        Raises EngineDeadError."""
        self.check_health()
        if not hasattr(self.engine, "reset_prefix_cache"):
            return True
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post(_Command("call", "reset_prefix_cache", loop=loop, future=fut))
        return bool(await fut)

    # ------------------------------------------------------------ public API
    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams) -> tuple[int, asyncio.Queue]:
        """Admit a request; return (num prompt tokens, its output queue).

        Raises what the engine raises (ValueError naming the field,
        QueueFullError) and EngineDeadError. Waits at most one engine step
        (commands are applied between steps).
        """
        self.check_health()
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        fut = loop.create_future()
        self._post(_Command("add", request_id, prompt, params, loop, fut), stream)
        try:
            n = await fut
        except asyncio.CancelledError:
            # The add may already be applied: undo it (commands run in order).
            self.abort(request_id)
            raise
        return n, stream.queue

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); safe from any thread."""
        self._post(_Command("abort", request_id))

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas; the last one has ``finished`` True.

        The request is admitted before the first item is produced, so errors
        of ``add_request`` surface on the first ``__anext__``. If the consumer
        stops early the request is aborted (slot and KV cache freed).
        """
        _, queue = await self.add_request(request_id, prompt, params)
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def step_log(self, since_seq: int = -1, since_ts: float | None = None,
                 limit: int | None = None) -> list[dict]:
        """Rows of the ring buffer with ``seq > since_seq`` and ``ts > since_ts``
        (unix seconds), oldest first, at most ``limit`` (the newest ones)."""
        with self._step_lock:   # a copy under the writer's lock, filtered outside it
            rows = list(self._step_log)
        rows = [r for r in rows if r["seq"] > since_seq
                and (since_ts is None or r.get(mn.STEP_TS, 0.0) > since_ts)]
        if limit is not None:
            rows = rows[-limit:] if limit > 0 else []
        return rows

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine thread (unfinished requests get an EngineDeadError)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------ engine thread
    def _post(self, cmd: _Command, stream: _Stream | None = None) -> None:
        with self._cv:
            if stream is not None:
                cmd.stream = stream  # type: ignore[attr-defined]
            self._commands.append(cmd)
            self._cv.notify()

    def _on_step(self, row: StepRow) -> None:
        self._step_seq += 1
        row = dict(row, seq=self._step_seq)
        with self._step_lock:
            self._step_log.append(row)
        if self._step_sink is not None:
            try:
                self._step_sink(row)
            except Exception:  # a metrics problem must never stop decoding
                logger.exception("step_sink failed")

    def _deliver(self, stream: _Stream, item: RequestOutput | BaseException) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:   # the caller's loop is closed: nobody is listening
            pass

    def _deliver_step(self, outs: list[RequestOutput]) -> None:
        """Route one step's outputs to their streams: one wake-up per event loop
        per step (not one per request), the finished ones unregistered."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # the caller's loop is closed: nobody is listening
                pass

    def _apply(self, cmd: _Command) -> None:
        if cmd.kind == "call":   # an engine method that mutates state: between steps
            try:
                result = getattr(self.engine, cmd.request_id)()
            except Exception as exc:  # noqa: BLE001 - the caller's answer
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, exc)
            else:
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, result, None)
            return
        if cmd.kind == "abort":
            stream = self._streams.pop(cmd.request_id, None)
            self.engine.abort_request(cmd.request_id)
            if stream is not None:
                self._deliver(stream, RequestOutput(
                    cmd.request_id, [], "", True, "abort", 0, 0, SpecStats()))
            return
        try:
            n = self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except Exception as exc:  # ValueError, QueueFullError: the caller's problem
            cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, exc)
            return
        self._streams[cmd.request_id] = cmd.stream  # type: ignore[attr-defined]
        cmd.loop.call_soon_threadsafe(_resolve, cmd.future, n, None)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while (not self._stop and not self._commands
                           and not self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stop:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for cmd in commands:
                    self._apply(cmd)
                if not self.engine.has_unfinished_requests():
                    continue
                self._deliver_step(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - report to every waiter, then die
            logger.exception("engine thread crashed")
            self._error = exc
        finally:
            self._fail_all(self._error or EngineDeadError("engine shut down"))

    def _fail_all(self, exc: BaseException) -> None:
        dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"engine step failed: {exc!r}")
        with self._cv:
            self._stop = True
            commands = list(self._commands)
            self._commands.clear()
        for cmd in commands:
            if cmd.kind in ("add", "call"):
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, dead)
        for stream in self._streams.values():
            self._deliver(stream, dead)
        self._streams.clear()


class ProcessAsyncLLMEngine(AsyncLLMEngine):
    """``AsyncLLMEngine`` whose engine runs in its own process (vLLM V1's engine-core
    process; ``actors.serve.engine_core``), so the replica's HTTP and streaming work
    and the engine step do not share one GIL.

    Same API and behaviour as ``AsyncLLMEngine`` (admission errors, streams, aborts,
    the step log and ``step_sink``, EngineDeadError when the engine is gone). Commands
    go to the child as they are posted; one reader thread receives each step's outputs
    and step rows as one message and routes them. The child exits when this process
    dies (its socket closes), so a killed replica leaves no engine behind.

    engine_factory: import path of ``(engine_config) -> engine``; engine_config: its
    argument; torch_threads: the child's torch threads; python: the child's interpreter
    (None: this one; vLLM's venv for ``engine.backend: vllm``). Raises what the factory raised
    in the child, or EngineDeadError when the child did not start.
    """

    def __init__(self, engine_factory: str, engine_config: dict, *, torch_threads: int = 1,
                 step_log_capacity: int = DEFAULT_STEP_LOG_CAPACITY,
                 step_sink: Callable[[dict], None] | None = None, python: str | None = None):
        from actors.serve.engine_core import EngineProcess

        self.engine = None          # in another process
        self._init_common(step_log_capacity, step_sink)
        self._pending: dict[str, _Command] = {}     # adds sent, not yet answered
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self._core = EngineProcess(engine_factory, engine_config, torch_threads, python=python)
        self._max_model_len = int(self._core.facts["max_model_len"])
        self._waiting = self._running = 0
        self._thread = threading.Thread(target=self._run, name="specload-engine-reader",
                                        daemon=True)
        self._thread.start()

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def num_waiting(self) -> int:
        """Waiting requests after the engine's last step, add or abort."""
        return self._waiting

    @property
    def num_running(self) -> int:
        """Running requests after the engine's last step, add or abort."""
        return self._running

    @property
    def engine_pid(self) -> int:
        return self._core.pid

    @property
    def is_alive(self) -> bool:
        return (self._thread.is_alive() and self._error is None and not self._stop
                and self._core.alive())

    async def memory(self, reset_peak: bool = False) -> MemoryReport:
        self.check_health()
        report = await self._call("memory") or {}
        if reset_peak:
            await self._call("reset_peak_memory")
        return report

    async def reset_prefix_cache(self) -> bool:
        self.check_health()
        return bool(await self._call("reset_prefix_cache"))

    async def _call(self, method: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        token = next(self._tokens)
        self._calls[token] = (loop, fut)
        try:
            self._core.send(("call", token, method, args))
            return await fut
        finally:
            self._calls.pop(token, None)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine process (unfinished requests get an EngineDeadError)."""
        self._stop = True
        self._core.close(timeout_s)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _post(self, cmd: _Command, stream: _Stream | None = None) -> None:
        try:
            if cmd.kind == "add":
                cmd.stream = stream  # type: ignore[attr-defined]
                self._pending[cmd.request_id] = cmd
                self._core.send(("add", cmd.request_id, cmd.prompt, cmd.params))
            else:
                self._core.send(("abort", cmd.request_id))
        except EngineDeadError as exc:
            if cmd.kind == "add" and self._pending.pop(cmd.request_id, None) is not None:
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, exc)

    def _run(self) -> None:
        """The reader thread: route every message of the engine process."""
        conn = self._core.conn
        try:
            while True:
                msg = conn.recv()
                kind = msg[0]
                if kind == "step":
                    _, outs, rows, self._waiting, self._running = msg
                    for row in rows:
                        self._on_step(row)
                    self._deliver_step(outs)
                elif kind == "added":
                    self._waiting, self._running = msg[3], msg[4]
                    cmd = self._pending.pop(msg[1], None)
                    if cmd is not None:
                        self._streams[msg[1]] = cmd.stream  # type: ignore[attr-defined]
                        cmd.loop.call_soon_threadsafe(_resolve, cmd.future, msg[2], None)
                elif kind == "add_error":
                    cmd = self._pending.pop(msg[1], None)
                    if cmd is not None:
                        cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, msg[2])
                elif kind == "aborted":
                    self._waiting, self._running = msg[2], msg[3]
                    stream = self._streams.pop(msg[1], None)
                    if stream is not None:
                        self._deliver(stream, RequestOutput(
                            msg[1], [], "", True, "abort", 0, 0, SpecStats()))
                elif kind == "reply":
                    _, token, result, exc = msg
                    waiter = self._calls.get(token)
                    if waiter is not None:
                        waiter[0].call_soon_threadsafe(_resolve, waiter[1], result, exc)
                elif kind == "dead":
                    self._error = EngineDeadError(msg[1])
                    break
        except (EOFError, OSError) as exc:
            if not self._stop:
                code = self._core.proc.poll()
                self._error = EngineDeadError(
                    f"the engine process is gone (exit code {code}): {exc!r}")
        except BaseException as exc:  # noqa: BLE001 - report to every waiter, then die
            logger.exception("engine reader crashed")
            self._error = exc
        finally:
            self._fail_all(self._error or EngineDeadError("engine shut down"))
            for token, (loop, fut) in list(self._calls.items()):
                loop.call_soon_threadsafe(_resolve, fut, None, EngineDeadError("engine gone"))

    def _fail_all(self, exc: BaseException) -> None:
        dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"engine failed: {exc!r}")
        self._stop = True
        for cmd in list(self._pending.values()):
            cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, dead)
        self._pending.clear()
        super()._fail_all(dead)
