"""The engine core in its own process (vLLM V1's ``EngineCoreProc`` design).

A replica that ran its engine loop on a thread beside its HTTP and streaming
code shared one GIL between the two: every streamed chunk the replica's event
loop built stalled the engine step (measured on the tiny target, 1 torch
thread, 4 streaming users: the engine thread's CPU time per step rose from
4.1 ms to 5.8-6.9 ms and the step's wall time from 4.2 to 6.6-8.1 ms). Here
the engine runs in a child process with its own interpreter:

- the child (``python -m actors.serve.engine_core FD``) builds the engine
  from an import path and a config, then loops: apply the commands that
  arrived (add, abort, call) between steps, run one step, send that step's
  outputs and step-log rows as one message. It blocks on its socket when no
  request is unfinished (0 % CPU when idle), and exits when the parent's end
  of the socket closes (the replica died, even by ``kill -9``) or on
  ``shutdown``;
- the parent (``EngineProcess``) starts it, waits until it is ready and
  exchanges pickled tuples with it over one ``socketpair``
  (``multiprocessing.connection.Connection`` framing).

``actors.serve.async_engine.ProcessAsyncLLMEngine`` is the asyncio side.

Messages, parent -> child: ``("add", request_id, prompt, SamplingParams)``,
``("abort", request_id)``, ``("call", token, method, args)``,
``("shutdown",)``. Child -> parent: ``("ready", facts)`` or ``("failed",
exception)`` once, then ``("added", request_id, n_prompt_tokens, num_waiting, num_running)``,
``("add_error", request_id, exception)``, ``("aborted", request_id, num_waiting,
num_running)``,
``("step", [RequestOutput], [step row], num_waiting, num_running)``,
``("reply", token, result, exception)`` and, when a step raised,
``("dead", message)`` before it exits.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from actors.engine.errors import EngineDead
from actors.engine.types import SyncEngine

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0     # model load on a slow node
CALLABLE_METHODS = ("memory", "reset_peak_memory", "reset_prefix_cache")   # what ("call", ...) may run


def import_object(path: str) -> Any:
    """Import ``"package.module:attr.sub"``; raises ValueError saying what was wrong."""
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"expected an import path 'module:attribute', got {path!r}")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def make_llm_engine(engine_config: dict) -> SyncEngine:
    """Default engine factory: ``EngineConfig(**engine_config)`` -> ``LLMEngine``."""
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**engine_config))


def picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (typed errors keep their fields), else a
    RuntimeError carrying its repr."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(repr(exc))


# ---------------------------------------------------------------- child side
def _apply(engine: SyncEngine, msg: tuple, conn: Connection) -> bool:
    """Apply one command; False on ``shutdown``."""
    kind = msg[0]
    if kind == "add":
        _, rid, prompt, params = msg
        try:
            n = engine.add_request(rid, prompt, params)
        except Exception as exc:  # InvalidRequest, QueueFull: the caller's problem
            conn.send(("add_error", rid, picklable(exc)))
        else:
            conn.send(("added", rid, n, engine.num_waiting, engine.num_running))
    elif kind == "abort":
        engine.abort_request(msg[1])
        conn.send(("aborted", msg[1], engine.num_waiting, engine.num_running))
    elif kind == "call":
        _, token, method, args = msg
        try:
            if method not in CALLABLE_METHODS:
                raise ValueError(f"engine method {method!r} cannot be called remotely")
            fn = getattr(engine, method, None)
            result = fn(*args) if fn is not None else None
            conn.send(("reply", token, result, None))
        except Exception as exc:  # noqa: BLE001 - the caller's answer
            conn.send(("reply", token, None, picklable(exc)))
    elif kind == "shutdown":
        return False
    return True


def core_loop(engine: SyncEngine, conn: Connection) -> None:
    """The child's loop: commands between steps, one message per step.

    Returns on ``shutdown``; raises EOFError / OSError when the parent is gone
    and whatever ``engine.step`` raises (after sending ``("dead", ...)``).
    """
    rows: list[dict] = []
    engine.on_step = rows.append
    while True:
        if not engine.has_unfinished_requests():
            conn.poll(None)          # idle: sleep until a command (or EOF) arrives
        while conn.poll(0):
            if not _apply(engine, conn.recv(), conn):
                return
        if not engine.has_unfinished_requests():
            continue
        try:
            outs = engine.step()
        except Exception as exc:
            conn.send(("dead", f"engine step failed: {exc!r}"))
            raise
        conn.send(("step", outs, rows, engine.num_waiting, engine.num_running))
        rows.clear()             # pickled by send already


def child_main(fd: int) -> int:
    """Entry of ``python -m actors.serve.engine_core FD``: read the spec, build the
    engine, say ready (or failed), run ``core_loop``. Exit status 0 on shutdown or
    when the parent went away, 1 when the engine could not start or crashed."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(message)s")
    conn = Connection(fd)
    spec = conn.recv()
    try:
        import torch

        torch.set_num_threads(int(spec.get("torch_threads") or 1))
        engine = import_object(spec["factory"])(spec["config"])
    except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it
        logger.exception("engine could not start")
        conn.send(("failed", picklable(exc)))
        return 1
    conn.send(("ready", {"max_model_len": int(engine.max_model_len), "pid": os.getpid()}))
    try:
        core_loop(engine, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0          # the parent closed its end: nobody to serve
    except Exception:  # noqa: BLE001 - reported as ("dead", ...) already
        logger.exception("engine step failed; the engine process exits")
        return 1
    return 0


# ---------------------------------------------------------------- parent side
class EngineProcess:
    """Start the engine core as a child process and talk to it.

    factory: import path of ``(engine_config: dict) -> engine`` (the sync engine
    API: add_request, abort_request, step, has_unfinished_requests, num_waiting,
    num_running, max_model_len, on_step). engine_config: its argument (pickled
    to the child). torch_threads: the child's torch intra-op threads.
    start_timeout_s: seconds to wait for the engine to load. python: the child's
    interpreter (default this one's); another venv's (vLLM's, ``engine.backend:
    vllm``) gets a clean environment (``actors.engine.vllm_backend.vllm_env``):
    PYTHONPATH = the repository root only, not this process's import path, which
    would drag this environment's site-packages into that venv.

    Raises what the factory raised in the child (e.g. FileNotFoundError for a
    missing model directory), or EngineDead when the child exits or does not
    get ready in time. ``conn`` is the parent's end (send from one thread at a
    time: ``send`` holds a lock; receive from one reader thread).
    """

    def __init__(self, factory: str, engine_config: dict, torch_threads: int = 1,
                 start_timeout_s: float = START_TIMEOUT_S, python: str | None = None):
        import threading

        parent, child = socket.socketpair()
        if python is None or python == sys.executable:
            python = sys.executable
            env = dict(os.environ)
            # the child imports what this process imports (a runtime_env working_dir,
            # the tests' fake engines): this process's import path, in order
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        else:
            from actors.engine.vllm_backend import vllm_env

            if not (os.path.isfile(python) and os.access(python, os.X_OK)):
                child.close()
                parent.close()
                raise EngineDead(f"the engine's python {python} is not an executable "
                                 "(engine.vllm_python / $SPECLOAD_VLLM_PYTHON)")
            env = vllm_env()
        self.proc = subprocess.Popen(
            [python, "-m", "actors.serve.engine_core", str(child.fileno())],
            pass_fds=[child.fileno()], env=env, close_fds=True)
        child.close()
        self.conn = Connection(parent.detach())
        self._send_lock = threading.Lock()
        self.send({"factory": factory, "config": engine_config,
                   "torch_threads": torch_threads})
        deadline = time.monotonic() + start_timeout_s
        while not self.conn.poll(0.5):
            if self.proc.poll() is not None:
                raise EngineDead(f"the engine process exited with code {self.proc.returncode} "
                                 "before it was ready (its log is in this replica's stderr)")
            if time.monotonic() > deadline:
                self.kill()
                raise EngineDead(f"the engine process was not ready within {start_timeout_s} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise EngineDead(f"the engine process exited with code {self.proc.wait(10)} "
                             "before it was ready") from None
        if msg[0] == "failed":
            self.proc.wait(10)
            raise msg[1]
        self.facts: dict = msg[1]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: Any) -> None:
        """Send one message (thread-safe); raises EngineDead when the child is gone."""
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise EngineDead(f"the engine process is gone: {exc!r}") from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the child to stop, wait ``timeout_s``, then kill it; close the socket."""
        if self.proc.poll() is None:
            try:
                self.send(("shutdown",))
                self.proc.wait(timeout_s)
            except (EngineDead, subprocess.TimeoutExpired):
                pass
            self.kill()
        try:
            self.conn.close()
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1])))
