"""OpenAI-compatible HTTP front (FastAPI inside a Ray Serve ingress deployment).

Routes:

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (simple chat
  template, see ``chat_prompt``): ``stream`` true -> SSE ``data: {json}``
  lines ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a
  last chunk with ``usage`` (empty ``choices``).
- ``GET /v1/models``: the deployed strategies (``model`` = strategy name).
- ``GET /health``: 200 while the ingress runs (``?deep=1`` also asks every
  strategy; 503 if one does not answer).
- ``GET /specload/info``: per strategy max_model_len (tokens), waiting, running.
- ``GET /specload/step_log?strategy=&since=&limit=``: ``{"rows": [...]}``, the
  engine step rows (``configs.metric_names.STEP_LOG_COLUMNS`` + ``seq``) of
  every replica, from the app-wide ring buffer (``StepLogStore``; rows reach
  it within ~0.5 s; the oldest are dropped past its capacity). ``since`` is
  unix seconds (rows with ``ts > since``).

Extensions to OpenAI's body (vLLM does the same for token ids):

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
with ``Retry-After`` (seconds), strategy unavailable 503.
"""


import hmac
import json
import logging
import os
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from configs import metric_names as mn

logger = logging.getLogger("ray.serve")

api = FastAPI(title="specload", description="OpenAI-compatible speculative decoding service")


# ---------------------------------------------------------------- request schemas
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# Fields that change the output and that the engine does not implement: rejected
# unless they hold a neutral value (so stock clients sending defaults still work).
_UNSUPPORTED: dict[str, tuple] = {
    "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None), "logit_bias": (None, {}), "best_of": (1, None),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class _Common(BaseModel):
    """Fields shared by both endpoints (OpenAI defaults; top_k and ignore_eos as in vLLM).
    Unknown fields are ignored, like vLLM, so stock OpenAI clients work."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    logprobs: Any = None

    def sampling(self) -> dict:
        """SamplingParams kwargs (the replica validates them again)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": tuple(stop), "ignore_eos": self.ignore_eos}


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


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
# query parameter 422), gets the OpenAI error shape.


@api.exception_handler(StarletteHTTPException)
async def _http_error(request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                          kind, headers=getattr(exc, "headers", None))


@api.exception_handler(RequestValidationError)
async def _query_error(request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "body")) or None
    return error_response(400, f"{param}: {err.get('msg')}", param=param)


def _sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


def _validation_error(exc: ValidationError) -> JSONResponse:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if not isinstance(p, int)) or None
    return error_response(400, f"{param}: {err.get('msg')} (got {err.get('input')!r})",
                          param=param)


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    """HTTP front: parses OpenAI requests and streams from the strategy named by ``model``.

    strategies: {name: DeploymentHandle of a StrategyServer}. step_store:
    StepLogStore handle or None. retry_after_s: Retry-After on 429 (seconds).
    api_key: required bearer key (default ``$SPECLOAD_API_KEY`` here; none: open).
    """

    def __init__(self, strategies: dict, step_store: Any = None, retry_after_s: int = 1,
                 api_key: str | None = None):
        self._api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self._handles = dict(strategies)
        self._store = step_store
        self._retry_after_s = retry_after_s
        self._max_model_len: dict[str, int] = {}
        self._created = int(time.time())

    # ------------------------------------------------------------ info routes
    @api.get("/health")
    async def health(self, deep: int = 0):
        if deep:
            try:
                for h in self._handles.values():
                    await h.info.remote()
            except Exception as exc:  # a strategy not answering
                return error_response(503, f"strategy unavailable: {exc!r}", "server_error")
        return {"status": "ok", "strategies": sorted(self._handles)}

    @api.get("/v1/models")
    async def models(self, request: Request):
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        data = []
        for name in sorted(self._handles):
            data.append({"id": name, "object": "model", "created": self._created,
                         "owned_by": "specload",
                         "max_model_len": await self._model_len(name)})
        return {"object": "list", "data": data}

    @api.get("/specload/info")
    async def info(self, request: Request):
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        return {name: await h.info.remote() for name, h in sorted(self._handles.items())}

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
        if denied := api_key_error(request.headers.get("authorization"), self._api_key):
            return denied
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        for field, neutral in _UNSUPPORTED.items():
            if field in body and body[field] not in neutral:
                return error_response(400, f"{field} is not supported by specload (it would "
                                      f"change the output); drop it or send {neutral[0]!r}",
                                      param=field)
        for field in ("max_tokens", "max_completion_tokens", "n", "top_k", "seed"):
            if isinstance(body.get(field), (bool, float)):
                return error_response(400, f"{field} must be an integer, got "
                                      f"{body[field]!r}", param=field)
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as exc:
            return _validation_error(exc)
        if req.model not in self._handles:
            return self._unknown_model(req.model)
        if req.n != 1:
            return error_response(400, f"n must be 1 (got {req.n})", param="n")
        if req.logprobs not in (None, False, 0):
            return error_response(400, "logprobs is not supported", param="logprobs")
        if chat:
            prompt: Any = chat_prompt(req.messages)
            if req.max_completion_tokens is not None:
                req.max_tokens = req.max_completion_tokens
        else:
            if req.echo:
                return error_response(400, "echo is not supported", param="echo")
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    return error_response(400, "batched prompts are not supported; send "
                                          "one prompt per request", param="prompt")
                prompt = prompt[0]
            if isinstance(prompt, (str, list)) and len(prompt) == 0:
                return error_response(400, "prompt must not be empty", param="prompt")
        if req.max_tokens is None:
            req.max_tokens = 16
        params = req.sampling()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        gen = self._handles[req.model].options(stream=True).generate.remote(rid, prompt, params)
        try:
            first = await gen.__anext__()
        except Exception as exc:
            gen.cancel()
            logger.exception("strategy %s failed to admit", req.model)
            return error_response(503, f"strategy {req.model!r} unavailable: {exc!r}",
                                  "server_error", code="engine_unavailable")
        if "error" in first:
            e = first["error"]
            headers = ({"Retry-After": str(self._retry_after_s)} if e["status"] == 429
                       else None)
            return error_response(e["status"], e["message"], e["type"], e["param"],
                                  e["code"], headers)
        n_prompt = first["admitted"]
        ctx = dict(rid=rid, model=req.model, created=int(time.time()), chat=chat,
                   n_prompt=n_prompt)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(gen, ctx, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._collect(gen, ctx)

    @staticmethod
    def _usage(n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out}

    async def _collect(self, gen, ctx: dict):
        ids: list[int] = []
        text: list[str] = []
        last: dict = {}
        done = False
        try:
            async for chunk in gen:
                ids.extend(chunk["ids"])
                text.append(chunk["text"])
                if "finish_reason" in chunk:
                    last = chunk
                    done = True
        finally:
            if not done:
                gen.cancel()
        if last.get("finish_reason") == "error":
            return error_response(500, f"generation failed: {last.get('error')}",
                                  "server_error", code="engine_error")
        n_out = last.get("num_output_tokens", len(ids))
        body = ("".join(text))
        if ctx["chat"]:
            choice = {"index": 0, "message": {"role": "assistant", "content": body},
                      "finish_reason": last.get("finish_reason"), "token_ids": ids}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": body, "logprobs": None,
                      "finish_reason": last.get("finish_reason"), "token_ids": ids}
            obj = "text_completion"
        return {"id": ctx["rid"], "object": obj, "created": ctx["created"],
                "model": ctx["model"], "choices": [choice],
                "usage": self._usage(ctx["n_prompt"], n_out),
                mn.SPEC_DECODE_FIELD: last.get("spec_decode")}

    async def _stream(self, gen, ctx: dict, include_usage: bool):
        chat = ctx["chat"]
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": ctx["rid"], "object": obj, "created": ctx["created"],
                "model": ctx["model"]}
        done = False
        try:
            if chat:   # OpenAI sends the role first, without content
                yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                     "content": ""},
                                                 "finish_reason": None, "token_ids": []}]})
            async for chunk in gen:
                finish = chunk.get("finish_reason")
                if finish == "error":
                    done = True
                    yield _sse({"error": {"message": f"generation failed: {chunk.get('error')}",
                                          "type": "server_error", "param": None,
                                          "code": "engine_error"}})
                    break
                if not chunk["ids"] and not chunk["text"] and finish is None:
                    continue
                if chat:
                    choice = {"index": 0, "delta": {"content": chunk["text"]},
                              "finish_reason": finish, "token_ids": chunk["ids"]}
                else:
                    choice = {"index": 0, "text": chunk["text"], "logprobs": None,
                              "finish_reason": finish, "token_ids": chunk["ids"]}
                out = {**head, "choices": [choice]}
                if finish is not None:
                    done = True
                    out[mn.SPEC_DECODE_FIELD] = chunk.get("spec_decode")
                    yield _sse(out)
                    if include_usage:
                        yield _sse({**head, "choices": [],
                                    "usage": self._usage(ctx["n_prompt"],
                                                         chunk.get("num_output_tokens", 0)),
                                    mn.SPEC_DECODE_FIELD: chunk.get("spec_decode")})
                    break
                yield _sse(out)
            yield _sse("[DONE]")
        finally:
            if not done:   # client went away (or we failed): free the engine slot now
                gen.cancel()

