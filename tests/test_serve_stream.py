"""``stream_interval`` and per-token ``token_ts`` through the strategy replica and the
SSE writer, in-process (no Ray)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from configs import metric_names as mn  # noqa: E402


def test_stream_interval_holds_tokens_and_keeps_their_times():
    from actors.serve.deployments import StrategyReplica as cls   # the plain class
    from actors.serve.openai_response import ResponseContext, sse_events
    from actors.serve.protocol import Admitted, Finished

    async def run():
        srv = cls.__new__(cls)
        cls.__init__(srv, "autoregressive", {"strategy": "autoregressive", "max_model_len": 4096,
                                             # 10 ms steps: a consumer starved for a step by
                                             # a busy box would merge deltas (by design)
                                             "step_ms": 10, "max_num_seqs": 4},
                     "tests.fake_engine:make_fake_engine")
        try:
            sizes = {}
            for interval in (1, 4):
                msgs = [m async for m in srv.generate(
                    f"r{interval}", "hello world", {"max_tokens": 10, "temperature": 0,
                                                    "ignore_eos": True}, interval)]
                assert isinstance(msgs[0], Admitted) and isinstance(msgs[-1], Finished)
                body = msgs[1:]
                assert sum(len(m.token_ids) for m in body) == 10
                assert all(len(m.token_ts) == len(m.token_ids) for m in body)
                sizes[interval] = [len(m.token_ids) for m in body]
            gen = srv.generate("r-sse", "hello", {"max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True}, 2)
            await gen.__anext__()   # Admitted
            ctx = ResponseContext("cmpl-x", "autoregressive", 0, False, 1)
            text = "".join([e async for e in sse_events(gen, ctx, False)])
            return sizes, text
        finally:
            srv.engine.shutdown()

    sizes, text = asyncio.run(run())
    assert sizes[1] == [1] * 10       # one engine step (one token) per delta
    # the first token at once, then >= 4 per delta; the rest with the finish
    assert sizes[4][0] == 1 and all(n >= 4 for n in sizes[4][1:-1]) and len(sizes[4]) <= 4
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [len(c["token_ids"]) for c in choices] == [1, 2, 2, 1]
    assert all(len(c[mn.TOKEN_TS_FIELD]) == len(c["token_ids"]) for c in choices)
