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
written as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import math

NEG_INF_LOGPROB = -9999.0   # what a -inf logprob is written as (vLLM's value)


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else NEG_INF_LOGPROB


def completion_logprobs(entries: list) -> dict:
    """The completions ``choices[].logprobs`` object of ``entries`` ([TokenLogprob])."""
    tops = []
    for e in entries:
        top = {tok: _finite(lp) for _, tok, _, lp in e.top}
        top.setdefault(e.token, _finite(e.logprob))   # the chosen token, even outside top N
        tops.append(top)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": [e.text_offset for e in entries]}


def chat_logprobs(entries: list) -> dict:
    """The chat ``choices[].logprobs`` object of ``entries`` ([TokenLogprob])."""
    return {"content": [
        {"token": e.token, "logprob": _finite(e.logprob), "bytes": list(e.token_bytes),
         "top_logprobs": [{"token": tok, "logprob": _finite(lp), "bytes": list(raw)}
                          for _, tok, raw, lp in e.top]}
        for e in entries]}


def choice_logprobs(entries: list | None, chat: bool) -> dict | None:
    """``choices[].logprobs`` for a choice or chunk: None when logprobs were not asked."""
    if entries is None:
        return None
    return chat_logprobs(entries) if chat else completion_logprobs(entries)
