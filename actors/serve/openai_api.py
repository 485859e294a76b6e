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
- ``GET /specload/routes``: ``{"routes": {strategy: "/strategies/<name>" | null}}``,
  each strategy's own one-hop route relative to this ingress (null: the strategy
  is reachable only through the ``model`` field). In the one-hop layout
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
- ``GET /specload/step_log?strategy=&since=&limit=``: ``{"rows": [...]}``, the
  engine step rows (``configs.metric_names.STEP_LOG_COLUMNS`` + ``seq``) of
  every replica, from the app-wide ring buffer (``StepLogStore``; rows reach
  it within ~0.5 s; the oldest are dropped past its capacity). ``since`` is
  unix seconds (rows with ``ts > since``).

Extensions to OpenAI's body (vLLM does the same for token ids):

- streamed choices carry ``token_ts``: the engine's emit time (unix s) of each
  of the chunk's token ids (one speculative step's tokens share it).
- request fields ``stream_interval`` (tokens per chunk, vLLM's name; default:
  the strategy's) and ``stream_interval_ms`` (also a chunk once this many ms
  passed); the first token is never held back.
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
optional field (see the audit table below).
"""


import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt,
                      StrictStr, ValidationError)
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.engine.errors import InvalidRequest
from actors.serve.protocol import ErrorMessage, Finished
from configs import metric_names as mn

logger = logging.getLogger("ray.serve")

HEALTH_TIMEOUT_S = 2.0   # a strategy that does not answer /health within this is down (below
                         # the 3 s of cluster up's probe, cluster/local.py service_health)

api = FastAPI(title="specload", description="OpenAI-compatible speculative decoding service")


# ---------------------------------------------------------------- request schemas
# Audited against OpenAI's API reference (completions and chat completions, create):
# every optional field OpenAI marks "or null" accepts null, and null means the
# default (vLLM does the same). Types are strict: an integer field refuses 1.5,
# true and "1"; a number field refuses true and "0.5". The defaults:
#   field              completions        chat                 nullable
#   max_tokens         16                 rest of the context  yes
#   max_completion_tokens  -              rest of the context  yes (chat; wins over max_tokens)
#   temperature        1                  1                    yes
#   top_p              1                  1                    yes
#   n                  1 (only 1)         1 (only 1)           yes
#   stream             false              false                yes
#   stream_options     null               null                 yes (include_usage false)
#   stop               null               null                 yes (string or list)
#   seed               null               null                 yes
#   echo               false (only false) -                    yes
#   logprobs           null (unsupported) false (unsupported)  yes
#   top_k, ignore_eos  0 (off), false     same (vLLM extensions) yes
#   presence_penalty, frequency_penalty, repetition_penalty, logit_bias, best_of,
#   suffix, tools, tool_choice, response_format: accepted only at null or their
#   neutral value (``_UNSUPPORTED``); anything else is a 400 naming the field.
# Unknown fields (user, metadata, store, ...) are ignored, as vLLM does.


def _number(v: Any) -> Any:
    """JSON number only: bool and strings are refused (pydantic would coerce them)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"must be a number, got {v!r}")
    return float(v)


Number = Annotated[float, BeforeValidator(_number)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None


# Fields that change the output and that the engine does not implement: rejected
# unless they hold a neutral value (so stock clients sending defaults still work).
_UNSUPPORTED: dict[str, tuple] = {
    "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None), "logit_bias": (None, {}), "best_of": (1, None),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class _Common(BaseModel):
    """Fields shared by both endpoints (OpenAI's; top_k and ignore_eos as in vLLM).
    Every optional field is nullable; ``None`` means the default (table above).
    Unknown fields are ignored, like vLLM, so stock OpenAI clients work."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    logprobs: Any = None
    # specload extensions (vLLM's stream_interval, per request): tokens per streamed
    # chunk, or also a chunk once this many ms passed; None = the strategy's default
    stream_interval: StrictInt | None = Field(None, ge=1, le=4096)
    stream_interval_ms: Number | None = Field(None, gt=0, le=60_000)

    def sampling(self, max_tokens: int | None) -> dict:
        """SamplingParams kwargs, defaults filled in (the replica validates them again).
        max_tokens None: up to the end of the context (the engine fills it in)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"max_tokens": max_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "top_k": self.top_k or 0, "seed": self.seed, "stop": tuple(stop),
                "ignore_eos": bool(self.ignore_eos)}


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: model, prompt (text or token ids), SamplingParams kwargs."""

    model: str
    prompt: str | list[int]
    params: dict
    stream: bool
    include_usage: bool
    stream_interval: int | None = None       # tokens per chunk (None: the strategy's)
    stream_interval_ms: float | None = None  # or a chunk once this many ms passed


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """Validate an OpenAI request body (JSON already decoded).

    Raises InvalidRequest naming ``param`` for anything the engine cannot honour:
    a wrong type, an unsupported field at a non-neutral value, n != 1, logprobs,
    echo, batched or empty prompts. Unknown models are the caller's check.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    for name, neutral in _UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise InvalidRequest(f"{name} is not supported by specload (it would change the "
                                 f"output); drop it or send {neutral[0]!r}", param=name)
    try:
        req = (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ()) if not isinstance(p, int)
                         and p not in _PYDANTIC_TYPE_TAGS) or None
        raise InvalidRequest(f"{param}: {err.get('msg')} (got {err.get('input')!r})",
                             param=param) from None
    if req.n not in (None, 1):
        raise InvalidRequest(f"n must be 1 (got {req.n})", param="n")
    if req.logprobs not in (None, False, 0):
        raise InvalidRequest("logprobs is not supported", param="logprobs")
    if chat:
        prompt: Any = chat_prompt(req.messages)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)  # None: the rest of the context, as OpenAI / vLLM
    else:
        if req.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequest("batched prompts are not supported; send one prompt "
                                     "per request", param="prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        max_tokens = (COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None
                      else req.max_tokens)
    return ParsedRequest(req.model, prompt, req.sampling(max_tokens), bool(req.stream),
                         bool(req.stream_options and req.stream_options.include_usage),
                         req.stream_interval, req.stream_interval_ms)


# pydantic's union branch names in error locations (``stop.str``, ``prompt.list[int]``)
_PYDANTIC_TYPE_TAGS = {"str", "int", "list[str]", "list[int]", "list[list[int]]",
                       "function-before[_number(), float]", "dict[any,any]", "list[dict]",
                       "list[dict[any,any]]"}


def chat_prompt(messages: list[ChatMessage]) -> str:
    """Simple chat template: ``System: ..`` / ``User: ..`` / ``Assistant: ..``
    lines separated by blank lines, ending with ``Assistant:`` for the reply."""
    parts = []
    for m in messages:
        content = m.content
        if isinstance(content, list):   # [{"type": "text", "text": ...}]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        role = "System" if m.role in ("system", "developer") else m.role.capitalize()
        parts.append(f"{role}: {content or ''}")
    parts.append("Assistant:")
    return "\n\n".join(parts)


# ---------------------------------------------------------------- helpers
API_KEY_ENV = "SPECLOAD_API_KEY"


def api_key_error(authorization: str | None, expected: str | None) -> JSONResponse | None:
    """401 (OpenAI shape) unless ``authorization`` is ``Bearer <expected>``; None when
    it is, or when no key is configured. Constant-time comparison."""
    if not expected:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected.encode()):
        return None
    return error_response(401, "incorrect or missing API key: send the header "
                          "'Authorization: Bearer <key>'", code="invalid_api_key")


def error_response(status: int, message: str, err_type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """OpenAI-style error body."""
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


# Every error, including FastAPI's own (unknown route 404, wrong method 405, bad
# query parameter 422), gets the OpenAI error shape, on every specload FastAPI app
# (this ingress's and each strategy replica's own, ``actors.serve.deployments``).
async def _http_error(request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                          kind, headers=getattr(exc, "headers", None))


async def _query_error(request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "body")) or None
    return error_response(400, f"{param}: {err.get('msg')}", param=param)


def install_error_handlers(app: FastAPI) -> FastAPI:
    """Give ``app``'s framework errors (404, 405, bad query 422 -> 400) OpenAI's shape."""
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _query_error)
    return app


install_error_handlers(api)


def _sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


def health_response(states: dict[str, dict]) -> JSONResponse | dict:
    """``GET /health`` from each strategy's ``StrategyServer.health()`` answer:
    200 ``{"status": "ok"}`` when all are alive, else 503 naming the dead ones."""
    dead = {n: st.get("error") for n, st in sorted(states.items()) if not st.get("alive")}
    if dead:
        return error_response(503, f"engine down in strategies {sorted(dead)}: {dead}",
                              "server_error", code="engine_unavailable")
    return {"status": "ok", "strategies": sorted(states)}


# ---------------------------------------------------------------- replica messages -> HTTP
# Module-level so the whole replica -> body path is testable without Ray: ``messages``
# is the async iterator of ``actors.serve.protocol`` messages after ``Admitted``.
@dataclass(frozen=True)
class ResponseContext:
    """What a response body needs besides the messages."""

    rid: str
    model: str
    created: int
    chat: bool
    n_prompt: int


def _cancel(gen) -> None:
    """Stop the replica's stream (a Serve response generator, or any async generator)."""
    if hasattr(gen, "cancel"):
        gen.cancel()
    elif hasattr(gen, "aclose"):
        asyncio.ensure_future(gen.aclose())


def _usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out}


def replica_lost(exc: BaseException) -> bool:
    """True when ``exc`` means the strategy replica (its process or its node) died.

    Ray raises ``RayActorError`` (``ActorDiedError``, ``ActorUnavailableError``) to
    callers of a dead actor, ``WorkerCrashedError`` / ``NodeDiedError`` when its
    worker or node went away. Such requests get HTTP 503 / an error event with the
    OpenAI error code ``replica_lost``, so a load test counts them apart from
    engine errors (status ``replica_lost``).
    """
    from ray import exceptions as rex

    return isinstance(exc, (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError))


def lost_error(model: str, exc: BaseException) -> ErrorMessage:
    """The ErrorMessage of a request whose replica died (``replica_lost``)."""
    return ErrorMessage(503, f"{model}: replica lost: {exc!r}"[:500], "server_error", None,
                        mn.ERROR_CODE_REPLICA_LOST)


class guard_replica:
    """``messages`` (a replica's stream), ending with a ``replica_lost`` ErrorMessage if the
    replica dies part-way instead of a cut connection; other exceptions propagate.
    ``cancel()`` cancels the replica's stream (``_cancel``)."""

    def __init__(self, messages, model: str) -> None:
        self.messages, self.model = messages, model

    def cancel(self) -> None:
        _cancel(self.messages)

    async def __aiter__(self):
        try:
            async for msg in self.messages:
                yield msg
        except Exception as exc:  # noqa: BLE001  (classified; others re-raised)
            if not replica_lost(exc):
                raise
            logger.warning("strategy %s: replica lost mid-stream: %r", self.model, exc)
            yield lost_error(self.model, exc)


async def collect_body(messages, ctx: ResponseContext) -> dict | ErrorMessage:
    """The non-stream response body, or the ErrorMessage that ended the request."""
    ids: list[int] = []
    text: list[str] = []
    last: Finished | ErrorMessage | None = None
    try:
        async for msg in messages:
            if isinstance(msg, ErrorMessage):
                last = msg
                break
            ids.extend(msg.token_ids)
            text.append(msg.text)
            if isinstance(msg, Finished):
                last = msg
                break
    finally:
        if last is None:
            _cancel(messages)
    if last is None:
        return ErrorMessage(500, f"{ctx.model}: the replica ended the stream without "
                            "finishing", "server_error", None, "engine_error")
    if isinstance(last, ErrorMessage):
        return last
    body = "".join(text)
    if ctx.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": body},
                  "finish_reason": last.finish_reason, "token_ids": ids}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": body, "logprobs": None,
                  "finish_reason": last.finish_reason, "token_ids": ids}
        obj = "text_completion"
    return {"id": ctx.rid, "object": obj, "created": ctx.created, "model": ctx.model,
            "choices": [choice], "usage": _usage(ctx.n_prompt, last.num_output_tokens),
            mn.SPEC_DECODE_FIELD: last.spec_decode}


async def sse_events(messages, ctx: ResponseContext, include_usage: bool):
    """SSE lines of a streamed response; a request that fails part-way gets an
    OpenAI error event ``data: {"error": {...}}`` and then ``data: [DONE]``."""
    obj = "chat.completion.chunk" if ctx.chat else "text_completion"
    head = {"id": ctx.rid, "object": obj, "created": ctx.created, "model": ctx.model}
    done = False
    try:
        if ctx.chat:   # OpenAI sends the role first, without content
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""},
                                             "finish_reason": None, "token_ids": []}]})
        async for msg in messages:
            if isinstance(msg, ErrorMessage):   # the request failed part-way
                done = True
                yield _sse(msg.body())
                break
            finish = msg.finish_reason if isinstance(msg, Finished) else None
            if not msg.token_ids and not msg.text and finish is None:
                continue
            if ctx.chat:
                choice = {"index": 0, "delta": {"content": msg.text},
                          "finish_reason": finish, "token_ids": msg.token_ids}
            else:
                choice = {"index": 0, "text": msg.text, "logprobs": None,
                          "finish_reason": finish, "token_ids": msg.token_ids}
            if msg.token_ts and len(msg.token_ts) == len(msg.token_ids):
                choice[mn.TOKEN_TS_FIELD] = msg.token_ts
            out = {**head, "choices": [choice]}
            if finish is not None:
                done = True
                out[mn.SPEC_DECODE_FIELD] = msg.spec_decode
                yield _sse(out)
                if include_usage:
                    yield _sse({**head, "choices": [],
                                "usage": _usage(ctx.n_prompt, msg.num_output_tokens),
                                mn.SPEC_DECODE_FIELD: msg.spec_decode})
                break
            yield _sse(out)
        yield _sse("[DONE]")
    finally:
        if not done:   # client went away (or we failed): free the engine slot now
            _cancel(messages)


# ---------------------------------------------------------------- one generation route
# Shared by every HTTP front: the model-field ingress below (one Ray hop to the
# strategy replica per chunk) and each strategy replica's own route
# (``actors.serve.deployments.StrategyServer``, no hop).
async def read_request(request: Request, chat: bool,
                       api_key: str | None) -> ParsedRequest | JSONResponse:
    """API key, JSON body and validation of a generation request (``parse_request``).

    Returns the ParsedRequest, or the OpenAI error response to send (401, 400); the
    caller checks ``model`` against what it serves (404 ``model_not_found``).
    """
    if denied := api_key_error(request.headers.get("authorization"), api_key):
        return denied
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error_response(400, f"request body is not valid JSON: {exc}")
    try:
        return parse_request(body, chat)
    except InvalidRequest as exc:
        return error_response(400, str(exc), param=exc.param, code=exc.code)


def request_id(chat: bool) -> str:
    """OpenAI-style response id: ``chatcmpl-<hex>`` or ``cmpl-<hex>``."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def message_error(e: ErrorMessage, retry_after_s: int) -> JSONResponse:
    """The HTTP error of a replica's ErrorMessage; a 429 carries ``Retry-After`` (s)."""
    headers = {"Retry-After": str(retry_after_s)} if e.status == 429 else None
    return error_response(e.status, e.message, e.type, e.param, e.code, headers)


async def respond(start, req: ParsedRequest, rid: str, chat: bool, retry_after_s: int):
    """The HTTP answer to one generation request.

    start: ``() -> messages``, the replica's stream of ``actors.serve.protocol``
    messages (``StrategyServer.generate`` through a Serve handle, or called in the
    replica itself). The first message decides: an ErrorMessage becomes its HTTP
    error (429 with ``Retry-After: retry_after_s``), ``Admitted`` an SSE stream
    (``req.stream``) or a JSON body. A stream that cannot start is a 503
    (``replica_lost`` when the replica died, else ``engine_unavailable``).
    """
    gen = None
    try:
        gen = start()
        first = await gen.__anext__()
    except Exception as exc:  # classified below
        if gen is not None:
            _cancel(gen)
        logger.exception("strategy %s failed to admit", req.model)
        if replica_lost(exc):
            return message_error(lost_error(req.model, exc), retry_after_s)
        return error_response(503, f"strategy {req.model!r} unavailable: {exc!r}",
                              "server_error", code="engine_unavailable")
    if isinstance(first, ErrorMessage):
        return message_error(first, retry_after_s)
    ctx = ResponseContext(rid, req.model, int(time.time()), chat, first.num_prompt_tokens)
    messages = guard_replica(gen, req.model)
    if req.stream:
        return StreamingResponse(sse_events(messages, ctx, req.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    out = await collect_body(messages, ctx)
    return message_error(out, retry_after_s) if isinstance(out, ErrorMessage) else out


def model_card(name: str, created: int, max_model_len: int | None) -> dict:
    """One ``GET /v1/models`` entry (OpenAI's fields + ``max_model_len``, tokens)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "specload",
            "max_model_len": max_model_len}


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
                 api_key: str | None = None, routes: dict[str, str] | None = None):
        self._api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self._handles = {name: strategy_handle(ref) for name, ref in strategies.items()}
        self._routes = {name: (routes or {}).get(name) for name in sorted(strategies)}
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
        """``{"routes": {strategy: path | null}}``: each strategy's own one-hop route,
        relative to this ingress's base URL (``/strategies/<name>``: its replica answers
        ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and ``/health``
        there itself), or null when it is reachable only through the model field."""
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        return {"routes": self._routes}

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

    @api.get("/specload/step_log")
    async def step_log(self, request: Request, strategy: str | None = None, since: float | None = None,
                       limit: int | None = None):
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        if strategy is not None and strategy not in self._handles:
            return self._unknown_model(strategy)
        if self._store is None:
            return {"rows": []}
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
