"""OpenAI request side: the request schemas (audited against OpenAI's API reference),
``parse_request`` -> ``ParsedRequest``, the chat template, the API key check,
OpenAI-shaped error bodies and ``read_request`` (key + JSON + validation of one
HTTP request). Shared by every HTTP front: the model-field ingress
(``actors.serve.openai_api``) and each strategy replica's own routes
(``actors.serve.deployments``).
"""


import hmac
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt,
                      StrictStr, ValidationError)
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.engine.errors import InvalidRequest
from actors.engine.types import SEED_MAX, SEED_MIN
from actors.serve.protocol import bounded_message

logger = logging.getLogger("ray.serve")

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
#   logprobs           null (int 0..20)   false (bool)         yes (completions: false = null)
#   top_logprobs       -                  0 (int 0..20)        yes (chat; > 0 needs logprobs)
#   top_k, ignore_eos  0 (off), false     same (vLLM extensions) yes
#   min_tokens         0                  0 (vLLM; <= max_tokens) yes
#   skip_special_tokens, spaces_between_special_tokens: true, true (vLLM) yes
#   return_tokens_as_token_ids  false (vLLM: logprobs tokens as "token_id:<id>") yes
#   presence_penalty, frequency_penalty, repetition_penalty, logit_bias, best_of,
#   suffix, tools, tool_choice, response_format: accepted only at null or their
#   neutral value (``_UNSUPPORTED``); anything else is a 400 naming the field.
# Unknown fields (user, metadata, store, ...) are ignored, as vLLM does.


MAX_ECHO_CHARS = 200   # at most this much of a client's value is quoted back in an error


def _short(value: Any) -> str:
    """``repr(value)`` cut to MAX_ECHO_CHARS (an error body never echoes a huge input)."""
    return bounded_message(repr(value), MAX_ECHO_CHARS)


def _number(v: Any) -> Any:
    """JSON number only: bool and strings are refused (pydantic would coerce them)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
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
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None   # vLLM: logprobs tokens as ids
    # specload extensions (vLLM's stream_interval, per request): tokens per streamed
    # chunk, and / or a chunk per window of this many ms; both None = the strategy's
    stream_interval: StrictInt | None = Field(None, ge=1, le=4096)
    stream_interval_ms: Number | None = Field(None, gt=0, le=60_000)

    def num_logprobs(self) -> int | None:
        """Top logprobs per position asked for (0..20), or None: no logprobs."""
        raise NotImplementedError

    def sampling(self, max_tokens: int | None) -> dict:
        """SamplingParams kwargs, defaults filled in (the replica validates them again).
        max_tokens None: up to the end of the context (the engine fills it in)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"max_tokens": max_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "top_k": self.top_k or 0, "seed": self.seed, "stop": tuple(stop),
                "ignore_eos": bool(self.ignore_eos), "logprobs": self.num_logprobs(),
                "min_tokens": self.min_tokens or 0,
                "skip_special_tokens": self.skip_special_tokens is not False,
                "spaces_between_special_tokens": self.spaces_between_special_tokens is not False}


def _false_is_null(v: Any) -> Any:
    """Completions ``logprobs``: false means null (clients that send chat's boolean)."""
    return None if v is False else v


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = None
    # OpenAI's completions logprobs: how many top tokens per position (0..20), or null
    logprobs: Annotated[StrictInt | None, BeforeValidator(_false_is_null)] = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None          # chat: whether to return logprobs
    top_logprobs: StrictInt | None = None       # and how many top tokens per position

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
    stream_interval_ms: float | None = None  # or a chunk per window of this many ms
    tokens_as_ids: bool = False   # vLLM's return_tokens_as_token_ids: "token_id:<id>"


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """Validate an OpenAI request body (JSON already decoded).

    Raises InvalidRequest naming ``param`` for anything the engine cannot honour:
    a wrong type, an unsupported field at a non-neutral value, n != 1, logprobs /
    top_logprobs outside 0..20 (or top_logprobs without logprobs: true), min_tokens
    < 0 or over max_tokens, echo, batched or empty prompts. Unknown models are the caller's check.
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
        raise InvalidRequest(f"{param}: {err.get('msg')} (got {_short(err.get('input'))})",
                             param=param) from None
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true (as OpenAI "
                             "and vLLM)", param="stream_options")
    if req.n not in (None, 1):
        raise InvalidRequest(f"n must be 1 (got {req.n})", param="n")
    _check_logprobs(req, chat)
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
    if req.min_tokens is not None and req.min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be an integer >= 0, got {req.min_tokens}",
                             param="min_tokens")
    if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({req.min_tokens}) must be <= max_tokens "
                             f"({max_tokens}{', the default' if req.max_tokens is None else ''})",
                             param="min_tokens")
    return ParsedRequest(req.model, prompt, req.sampling(max_tokens), bool(req.stream),
                         bool(req.stream_options and req.stream_options.include_usage),
                         req.stream_interval, req.stream_interval_ms,
                         bool(req.return_tokens_as_token_ids))


def _check_logprobs(req: "_Common", chat: bool) -> None:
    """Ranges of the logprobs fields (OpenAI's: 0..20), named as the client sent them."""
    from actors.engine.types import MAX_LOGPROBS

    name = "top_logprobs" if chat else "logprobs"
    n = req.top_logprobs if chat else req.logprobs
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {n}",
                             param=name)
    if chat and n and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true (as OpenAI and vLLM)",
                             param="top_logprobs")


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
    """OpenAI-style error body (the message bounded: ``protocol.bounded_message``)."""
    return JSONResponse({"error": {"message": bounded_message(message), "type": err_type,
                                   "param": param,
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


async def _server_error(request, exc: Exception) -> JSONResponse:
    """Anything a route did not handle: a 500 in OpenAI's shape, not Starlette's plain text
    (Starlette still logs the traceback)."""
    return error_response(500, f"{request.method} {request.url.path}: internal error: "
                          f"{type(exc).__name__}: {exc}", "server_error", code="internal_error")


def install_error_handlers(app: FastAPI) -> FastAPI:
    """Give ``app``'s framework errors (404, 405, bad query 422 -> 400) and any error a
    route did not handle (500) OpenAI's shape."""
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _query_error)
    app.add_exception_handler(Exception, _server_error)
    return app


# A generation request's body, at most (bytes). Ray Serve hands a request from the
# ingress to a strategy replica in one gRPC message of at most 4 MiB; a larger body
# failed there with a plain-text 500. No prompt this large fits a served context.
MAX_REQUEST_BYTES = 3 * 2**20


def _too_large(n: int) -> JSONResponse:
    return error_response(413, f"request body is {n} bytes; the limit is {MAX_REQUEST_BYTES} "
                          "bytes", code="request_too_large")


# ---------------------------------------------------------------- one generation route
# Shared by every HTTP front: the model-field ingress below (one Ray hop to the
# strategy replica per chunk) and each strategy replica's own route
# (``actors.serve.deployments.StrategyServer``, no hop).
async def read_request(request: Request, chat: bool,
                       api_key: str | None) -> ParsedRequest | JSONResponse:
    """API key, JSON body and validation of a generation request (``parse_request``).

    Returns the ParsedRequest, or the OpenAI error response to send (401, 413 over
    MAX_REQUEST_BYTES, 400); the
    caller checks ``model`` against what it serves (404 ``model_not_found``).
    """
    if denied := api_key_error(request.headers.get("authorization"), api_key):
        return denied
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        return _too_large(int(declared))
    raw = await request.body()
    if len(raw) > MAX_REQUEST_BYTES:
        return _too_large(len(raw))
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error_response(400, f"request body is not valid JSON: {exc}")
    try:
        return parse_request(body, chat)
    except InvalidRequest as exc:
        return error_response(400, str(exc), param=exc.param, code=exc.code)


def request_id(chat: bool) -> str:
    """OpenAI-style response id: ``chatcmpl-<hex>`` or ``cmpl-<hex>``."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


