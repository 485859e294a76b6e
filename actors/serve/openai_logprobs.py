"""OpenAI's logprobs shapes from the engine's ``TokenLogprob`` entries
(``actors.engine.types``), for one choice or one streamed chunk of it.

Completions (``logprobs: N``), as OpenAI's legacy completions and vLLM::

    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
     "text_offset": [int]}

``top_logprobs[i]`` holds the N most likely tokens at position i plus the
chosen one (so up to N + 1 entries, as OpenAI documents: "the API will always
return the logprob of the sampled token"). ``text_offset[i]``: characters of
the choice's text before token i (absolute, also in a stream).

Chat (``logprobs: true, top_logprobs: N``), as OpenAI's chat completions::

    {"content": [{"token": str, "logprob": float, "bytes": [int],
                  "top_logprobs": [{"token", "logprob", "bytes"}] (N, best first)}]}

A -inf logprob (a token top-k / top-p removed, listed among the top N) is
written as -9999.0, as vLLM does: JSON has no infinity. With vLLM's
``return_tokens_as_token_ids`` every token string is ``"token_id:<id>"`` (exact
ids: two ids with one text, such as split UTF-8 pieces, stay apart); ``bytes``
stay the token's own.
"""

from __future__ import annotations

import math

NEG_INF_LOGPROB = -9999.0   # what a -inf logprob is written as (vLLM's value)


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else NEG_INF_LOGPROB


def _name(token_id: int, token: str, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else token


def completion_logprobs(entries: list, as_ids: bool = False) -> dict:
    """The completions ``choices[].logprobs`` object of ``entries`` ([TokenLogprob])."""
    tops = []
    for e in entries:
        top = {_name(t, tok, as_ids): _finite(lp) for t, tok, _, lp in e.top}
        # the chosen token, even outside the top N
        top.setdefault(_name(e.token_id, e.token, as_ids), _finite(e.logprob))
        tops.append(top)
    return {"tokens": [_name(e.token_id, e.token, as_ids) for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": [e.text_offset for e in entries]}


def chat_logprobs(entries: list, as_ids: bool = False) -> dict:
    """The chat ``choices[].logprobs`` object of ``entries`` ([TokenLogprob])."""
    return {"content": [
        {"token": _name(e.token_id, e.token, as_ids), "logprob": _finite(e.logprob),
         "bytes": list(e.token_bytes),
         "top_logprobs": [{"token": _name(t, tok, as_ids), "logprob": _finite(lp),
                           "bytes": list(raw)} for t, tok, raw, lp in e.top]}
        for e in entries]}


def choice_logprobs(entries: list | None, chat: bool, as_ids: bool = False) -> dict | None:
    """``choices[].logprobs`` for a choice or chunk: None when logprobs were not asked.
    as_ids: tokens as ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``)."""
    if entries is None:
        return None
    return chat_logprobs(entries, as_ids) if chat else completion_logprobs(entries, as_ids)
