"""Typed errors shared by the engine, the replicas and the HTTP ingress.

The engine raises them, the strategy replica turns them into an
``actors.serve.protocol.ErrorMessage`` and the ingress into an OpenAI error
body; nobody classifies an error by parsing its message or its class name.

- ``InvalidRequest`` (a ``ValueError``): the request is wrong; HTTP 400 with
  ``param`` (the request field at fault) and an optional ``code`` such as
  ``context_length_exceeded``.
- ``QueueFull``: the engine's waiting queue is at ``max_waiting``; HTTP 429
  with ``Retry-After``.
- ``EngineDead``: the engine thread stopped (crash or shutdown); HTTP 503, and
  the replica's health check fails so Serve replaces it.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A bad request parameter. ``param``: the OpenAI request field at fault (or None);
    ``code``: an OpenAI error code (e.g. ``context_length_exceeded``) or None."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code

    def __reduce__(self):  # keep param / code across pickling (Ray)
        return (type(self), (str(self), self.param, self.code))


class QueueFull(RuntimeError):
    """``max_waiting`` requests already wait for a batch slot (HTTP 429)."""


def queue_full(waiting: int, running: int, max_num_seqs: int, max_waiting: int) -> bool:
    """Whether a new request finds ``max_waiting`` requests already waiting for a batch slot:
    the waiting ones the free slots (``max_num_seqs - running``) will not take at the next
    step. A request that a free slot takes at once does not wait, so ``max_waiting = 0``
    serves up to ``max_num_seqs`` requests and answers 429 beyond them."""
    return waiting - max(0, max_num_seqs - running) >= max_waiting


class EngineDead(RuntimeError):
    """The engine loop has stopped; no request can be served (HTTP 503)."""


def check_prompt_ids(ids: list, vocab_size: int, max_model_len: int, *,
                     check_vocab: bool = True) -> None:
    """The prompt checks every engine makes (embedded and vLLM-backed): token ids ints in
    ``[0, vocab_size)`` (with ``check_vocab``), not empty, shorter than ``max_model_len``
    (one token must fit). Raises InvalidRequest (param "prompt"; code
    ``context_length_exceeded`` for a prompt too long)."""
    if check_vocab and any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"prompt token ids must be ints in [0, {vocab_size})", param="prompt")
    if not ids:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequest(f"prompt is {len(ids)} tokens; max_model_len is {max_model_len}, "
                             "which leaves no room to generate", param="prompt",
                             code="context_length_exceeded")
