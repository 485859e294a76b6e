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
#   stop_token_ids, include_stop_str_in_output  [], false (vLLM's)   yes
#   stream_options.continuous_usage_stats  false (vLLM's: usage on every chunk) yes
# Every other field of OpenAI's two requests and of vLLM 0.32's (``CompletionRequest``,
# ``ChatCompletionRequest``) is in ``_UNSUPPORTED`` (accepted only at null or its
# neutral value: a 400 naming it otherwise) or ``_LABELS`` (no effect on the output:
# accepted). A field in none of these tables is a 400 naming it: nothing is ignored.


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
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None
    # vLLM's: cumulative usage on every chunk (the load generator asks for it). Accepted;
    # specload's chunks carry their token count (spec_decode.num_tokens, token_ids) anyway;
    # with include_usage each chunk also carries the cumulative usage (vLLM's shape)
    continuous_usage_stats: StrictBool | None = None
    # OpenAI's: random padding against length side channels; none is sent (a label)
    include_obfuscation: StrictBool | None = None


# Fields that change the output and that the engine does not implement: rejected
# unless they hold a neutral value (so stock clients sending defaults still work).
# Both endpoints unless named in _CHAT_ONLY / _COMPLETIONS_ONLY; the first value is the
# one the error suggests.
_UNSUPPORTED: dict[str, tuple] = {
    # OpenAI's
    "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}), "best_of": (1, None), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "store": (False, None), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    # vLLM's extra sampling / request parameters
    "repetition_penalty": (1, 1.0, None), "use_beam_search": (False, None),
    "min_p": (0, 0.0, None), "watermarking": (None, False), "length_penalty": (1, 1.0, None),
    "truncate_prompt_tokens": (None,), "truncation_side": (None,),
    "allowed_token_ids": (None,), "prompt_logprobs": (None,), "logprob_token_ids": (None,),
    "bad_words": (None, []), "prompt_embeds": (None,), "structured_outputs": (None,),
    "priority": (0, None), "cache_salt": (None,), "return_token_offsets": (False, None),
    "routed_experts_prompt_start": (0, None), "mm_payload": (None, "tensors"),
    "return_mm_kwargs": (None, False), "kv_transfer_params": (None,),
    "ec_transfer_params": (None,), "vllm_xargs": (None, {}), "repetition_detection": (None,),
    "thinking_token_budget": (None,), "include_reasoning": (True, None),
    "add_generation_prompt": (True, None), "continue_final_message": (False, None),
    "documents": (None,), "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "media_io_kwargs": (None,), "mm_processor_kwargs": (None,),
    "return_prompt_text": (False, None),
}
# add_special_tokens: vLLM's default differs by endpoint; only that default (or null)
_ADD_SPECIAL_TOKENS_DEFAULT = {False: True, True: False}   # chat? -> default
# Fields that do not change what is generated nor what is returned: accepted, any value.
# user / safety_identifier / metadata / prompt_cache_key: OpenAI's labels; request_id,
# session_id: vLLM's labels; parallel_tool_calls acts only with tools (refused above);
# return_token_ids: vLLM's, the ids are always returned (choices[].token_ids).
_LABELS = frozenset({"user", "safety_identifier", "metadata", "prompt_cache_key",
                     "request_id", "session_id", "parallel_tool_calls", "return_token_ids"})
_CHAT_ONLY = frozenset({"messages", "max_completion_tokens", "top_logprobs", "tools",
                        "tool_choice", "functions", "function_call",
                        "store", "modalities", "audio", "prediction", "reasoning_effort",
                        "verbosity", "web_search_options", "include_reasoning",
                        "parallel_tool_calls", "add_generation_prompt",
                        "continue_final_message", "documents", "chat_template",
                        "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs",
                        "return_prompt_text", "metadata", "service_tier",
                        "safety_identifier", "prompt_cache_key"})
_COMPLETIONS_ONLY = frozenset({"prompt", "echo", "suffix", "best_of"})
# vLLM's chat request has its own echo (repeat the last message): not implemented
_CHAT_NEUTRAL: dict[str, tuple] = {"echo": (False, None)}


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
    stop_token_ids: list[StrictInt] | None = None         # vLLM's
    include_stop_str_in_output: StrictBool | None = None  # vLLM's

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
                "spaces_between_special_tokens": self.spaces_between_special_tokens is not False,
                "stop_token_ids": tuple(self.stop_token_ids or ()),
                "include_stop_str_in_output": bool(self.include_stop_str_in_output)}


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
    continuous_usage: bool = False   # vLLM's stream_options.continuous_usage_stats


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """Validate an OpenAI request body (JSON already decoded).

    Raises InvalidRequest naming ``param`` for anything the engine cannot honour:
    a wrong type, an unsupported field at a non-neutral value, n != 1, logprobs /
    top_logprobs outside 0..20 (or top_logprobs without logprobs: true), min_tokens
    < 0 or over max_tokens, echo, batched or empty prompts. Unknown models are the caller's check.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    _check_fields(body, chat)
    try:
        implemented = _implemented(chat)
        req = (ChatRequest if chat else CompletionRequest).model_validate(
            {k: v for k, v in body.items() if k in implemented})
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
    if req.stop_token_ids and any(t < 0 for t in req.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must be token ids >= 0, got "
                             f"{_short(req.stop_token_ids)}", param="stop_token_ids")
    return ParsedRequest(req.model, prompt, req.sampling(max_tokens), bool(req.stream),
                         bool(req.stream_options and req.stream_options.include_usage),
                         req.stream_interval, req.stream_interval_ms,
                         bool(req.return_tokens_as_token_ids),
                         bool(req.stream_options and req.stream_options.continuous_usage_stats))


def _implemented(chat: bool) -> set[str]:
    return set((ChatRequest if chat else CompletionRequest).model_fields)


def request_fields(chat: bool) -> dict[str, str]:
    """Every request field this endpoint knows -> "implemented", "label" (accepted,
    no effect on the output) or "neutral only" (a 400 unless null or its neutral
    value). Any other field is a 400."""
    other = _COMPLETIONS_ONLY if chat else _CHAT_ONLY
    out = {f: "implemented" for f in _implemented(chat)}
    out.update({f: "label" for f in _LABELS if f not in other})
    out.update({f: "neutral only" for f in (*_UNSUPPORTED, "add_special_tokens")
                if f not in other})
    if chat:
        out.update({f: "neutral only" for f in _CHAT_NEUTRAL})
    return out


def _check_fields(body: dict, chat: bool) -> None:
    """A 400 naming the first field the endpoint does not implement: unknown, of the
    other endpoint, or a not-implemented field at a value other than null / neutral."""
    known = request_fields(chat)
    for name, value in body.items():
        kind = known.get(name)
        if kind is None:
            where = "chat completions" if chat else "completions"
            raise InvalidRequest(f"{name} is not a field specload implements for {where} "
                                 "(it would be ignored); drop it", param=str(name))
        if kind != "neutral only" or value is None:
            continue
        neutral = ((_ADD_SPECIAL_TOKENS_DEFAULT[chat],) if name == "add_special_tokens"
                   else _CHAT_NEUTRAL[name] if chat and name in _CHAT_NEUTRAL
                   else _UNSUPPORTED[name])
        if not any(isinstance(value, bool) == isinstance(v, bool) and value == v
                   for v in neutral if v is not None):
            raise InvalidRequest(f"{name} is not supported by specload (it would change the "
                                 f"output); drop it or send {neutral[0]!r}", param=name)


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


