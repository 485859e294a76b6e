"""OpenAI response side: a replica's typed messages (``actors.serve.protocol``) ->
an SSE stream or a JSON body, errors -> HTTP (``respond``), ``/health`` and
``/v1/models`` bodies. Module-level, so the whole replica -> body path is testable
without Ray; shared by the model-field ingress and the strategy replicas' routes.
"""


import asyncio
import json
import logging
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse

from actors.serve.openai_logprobs import choice_logprobs
from actors.serve.protocol import ErrorMessage, Finished
from configs import metric_names as mn

logger = logging.getLogger("ray.serve")

from actors.serve.openai_request import ParsedRequest, error_response

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
    tokens_as_ids: bool = False   # logprobs tokens as "token_id:<id>" (vLLM's option)
    continuous_usage: bool = False   # vLLM's continuous_usage_stats: usage on every chunk


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
    lps: list | None = None    # TokenLogprob entries, when the request asked for them
    last: Finished | ErrorMessage | None = None
    try:
        async for msg in messages:
            if isinstance(msg, ErrorMessage):
                last = msg
                break
            ids.extend(msg.token_ids)
            text.append(msg.text)
            if msg.logprobs is not None:
                lps = [] if lps is None else lps
                lps.extend(msg.logprobs)
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
                  "logprobs": choice_logprobs(lps, True, ctx.tokens_as_ids),
                  "finish_reason": last.finish_reason, "stop_reason": last.stop_reason,
                  "token_ids": ids}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": body, "logprobs": choice_logprobs(lps, False, ctx.tokens_as_ids),
                  "finish_reason": last.finish_reason, "stop_reason": last.stop_reason,
                  "token_ids": ids}
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
    n_out = 0   # completion tokens streamed so far (continuous_usage_stats)
    try:
        if ctx.chat:   # OpenAI sends the role first, without content
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""},
                                             "logprobs": None, "finish_reason": None,
                                             "token_ids": []}]})
        async for msg in messages:
            if isinstance(msg, ErrorMessage):   # the request failed part-way
                done = True
                yield _sse(msg.body())
                break
            finish = msg.finish_reason if isinstance(msg, Finished) else None
            if not msg.token_ids and not msg.text and finish is None:
                continue
            lps = choice_logprobs(msg.logprobs, ctx.chat, ctx.tokens_as_ids)   # this chunk's tokens only
            if ctx.chat:
                choice = {"index": 0, "delta": {"content": msg.text}, "logprobs": lps,
                          "finish_reason": finish, "token_ids": msg.token_ids}
            else:
                choice = {"index": 0, "text": msg.text, "logprobs": lps,
                          "finish_reason": finish, "token_ids": msg.token_ids}
            if finish is not None:   # vLLM's: the stop token id / stop string, or null
                choice["stop_reason"] = msg.stop_reason
            if msg.token_ts and len(msg.token_ts) == len(msg.token_ids):
                choice[mn.TOKEN_TS_FIELD] = msg.token_ts
            out = {**head, "choices": [choice]}
            n_out += len(msg.token_ids)
            if ctx.continuous_usage and include_usage:   # vLLM's: cumulative, every chunk
                out["usage"] = _usage(ctx.n_prompt, msg.num_output_tokens
                                      if finish is not None else n_out)
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
    ctx = ResponseContext(rid, req.model, int(time.time()), chat, first.num_prompt_tokens,
                          req.tokens_as_ids, req.continuous_usage)
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

