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


class _Stats:
    def to_dict(self) -> dict:
        return {}


def _out(ids: list[int], finished: bool = False):
    """An engine output as the replica reads it (one step's new tokens)."""
    from types import SimpleNamespace

    import time

    return SimpleNamespace(new_token_ids=ids, token_ts=[time.time()] * len(ids),
                           new_text="x" * len(ids), logprobs=None, finished=finished,
                           finish_reason="length" if finished else None, error=None,
                           stats=_Stats(), num_output_tokens=0)


def _replica(stream_interval: int, stream_interval_ms: float | None, queue):
    """A StrategyReplica without Serve or an engine: ``queue`` is the request's output queue."""
    from types import SimpleNamespace

    from actors.serve.deployments import StrategyReplica as cls

    async def add_request(rid, prompt, sp):
        return 3, queue

    srv = cls.__new__(cls)
    srv.strategy, srv.stream_interval, srv.stream_interval_ms = ("autoregressive",
                                                                 stream_interval,
                                                                 stream_interval_ms)
    srv._metrics = SimpleNamespace(observe_request=lambda stats, *rest: None)
    srv.engine = SimpleNamespace(add_request=add_request, abort=lambda rid: None,
                                 shutdown=lambda timeout_s=None: None)
    return srv


@pytest.mark.parametrize("window_ms, request_fields, expect_chunks", [
    (50.0, {}, [1, 4, 1, 2]),                          # the deployment's window
    (None, {"stream_interval_ms": 50.0}, [1, 4, 1, 2]),  # the request's window
    (50.0, {"stream_interval": 1}, [1] * 8),        # a request's stream_interval 1: per step
    (None, {}, [1] * 8),                            # no window anywhere: per step
    # tokens only (the request's fields replace the deployment's window): every 3, as vLLM
    (50.0, {"stream_interval": 3}, [1, 3, 3, 1]),
])
def test_stream_window_chunks_by_time_and_never_holds_a_token_past_it(window_ms, request_fields,
                                                                      expect_chunks):
    """Outputs at 0, 5, 10, 15, 20 ms, a 300 ms stall, then three more 5 ms apart: with a
    50 ms window the first token leaves at once, the next four together by the window's end
    (not after the stall), the first after the stall at once (its window had passed), the
    last two with the finish. Every delta's token_ts keeps each token's own time."""
    import time

    from actors.serve.protocol import Admitted, Finished

    async def run():
        q: asyncio.Queue = asyncio.Queue()
        srv = _replica(1, window_ms, q)
        received: list[tuple[float, object]] = []

        async def produce():
            for i in range(5):
                q.put_nowait(_out([i]))
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.3)
            for i in range(5, 7):
                q.put_nowait(_out([i]))
                await asyncio.sleep(0.005)
            q.put_nowait(_out([7], finished=True))

        task = asyncio.create_task(produce())
        async for m in srv.generate("r", "p", {"max_tokens": 8}, **request_fields):
            received.append((time.time(), m))
        await task
        return received

    received = asyncio.run(run())
    assert isinstance(received[0][1], Admitted) and isinstance(received[-1][1], Finished)
    body = [m for _, m in received[1:]]
    assert [len(m.token_ids) for m in body] == expect_chunks
    assert [t for m in body for t in m.token_ids] == list(range(8))
    assert all(len(m.token_ts) == len(m.token_ids) for m in body)
    # no token waits for the stall: each leaves within the window (+ scheduling slack); by
    # token count alone token 4 waits for tokens 5 and 6, after the stall (vLLM's rule too)
    held = max(at - ts for at, m in received[1:] for ts in m.token_ts)
    assert (held > 0.25) if "stream_interval" in request_fields and expect_chunks[1] > 1 \
        else (held < 0.2), held


def test_chunk_rule():
    from actors.serve.deployments import chunk_rule

    assert chunk_rule(1, None) == (1.0, None)            # per engine step
    assert chunk_rule(4, None) == (4.0, None)
    assert chunk_rule(1, 50) == (float("inf"), 0.05)     # the window alone
    assert chunk_rule(4, 20) == (4.0, 0.02)              # whichever comes first
    assert chunk_rule(0, None) == (1.0, None)
