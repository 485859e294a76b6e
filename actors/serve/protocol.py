"""The typed replica protocol: what a strategy replica streams to the HTTP ingress.

``StrategyServer.generate`` (``actors/serve/deployments.py``) yields, in order:

1. ``Admitted`` (the request is in the engine) or ``ErrorMessage`` (refused:
   nothing follows);
2. zero or more ``Delta`` (new token ids and text; one may carry several
   tokens when the consumer fell behind);
3. ``Finished`` (the last delta, with the finish reason and the request's
   speculative-decoding stats) or ``ErrorMessage`` (the request failed part-way;
   the other requests of the replica go on).

``OpenAIIngress`` (``actors/serve/openai_api.py``) matches on the type; errors
carry their HTTP status, OpenAI ``type``, ``param`` and ``code`` from
``ErrorMessage.from_exception`` on the replica side, so the ingress never
parses a message. The messages are plain frozen dataclasses (Ray pickles them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.engine.errors import EngineDead, InvalidRequest, QueueFull


@dataclass(frozen=True)
class Admitted:
    """The request joined the engine's queue. num_prompt_tokens: its prompt length."""

    num_prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    """New output: token_ids [n] and their text (may be "" while a character or a
    possible stop string is held back)."""

    token_ids: list[int]
    text: str
    # engine emit time (unix s) of each token_ids entry (tokens of one speculative
    # step share it); [] when the engine does not stamp them
    token_ts: list[float] = field(default_factory=list)
    # one actors.engine.types.TokenLogprob per token_ids entry when the request asked
    # for logprobs; None otherwise
    logprobs: list | None = None


@dataclass(frozen=True)
class Finished(Delta):
    """The last delta. finish_reason: "stop" | "length" | "abort"; num_output_tokens:
    completion tokens the user received; spec_decode: ``SpecStats.to_dict()``."""

    finish_reason: str = "stop"
    num_output_tokens: int = 0
    spec_decode: dict = field(default_factory=dict)
    # vLLM's stop_reason: the stop token id or stop string that ended it (None: EOS, length)
    stop_reason: int | str | None = None


MAX_ERROR_MESSAGE_CHARS = 1000   # an error body quotes at most this much (a client's 2 MB
                                 # stop string must not come back in a 2 MB 400)


def bounded_message(message: str, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters, saying how long it was."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... (cut; {len(message)} chars)"


@dataclass(frozen=True)
class ErrorMessage:
    """A refused or failed request, already in OpenAI's error terms.

    status: HTTP status (400, 429, 500, 503); type: OpenAI error type
    (``invalid_request_error``, ``rate_limit_error``, ``server_error``);
    param: the request field at fault; code: e.g. ``context_length_exceeded``,
    ``queue_full``, ``engine_unavailable``, ``engine_error``.
    """

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, strategy: str) -> "ErrorMessage":
        """Map the typed engine errors (``actors.engine.errors``); anything else is a
        500 ``engine_error`` (a bug or fault while serving this one request)."""
        if isinstance(exc, InvalidRequest):
            return cls(400, str(exc), "invalid_request_error", exc.param, exc.code)
        if isinstance(exc, QueueFull):
            return cls(429, f"{strategy} is overloaded: {exc}", "rate_limit_error", None,
                       "queue_full")
        if isinstance(exc, EngineDead):
            return cls(503, f"{strategy} engine unavailable: {exc}", "server_error", None,
                       "engine_unavailable")
        return cls(500, f"{strategy}: generation failed: {exc}", "server_error", None,
                   "engine_error")

    def body(self) -> dict:
        """OpenAI's error body ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": bounded_message(self.message), "type": self.type,
                          "param": self.param, "code": self.code}}


ReplicaMessage = Admitted | Delta | Finished | ErrorMessage
