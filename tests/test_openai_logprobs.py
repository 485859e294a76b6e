"""OpenAI logprobs shapes (``actors.serve.openai_logprobs``) without Ray: the chosen token
outside the top N, -inf entries, chat bytes; and the replica -> body path with logprobs."""

from __future__ import annotations

import asyncio
import math

from actors.engine.types import TokenLogprob
from actors.serve.openai_logprobs import (NEG_INF_LOGPROB, chat_logprobs, choice_logprobs,
                                          completion_logprobs)

A = TokenLogprob(5, " a", b" a", -0.5, ((5, " a", b" a", -0.5), (7, " b", b" b", -1.0)), 0)
# a sampled token outside the top 2, and a top entry cut by top-k (-inf)
B = TokenLogprob(9, "\ufffd", b"\xe2\x80", -3.0,
                 ((7, " b", b" b", -0.2), (8, " c", b" c", -math.inf)), 2)


def test_completions_shape_keeps_the_chosen_token():
    out = completion_logprobs([A, B])
    assert out == {"tokens": [" a", "\ufffd"], "token_logprobs": [-0.5, -3.0],
                   "top_logprobs": [{" a": -0.5, " b": -1.0},
                                    {" b": -0.2, " c": NEG_INF_LOGPROB, "\ufffd": -3.0}],
                   "text_offset": [0, 2]}


def test_chat_shape_has_bytes_and_exactly_n_top():
    (a, b) = chat_logprobs([A, B])["content"]
    assert a == {"token": " a", "logprob": -0.5, "bytes": [32, 97], "top_logprobs": [
        {"token": " a", "logprob": -0.5, "bytes": [32, 97]},
        {"token": " b", "logprob": -1.0, "bytes": [32, 98]}]}
    assert b["bytes"] == [0xE2, 0x80] and [t["token"] for t in b["top_logprobs"]] == [" b", " c"]
    assert b["top_logprobs"][1]["logprob"] == NEG_INF_LOGPROB
    assert choice_logprobs(None, True) is None and choice_logprobs([], False)["tokens"] == []


def test_body_and_stream_carry_logprobs():
    from actors.serve.openai_response import ResponseContext, collect_body, sse_events
    from actors.serve.protocol import Delta, Finished

    async def messages():
        yield Delta([5], " a", [1.0], [A])
        yield Finished([9], "", [2.0], [B], finish_reason="length", num_output_tokens=2)

    ctx = ResponseContext("cmpl-x", "m", 0, False, 3)
    body = asyncio.run(collect_body(messages(), ctx))
    assert body["choices"][0]["logprobs"]["tokens"] == [" a", "\ufffd"]

    async def events():
        return [e async for e in sse_events(messages(), ResponseContext("c", "m", 0, True, 3),
                                            False)]
    import json

    chunks = [json.loads(e[6:]) for e in asyncio.run(events()) if e != "data: [DONE]\n\n"]
    assert chunks[0]["choices"][0]["logprobs"] is None   # role chunk
    assert [[c["token"] for c in ch["choices"][0]["logprobs"]["content"]] for ch in chunks[1:]] \
        == [[" a"], ["\ufffd"]]


def test_tokens_as_token_ids():
    from actors.serve.openai_request import parse_request

    assert parse_request({"model": "m", "prompt": "x", "return_tokens_as_token_ids": True},
                         False).tokens_as_ids
    out = completion_logprobs([A, B], as_ids=True)
    assert out["tokens"] == ["token_id:5", "token_id:9"]
    assert out["top_logprobs"][1] == {"token_id:7": -0.2, "token_id:8": NEG_INF_LOGPROB,
                                      "token_id:9": -3.0}
    (a, _) = chat_logprobs([A, B], as_ids=True)["content"]
    assert a["token"] == "token_id:5" and a["bytes"] == [32, 97]
    assert [t["token"] for t in a["top_logprobs"]] == ["token_id:5", "token_id:7"]
