"""OpenAI-compatible HTTP front (FastAPI inside a Ray Serve ingress deployment).

Routes:

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (simple chat
  template, see ``chat_prompt``): ``stream`` true -> SSE ``data: {json}``
  lines ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a
  last chunk with ``usage`` (empty ``choices``).
- ``GET /v1/models``: the deployed strategies (``model`` = strategy name).
- ``GET /health``: 200 when every strategy's engine loop is alive; 503
  (OpenAI error shape, naming the strategies) when one is dead or does not
  answer, so an operator or a load balancer sees it at once (the replica's own
  Serve health check fails too, and Serve replaces it).
- ``GET /specload/info``: per strategy max_model_len (tokens), waiting, running.
- ``GET /specload/routes``: ``{"routes": {strategy: "/strategies/<name>" | null},
  "direct": {strategy: [base URL]}}``, each strategy's own one-hop route relative to
  this ingress (null: the strategy is reachable only through the ``model`` field), and
  under Ray Serve's direct ingress (``python -m cluster up --direct-ingress``) its
  replicas' own HTTP listeners, the same route under each (``direct_ingress_urls``). In the one-hop layout
  (``actors.serve.app.split_application``; ``python -m cluster up``) each strategy
  is its own Serve application whose replica answers ``POST .../v1/completions``,
  ``POST .../v1/chat/completions``, ``GET .../v1/models`` and ``GET .../health``
  itself, with this module's code (``read_request``, ``respond``): same
  validation, bodies, errors, 429 + Retry-After and API key, and no second Ray
  hop per streamed chunk. ``model`` there must name that strategy (else 404).
- ``GET /specload/memory?strategy=``: ``{strategy: report}``, one replica's weight,
  KV-cache (allocated, bytes per token, tokens held now / at peak) and process
  memory (``LLMEngine.memory``); ``POST /specload/memory/reset_peak`` restarts
  the peak counters (the load generator calls it before each strategy).
- ``GET /specload/step_log?strategy=&since=&after=&limit=``: ``{"rows": [...],
  "next": int, "total": int}``, the engine step rows
  (``configs.metric_names.STEP_LOG_COLUMNS`` + ``seq``) of every replica, from
  the app-wide ring buffer (``StepLogStore``; rows reach it within ~0.5 s; the
  oldest are dropped past its capacity). ``since`` is unix seconds (rows with
  ``ts > since``); ``after`` is the ``next`` of an earlier answer: every row that
  arrived since, whatever its ts (``total``: the strategy's rows ever stored, so
  rows evicted before a reader fetched them can be counted).
  With ``limit``: the newest ``limit`` rows, ``{"rows": [...]}`` only.

Extensions to OpenAI's body (vLLM does the same for token ids):

- streamed choices carry ``token_ts``: the engine's emit time (unix s) of each
  of the chunk's token ids (one speculative step's tokens share it).
- request fields ``stream_interval`` (tokens per chunk, vLLM's name) and
  ``stream_interval_ms`` (a chunk per window of this many ms, Ray Serve LLM's
  stream batching; with both, whichever comes first); either replaces the
  strategy's chunking (default: a 50 ms window); the first token and the last
  are never held back (``actors.serve.deployments.chunk_rule``).
- request fields ``logprobs`` (completions: 0..20; chat: bool with ``top_logprobs``
  0..20), ``min_tokens``, ``skip_special_tokens`` and ``spaces_between_special_tokens``
  (vLLM's); the logprobs shapes are OpenAI's (``actors.serve.openai_logprobs``), per
  chunk when streaming.
- every choice carries ``token_ids``: the token ids of this chunk (stream) or
  of the whole completion, so a client gets exact per-chunk token counts
  (ITL per token) without re-tokenizing.
- ``spec_decode`` (top level): the request's speculative-decoding stats
  (num_drafts, num_draft_tokens, num_accepted_tokens,
  num_accepted_tokens_per_pos, acceptance_length, draft_ms, verify_ms,
  queue_ms, num_steps) in the non-stream response, in the stream chunk
  carrying ``finish_reason`` and in the usage chunk.

API key (optional): with ``ingress.api_key`` in the Serve config, or
``SPECLOAD_API_KEY`` in the replica's environment, every route but ``/health``
wants ``Authorization: Bearer <key>`` and answers 401 otherwise
(``code: invalid_api_key``, OpenAI's shape), as vLLM / SGLang ``--api-key`` do.

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
malformed JSON or invalid parameters 400 (prompt over the context:
``code: context_length_exceeded``), unknown model 404, engine queue full 429
with ``Retry-After`` (seconds), a fault while serving one request 500
(``code: engine_error``; in a stream, an error event then ``[DONE]``), engine
down 503. The replicas talk to this ingress in the typed messages of
``actors.serve.protocol``; explicit ``null`` means the default for every
optional field (see the audit table in ``actors.serve.openai_request``).
"""


import asyncio
import math
import logging
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve


from actors.serve.openai_request import (API_KEY_ENV, api_key_error, error_response,
                                         install_error_handlers, read_request, request_id)
from actors.serve.openai_response import health_response, model_card, respond

logger = logging.getLogger("ray.serve")


HEALTH_TIMEOUT_S = 2.0   # a strategy that does not answer /health within this is down (below
                         # the 3 s of cluster up's probe, cluster/local.py service_health)

api = install_error_handlers(FastAPI(title="specload",
                                     description="OpenAI-compatible speculative decoding service"))


STRATEGY_ROUTES = "/strategies"   # a strategy's own route: <ingress>/strategies/<name>/v1/...


def strategy_handle(ref: Any) -> Any:
    """A StrategyServer handle from ``ref``: a DeploymentHandle as is, or
    ``(app_name, deployment_name)`` of a strategy running as its own Serve
    application (the one-hop layout, ``actors.serve.app.applications``). The
    handle is made without asking the controller (the applications deploy
    together, so that one may not exist yet); calls wait until it does."""
    if not isinstance(ref, (tuple, list)):
        return ref
    app_name, deployment = ref
    return serve.get_deployment_handle(deployment, app_name, _check_exists=False)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def direct_ingress_enabled(env: dict[str, str] | None = None) -> bool:
    """Serve's direct ingress is on in this process's Ray (Serve's own rule,
    ``ray/serve/_private/constants.py``): ``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``, or
    ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` unless the former is set to something else, or
    ``RAY_SERVE_ENABLE_HA_PROXY=1``."""
    env = os.environ if env is None else env
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        return True
    if env.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1":
        return env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1") == "1"
    return env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1"


async def direct_ingress_urls(routes: dict[str, str | None]) -> dict[str, list[str]]:
    """{strategy: [base URL of each of its replicas' own HTTP listeners]} under Ray Serve's
    direct ingress (``configs.serve_config.DIRECT_INGRESS_ENV``; ``python -m cluster up
    --direct-ingress``), for the strategies with a one-hop route in ``routes`` ({name:
    route prefix}). A listener's URL is ``http://host:port``: the HTTP options' host when it
    is a loopback address (the listener binds it), else the replica's node address; the
    strategy's own route (``/strategies/<name>/v1/...``) is under it. {} without direct
    ingress, on a Ray without it, or when Serve's controller does not answer within
    ``HEALTH_TIMEOUT_S`` (it reads the controller's target groups, as Serve's own HAProxy
    manager does: not a public Ray API)."""
    by_prefix = {prefix: name for name, prefix in routes.items() if prefix}
    if not by_prefix or not direct_ingress_enabled():
        return {}
    try:
        from ray.serve.context import _get_global_client

        controller = _get_global_client()._controller
        groups, http = await asyncio.wait_for(asyncio.gather(
            controller.get_target_groups.remote(), controller.get_http_config.remote()),
            HEALTH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - an older Ray, or a controller not answering
        logger.warning("direct ingress listeners not listed: %r", exc)
        return {}
    host = getattr(http, "host", None)
    out: dict[str, list[str]] = {}
    for group in groups or []:
        name = by_prefix.get(getattr(group, "route_prefix", None))
        protocol = getattr(group, "protocol", None)
        if name is None or getattr(protocol, "value", protocol) != "HTTP":
            continue
        for t in getattr(group, "targets", []):
            where = host if host in LOOPBACK_HOSTS else t.ip
            where = f"[{where}]" if ":" in where else where   # an IPv6 address
            out.setdefault(name, []).append(f"http://{where}:{t.port}")
    return {name: sorted(urls) for name, urls in sorted(out.items())}


# Everything the routes call is defined above the ingress class: serve.ingress
# serializes the FastAPI app (and the globals its routes see) when the class is
# decorated, so a helper defined below it would be missing in the replica.
@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    """HTTP front: parses OpenAI requests and streams from the strategy named by ``model``.

    strategies: {name: DeploymentHandle of a StrategyServer, or ``(app_name,
    deployment_name)`` of a strategy deployed as its own application}. step_store:
    StepLogStore handle or None. retry_after_s: Retry-After on 429 (seconds).
    api_key: required bearer key (default ``$SPECLOAD_API_KEY`` here; none: open).
    routes: {name: path of the strategy's own one-hop route, relative to this
    ingress's route prefix (``/strategies/<name>``)}; listed by ``GET /specload/routes``.
    """

    def __init__(self, strategies: dict, step_store: Any = None, retry_after_s: int = 1,
                 api_key: str | None = None, routes: dict[str, str] | None = None,
                 autoscaling: list[str] | None = None):
        self._api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self._handles = {name: strategy_handle(ref) for name, ref in strategies.items()}
        self._routes = {name: (routes or {}).get(name) for name in sorted(strategies)}
        self._autoscaling = {name: name in (autoscaling or []) for name in sorted(strategies)}
        self._store = step_store
        self._retry_after_s = retry_after_s
        self._max_model_len: dict[str, int] = {}
        self._created = int(time.time())

    # ------------------------------------------------------------ info routes
    @api.get("/health")
    async def health(self, deep: int = 0):
        """200 when every strategy's engine loop is alive; 503 naming the strategies
        whose engine is dead or that do not answer within HEALTH_TIMEOUT_S.
        (``deep`` is accepted for compatibility: every call asks every strategy.)"""
        async def one(name, h):
            try:
                return name, await asyncio.wait_for(h.health.remote(), HEALTH_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - not answering counts as down
                return name, {"alive": False, "error": f"not answering: {exc!r}"}

        return health_response(dict(await asyncio.gather(
            *(one(n, h) for n, h in self._handles.items()))))

    @api.get("/v1/models")
    async def models(self, request: Request):
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        return {"object": "list", "data": [
            model_card(name, self._created, await self._model_len(name))
            for name in sorted(self._handles)]}

    @api.get("/specload/routes")
    async def routes(self, request: Request):
        """``{"routes": {strategy: path | null}, "direct": {strategy: [base URL]},
        "autoscaling": {strategy: bool}}``: each strategy's own one-hop route, relative to
        this ingress's base URL (``/strategies/<name>``: its replica answers
        ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and ``/health`` there
        itself), or null when it is reachable only through the model field; under Serve's
        direct ingress, the base URLs of its replicas' own HTTP listeners (the same route
        under each; no Serve proxy in the path; ``direct_ingress_urls``), {} without it;
        and whether Serve may change its replica count (``autoscaling_config``): a load
        pinned to one replica's listener would never reach the replicas added."""
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        return {"routes": self._routes, "direct": await direct_ingress_urls(self._routes),
                "autoscaling": self._autoscaling}

    @api.get("/specload/info")
    async def info(self, request: Request):
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        return {name: await h.info.remote() for name, h in sorted(self._handles.items())}

    @api.get("/specload/memory")
    async def memory(self, request: Request, strategy: str | None = None):
        """{strategy: memory report} of one replica per strategy (weights, KV cache, process)."""
        return await self._memory(request, strategy, reset=False)

    @api.post("/specload/memory/reset_peak")
    async def memory_reset_peak(self, request: Request, strategy: str | None = None):
        """Restart the peak KV / CUDA counters; returns the reports from just before."""
        return await self._memory(request, strategy, reset=True)

    async def _memory(self, request: Request, strategy: str | None, reset: bool):
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        if strategy is not None and strategy not in self._handles:
            return self._unknown_model(strategy)
        names = [strategy] if strategy is not None else sorted(self._handles)
        out = {}
        for name in names:
            try:
                out[name] = await self._handles[name].memory.remote(reset)
            except Exception as exc:  # a strategy not answering: say so, keep the others
                out[name] = {"error": repr(exc)}
        return out

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request, model: str | None = None):
        """vLLM's ``POST /reset_prefix_cache``, per strategy: ``{"success": bool, "strategies":
        {name: bool}}`` for ``model`` (a strategy name) or every strategy. Each strategy's
        call reaches one of its replicas (the one Serve routes it to). 404 for an unknown
        model, with the OpenAI error body."""
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        if model is not None and model not in self._handles:
            return self._unknown_model(model)
        done = {}
        for name in [model] if model is not None else sorted(self._handles):
            try:
                done[name] = bool(await self._handles[name].reset_prefix_cache.remote())
            except Exception:  # noqa: BLE001 - a strategy not answering: not reset
                done[name] = False
        return {"success": all(done.values()), "strategies": done}

    @api.get("/specload/step_log")
    async def step_log(self, request: Request, strategy: str | None = None, since: float | None = None,
                       limit: int | None = None, after: int | None = None):
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        if strategy is not None and strategy not in self._handles:
            return self._unknown_model(strategy)
        if limit is not None and limit < 0:
            return error_response(400, f"limit must be >= 0, got {limit}", param="limit")
        if after is not None and after < 0:
            return error_response(400, f"after must be >= 0 (a page's next), got {after}",
                                  param="after")
        if since is not None and not math.isfinite(since):
            return error_response(400, f"since must be a finite unix time, got {since}",
                                  param="since")
        if self._store is None:
            return {"rows": []}
        if limit is None:       # a page: rows by arrival, with the cursor of the next one
            return await self._store.page.remote(strategy, since, after)
        return {"rows": await self._store.query.remote(strategy, since, limit)}

    async def _model_len(self, name: str) -> int | None:
        if name not in self._max_model_len:
            try:
                self._max_model_len[name] = (await self._handles[name].info.remote())[
                    "max_model_len"]
            except Exception:
                return None
        return self._max_model_len[name]

    def _unknown_model(self, model: str) -> JSONResponse:
        return error_response(404, f"model {model!r} does not exist; deployed: "
                              f"{sorted(self._handles)} (GET /v1/models)",
                              param="model", code="model_not_found")

    # ------------------------------------------------------------ generation
    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool):
        req = await read_request(request, chat, self._api_key)
        if isinstance(req, JSONResponse):
            return req
        if req.model not in self._handles:
            return self._unknown_model(req.model)
        rid = request_id(chat)
        handle = self._handles[req.model]
        return await respond(lambda: handle.options(stream=True).generate.remote(
            rid, req.prompt, req.params, req.stream_interval, req.stream_interval_ms),
            req, rid, chat, self._retry_after_s)
