"""A fake OpenAI-compatible streaming server with known timings (tests and ``bench.loadgen_timing``).

Run: ``python -m loadgen.tools.fake_server [--port 0] [--ttft-ms 100] [--gap-ms 20] ...``;
the last stdout line is the base URL (an ephemeral port by default, 127.0.0.1 only).

Each ``POST /v1/completions`` streams: an empty-text first chunk at once (the
"role chunk" peers wrongly stamp TTFT on), then after ``--ttft-ms`` the first
content chunk (one token), then chunks of ``--tokens-per-chunk`` tokens every
``--gap-ms`` until ``max_tokens``, then a ``choices: []`` chunk with ``usage``
and ``spec_decode`` stats, then ``[DONE]``. The text is words ``"t "``, so
re-tokenising it would give a different count than ``usage`` (on purpose).

Test hooks: ``--fail-every K`` answers every K-th request with HTTP 500;
``--disconnect-every K`` drops every K-th stream after two chunks;
``--drain-after N`` drains like a replica being shut down: when the N-th completion
arrives the server stops listening (new connections are refused) and every response
from then on closes its connection when it ends, so a keep-alive client's next request
meets a refused connection;
``POST /fake/stall?s=S`` holds every write for S seconds; ``GET /fake/timings``
returns the server-side truth per request keyed by ``"<model>:<seed>"``:
receive, first-content-write and end times (unix s). ``/v1/models`` and
``/specload/step_log`` are served too.

``--strategy-routes`` also serves specload's one-hop routes: ``GET
/specload/routes`` lists ``/strategies/<model>`` per model and ``POST
/strategies/<model>/v1/completions`` streams as above; the truth records the
path each request came on (``path``). ``--direct-listener URL`` adds that URL as every
model's one replica listener (``direct``, as a specload service with Serve's direct
ingress lists it); ``GET /strategies/<model>/health`` answers on a server with one-hop
routes, so a second fake server can stand in for that listener.

``stream_options.continuous_usage_stats`` (vLLM's) puts the cumulative ``usage`` on every
content chunk; ``--no-continuous-usage`` ignores it (usage only at the end).

``--batch-interval-ms 50`` holds the engine's steps (one per ``--gap-ms``) and flushes them as
one chunk per 50 ms, as Ray Serve LLM's stream batching does (ray #59681); the per-step truth is
in ``/fake/timings`` (``step_ts``).

``--model-gap-ms a=5,b=40`` gives those models their own chunk gap (a faster or slower
"strategy"; the racing tests need two that differ); ``--jitter-ms J`` adds to every gap a
random delay (exponential, mean J ms, seeded), so request times vary as a real engine's do.

``--api-key K`` requires ``Authorization: Bearer K`` on ``/v1/*`` and
``/specload/*`` (401 in OpenAI's error shape otherwise); ``GET /fake/auth``
counts accepted and rejected requests and echoes the ``X-*`` headers seen.
``--tls-cert F --tls-key F`` serves https.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
import urllib.request
from typing import Any, Iterator

from aiohttp import web

from configs import metric_names as M
from configs.paths import PACKAGE_ROOT


class FakeServer:
    """Holds the timing knobs (ms) and the recorded truth."""

    def __init__(self, ttft_ms: float, gap_ms: float, tokens_per_chunk: int, models: list[str],
                 fail_every: int = 0, disconnect_every: int = 0, per_chunk_tokens: bool = False,
                 prompt_tokens: int = 17, api_key: str | None = None,
                 strategy_routes: bool = False, model_gap_ms: dict[str, float] | None = None,
                 jitter_ms: float = 0.0, direct_listener: str = "", drain_after: int = 0,
                 batch_interval_ms: float = 0.0, continuous_usage: bool = True) -> None:
        self.batch_s = batch_interval_ms / 1000.0
        self.continuous_usage = continuous_usage
        self.ttft_s = ttft_ms / 1000.0
        self.gap_s = gap_ms / 1000.0
        self.model_gap_s = {m: g / 1000.0 for m, g in (model_gap_ms or {}).items()}
        self.jitter_s = jitter_ms / 1000.0
        self.rng = random.Random(0)
        self.tpc = max(1, tokens_per_chunk)
        self.models = models
        self.fail_every = fail_every
        self.disconnect_every = disconnect_every
        self.per_chunk_tokens = per_chunk_tokens
        self.prompt_tokens = prompt_tokens
        self.count = 0
        self.in_flight = 0
        self.stall_until = 0.0
        self.truth: dict[str, dict] = {}
        self.steps: list[dict] = []
        self.api_key = api_key
        self.strategy_routes = strategy_routes
        self.direct_listener = direct_listener
        self.drain_after = drain_after
        self.listening: asyncio.AbstractServer | None = None   # set by _serve; closed on drain
        self.auth = {"accepted": 0, "rejected": 0, "x_headers": {}}

    @web.middleware
    async def _check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith(("/v1/", "/specload/", "/strategies/")):
            self.auth["x_headers"].update({k: v for k, v in request.headers.items() if k.lower().startswith("x-")})
            if self.api_key is not None:
                if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                    self.auth["rejected"] += 1
                    return web.json_response({"error": {"message": "invalid API key", "type": "invalid_request_error",
                                                        "param": None, "code": "invalid_api_key"}}, status=401)
                self.auth["accepted"] += 1
        return await handler(request)

    async def auth_counts(self, request: web.Request) -> web.Response:
        return web.json_response(self.auth)

    async def _hold(self) -> None:
        while (left := self.stall_until - time.time()) > 0:
            await asyncio.sleep(left)

    def _chunk(self, model: str, text: str, n: int | None = None, finish: str | None = None,
               usage_so_far: int | None = None) -> bytes:
        choice: dict = {"index": 0, "text": text, "finish_reason": finish}
        obj: dict = {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                     "model": model, "choices": [choice]}
        if n is not None and self.per_chunk_tokens:
            obj[M.SPEC_DECODE_FIELD] = {"num_tokens": n}
        if usage_so_far is not None:   # vLLM's continuous_usage_stats: cumulative usage per chunk
            obj["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": usage_so_far,
                            "total_tokens": self.prompt_tokens + usage_so_far}
        return f"data: {json.dumps(obj)}\n\n".encode()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        recv = time.time()
        body = await request.json()
        self.count += 1
        k = self.count
        model = body.get("model", "fake")
        gap_s = self.model_gap_s.get(model, self.gap_s)
        n_total = int(body.get("max_tokens", 16))
        opts = body.get("stream_options") or {}
        continuous = bool(self.continuous_usage and isinstance(opts, dict) and opts.get("continuous_usage_stats"))
        key = f"{model}:{body.get('seed')}"
        if self.fail_every and k % self.fail_every == 0:
            self.truth[key] = {"recv_ts": recv, "status": "error"}
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        if self.drain_after and k >= self.drain_after:
            if self.listening is not None and self.listening.is_serving():
                self.listening.close()   # stop accepting; open connections finish their request
            resp.force_close()           # Connection: close
        await resp.prepare(request)
        self.in_flight += 1
        try:
            await resp.write(self._chunk(model, ""))          # empty role chunk, immediately
            await asyncio.sleep(self.ttft_s)
            await self._hold()
            await resp.write(self._chunk(model, "t ", 1, usage_so_far=1 if continuous else None))
            first = time.time()
            streamed = await self._stream_steps(request, resp, model, k, (key, recv), gap_s, n_total,
                                                continuous, first)
            if streamed is None:   # --disconnect-every: the connection was dropped mid-stream
                return resp
            sent, step_ts = streamed
            drafts = len(step_ts)   # one verification per engine step after the first token
            final = self._final(model, sent, drafts, sent - 1 - drafts, gap_s)
            await resp.write(self._chunk(model, "", None, "length"))
            await resp.write(final)
            await resp.write(b"data: [DONE]\n\n")
            end = time.time()
            self.truth[key] = {"recv_ts": recv, "first_content_ts": first, "end_ts": end,
                               "completion_tokens": sent, "status": "ok", "path": request.path,
                               "step_ts": step_ts,   # engine steps after the first token (unix s)
                               # the sampling / output-length fields the client sent
                               "sent": {f: body.get(f) for f in ("temperature", "top_p", "seed",
                                                                  "ignore_eos", "min_tokens")}}
            await resp.write_eof()
            return resp
        except (ConnectionResetError, asyncio.CancelledError):  # the client went away (cancelled)
            return resp
        finally:
            self.in_flight -= 1

    async def _stream_steps(self, request: web.Request, resp: web.StreamResponse, model: str, k: int,
                            truth_key: tuple[str, float], gap_s: float, n_total: int, continuous: bool,
                            first: float) -> tuple[int, list[float]] | None:
        """The engine steps after the first token: one chunk of ``--tokens-per-chunk`` tokens
        every ``gap_s`` (+ jitter; held back and coalesced with ``--batch-interval-ms``), a step
        row each. Returns (tokens sent, step times unix s), or None when request ``k`` is one
        ``--disconnect-every`` drops (its truth recorded)."""
        key, recv = truth_key
        sent, chunks = 1, 1
        buffered, next_flush = 0, first + self.batch_s   # --batch-interval-ms: steps held back
        step_ts: list[float] = []
        while sent < n_total:
            await asyncio.sleep(gap_s + (self.rng.expovariate(1.0 / self.jitter_s) if self.jitter_s else 0.0))
            await self._hold()
            n = min(self.tpc, n_total - sent)
            if self.disconnect_every and k % self.disconnect_every == 0 and chunks >= 2:
                self.truth[key] = {"recv_ts": recv, "status": "disconnected"}
                request.transport.close()
                return None
            sent += n
            step_ts.append(time.time())
            if self.batch_s:
                # Ray Serve LLM-style stream batching: the engine's steps are coalesced and
                # flushed as one chunk per interval (and at the end)
                buffered += n
                now = time.time()
                if now < next_flush and sent < n_total:
                    continue
                while next_flush <= now:
                    next_flush += self.batch_s
                n, buffered = buffered, 0
            await resp.write(self._chunk(model, "t " * n, n, usage_so_far=sent if continuous else None))
            chunks += 1
            self.steps.append(self._step_row(model, n, gap_s, sent))
        return sent, step_ts

    def _step_row(self, model: str, n: int, gap_s: float, context: int) -> dict:
        """The step-log row of one engine step that emitted ``n`` tokens."""
        return {M.STEP_TS: time.time(), M.STEP_STRATEGY: model, M.STEP_MODEL: model,
                M.STEP_REPLICA: "fake-0",
                M.STEP_BATCH_SIZE: self.in_flight, M.STEP_PREFILL_TOKENS: 0,
                M.STEP_VERIFICATION_TOKENS: self.tpc, M.STEP_DRAFT_TOKENS: self.tpc - 1,
                M.STEP_ACCEPTED_TOKENS: n - 1, M.STEP_EMITTED_TOKENS: n,
                M.STEP_PREFILL_EMITTED_TOKENS: 0,
                M.STEP_MS: gap_s * 1000, M.STEP_DRAFT_MS: 0.1,
                M.STEP_VERIFY_MS: gap_s * 1000, M.STEP_QUEUE_DEPTH: 0,
                M.STEP_PADDED_TOKENS: self.tpc, M.STEP_CONTEXT_TOKENS: context,
                M.STEP_CPU_MS: 0.1, M.STEP_VERIFY_CPU_MS: 0.05}

    def _final(self, model: str, sent: int, drafts: int, accepted: int, gap_s: float) -> bytes:
        """The usage chunk after the last token: usage and the request's speculative stats."""
        final = {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                 "model": model, "choices": [],
                 "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": sent,
                           "total_tokens": self.prompt_tokens + sent},
                 M.SPEC_DECODE_FIELD: {
                     M.NUM_DRAFTS: drafts, M.NUM_DRAFT_TOKENS: drafts * (self.tpc - 1),
                     M.NUM_ACCEPTED_TOKENS: accepted,
                     M.NUM_ACCEPTED_TOKENS_PER_POS: [drafts] * (self.tpc - 1),
                     M.ACCEPTANCE_LENGTH: M.acceptance_length(drafts, accepted),
                     M.DRAFT_MS: 0.1 * drafts, M.VERIFY_MS: gap_s * 1000 * drafts,
                     M.QUEUE_MS: 0.0}}
        return f"data: {json.dumps(final)}\n\n".encode()

    async def models_list(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def routes(self, request: web.Request) -> web.Response:
        listed: dict = {"routes": {m: f"/strategies/{m}" for m in self.models}}
        if self.direct_listener:
            listed["direct"] = {m: [self.direct_listener] for m in self.models}
        return web.json_response(listed)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def step_log(self, request: web.Request) -> web.Response:
        strategy = request.query.get("strategy")
        since = float(request.query.get("since", 0))
        rows = [r for r in self.steps if r[M.STEP_TS] >= since and (not strategy or r[M.STEP_MODEL] == strategy)]
        return web.json_response({"rows": rows})

    async def stall(self, request: web.Request) -> web.Response:
        self.stall_until = time.time() + float(request.query.get("s", 1.0))
        return web.json_response({"stall_until": self.stall_until})

    async def timings(self, request: web.Request) -> web.Response:
        return web.json_response(self.truth)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._check_key])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models_list)
        app.router.add_get("/specload/step_log", self.step_log)
        if self.strategy_routes:
            app.router.add_get("/specload/routes", self.routes)
            app.router.add_post("/strategies/{model}/v1/completions", self.completions)
            app.router.add_get("/strategies/{model}/health", self.health)
        app.router.add_post("/fake/stall", self.stall)
        app.router.add_get("/fake/timings", self.timings)
        app.router.add_get("/fake/auth", self.auth_counts)
        return app


async def _serve(server: FakeServer, host: str, port: int, tls: tuple[str, str] | None = None) -> None:
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    ctx = None
    if tls is not None:
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(*tls)
    site = web.TCPSite(runner, host, port, backlog=1024, ssl_context=ctx)
    await site.start()
    server.listening = site._server  # type: ignore[assignment]
    actual = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"{'https' if tls else 'http'}://{host}:{actual}", flush=True)
    await asyncio.Event().wait()


@contextlib.contextmanager
def running(*args: str, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """Run the fake server in a subprocess (its own CPU and event loop); yields its base URL."""
    proc = subprocess.Popen([sys.executable, "-m", "loadgen.tools.fake_server", *args], stdout=subprocess.PIPE,
                            text=True, cwd=str(PACKAGE_ROOT))
    try:
        deadline = time.time() + startup_timeout_s
        line = ""
        while time.time() < deadline and not line.startswith("http"):
            line = (proc.stdout.readline() if proc.stdout else "").strip()
            if proc.poll() is not None:
                raise RuntimeError(f"fake server exited with {proc.returncode}")
        if not line.startswith("http"):
            raise RuntimeError("fake server printed no URL")
        yield line
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def get_json(url: str, method: str = "GET") -> Any:
    """Small helper for the test hooks (``/fake/timings``, ``/fake/stall``)."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    import ssl

    ctx = ssl._create_unverified_context() if url.startswith("https://") else None  # self-signed test cert
    with urllib.request.urlopen(req, timeout=30, context=ctx) as r:  # noqa: S310 (127.0.0.1 only)
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="fake OpenAI-compatible streaming server (127.0.0.1)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = ephemeral")
    ap.add_argument("--ttft-ms", type=float, default=100.0, help="delay before the first content chunk, ms")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="gap between content chunks, ms")
    ap.add_argument("--tokens-per-chunk", type=int, default=3)
    ap.add_argument("--models", default=",".join(M.STRATEGIES))
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--disconnect-every", type=int, default=0)
    ap.add_argument("--per-chunk-tokens", action="store_true",
                    help="add spec_decode.num_tokens to every content chunk")
    ap.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1 and /specload")
    ap.add_argument("--strategy-routes", action="store_true",
                    help="also serve /specload/routes and /strategies/<model>/v1/completions")
    ap.add_argument("--direct-listener", default="",
                    help="with --strategy-routes: list this URL as every model's replica "
                         "listener (GET /specload/routes direct)")
    ap.add_argument("--drain-after", type=int, default=0,
                    help="at the N-th completion stop listening and close each connection after its "
                         "response (a replica shutting down)")
    ap.add_argument("--model-gap-ms", default="", help="per-model chunk gap, 'model=ms,model=ms' "
                    "(others: --gap-ms)")
    ap.add_argument("--jitter-ms", type=float, default=0.0,
                    help="mean of a random (exponential, seeded) delay added to every chunk gap, ms")
    ap.add_argument("--batch-interval-ms", type=float, default=0.0,
                    help="coalesce the engine's steps into one chunk per this many ms (Ray Serve LLM's "
                         "stream batching, 50 ms there); 0 = a chunk per step")
    ap.add_argument("--no-continuous-usage", dest="continuous_usage", action="store_false",
                    help="ignore stream_options.continuous_usage_stats (usage only at the end, as a "
                         "server without vLLM's extension); by default it is honoured as vLLM does")
    ap.add_argument("--tls-cert", default=None, help="PEM certificate: serve https (with --tls-key)")
    ap.add_argument("--tls-key", default=None)
    a = ap.parse_args(argv)
    srv = FakeServer(a.ttft_ms, a.gap_ms, a.tokens_per_chunk, a.models.split(","), a.fail_every,
                     a.disconnect_every, a.per_chunk_tokens, api_key=a.api_key,
                     strategy_routes=a.strategy_routes,
                     model_gap_ms={k.strip(): float(v) for k, v in
                                   (p.split("=", 1) for p in a.model_gap_ms.split(",") if p.strip())},
                     jitter_ms=a.jitter_ms, direct_listener=a.direct_listener,
                     drain_after=a.drain_after, batch_interval_ms=a.batch_interval_ms,
                     continuous_usage=a.continuous_usage)
    try:
        asyncio.run(_serve(srv, a.host, a.port, (a.tls_cert, a.tls_key) if a.tls_cert else None))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
