"""AsyncLLMEngine on the fake engine (no Ray): streaming, abort on disconnect, errors."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.engine.types import SamplingParams
from actors.serve.async_engine import AsyncLLMEngine, EngineDeadError
from configs import metric_names as mn
from actors.engine.errors import QueueFull as QueueFullError
from tests.fake_engine import FakeEngine
from tests.serve_fixtures import use_real_engine


def make(**cfg) -> AsyncLLMEngine:
    return AsyncLLMEngine(FakeEngine({"strategy": "ngram", "max_model_len": 4096, "step_ms": 2,
                                      **cfg}))


async def collect(eng, rid, prompt, **kw):
    text, ids, last = "", [], None
    async for out in eng.generate(rid, prompt, SamplingParams(**kw)):
        text += out.new_text
        ids += out.new_token_ids
        last = out
    return text, ids, last


def test_generate_matches_engine_and_batches():
    eng = make(max_num_seqs=8)

    async def main():
        return await asyncio.gather(*[collect(eng, f"r{i}", f"prompt number {i}", max_tokens=20,
                                              ignore_eos=True) for i in range(8)])

    try:
        results = asyncio.run(main())
        ref = FakeEngine({"strategy": "autoregressive", "max_model_len": 4096, "step_ms": 0})
        for i, (text, ids, last) in enumerate(results):
            ref.add_request("x", f"prompt number {i}", SamplingParams(max_tokens=20,
                                                                       ignore_eos=True))
            want = []
            while ref.has_unfinished_requests():
                want += [t for o in ref.step() for t in o.new_token_ids]
            assert ids == want and last.finished and last.finish_reason == "length"
            assert last.stats.num_drafts > 0
        rows = eng.step_log()
        assert max(r[mn.STEP_BATCH_SIZE] for r in rows) > 1
        assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
        assert eng.step_log(since_seq=rows[-1]["seq"]) == []
        assert len(eng.step_log(limit=3)) == 3
    finally:
        eng.shutdown()


def test_consumer_stop_aborts_request():
    eng = make(max_num_seqs=1, step_ms=5)

    async def main():
        gen = eng.generate("a", "long prompt", SamplingParams(max_tokens=5000, ignore_eos=True))
        await gen.__anext__()
        assert eng.num_running == 1
        await gen.aclose()                      # what a disconnect does
        for _ in range(200):
            if eng.num_running == 0 and not eng.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert eng.num_running == 0
        # the slot is free: the next request runs at once
        t0 = time.monotonic()
        await collect(eng, "b", "short", max_tokens=2, ignore_eos=True)
        return time.monotonic() - t0

    try:
        assert asyncio.run(main()) < 2.0
    finally:
        eng.shutdown()


def test_cancelled_task_aborts_request():
    eng = make(max_num_seqs=1, step_ms=5)

    async def main():
        task = asyncio.create_task(collect(eng, "a", "x y", max_tokens=5000, ignore_eos=True))
        while eng.num_running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not eng.engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert asyncio.run(main())
    finally:
        eng.shutdown()


def test_add_errors_propagate():
    eng = make(max_num_seqs=1, max_waiting=1, step_ms=20)

    async def main():
        with pytest.raises(ValueError, match="prompt"):
            await collect(eng, "e", "", max_tokens=2)
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(eng, "e2", "w " * 5000, max_tokens=2)
        g1 = eng.generate("a", "one", SamplingParams(max_tokens=500, ignore_eos=True))
        await g1.__anext__()                   # running
        g2 = eng.generate("b", "two", SamplingParams(max_tokens=500, ignore_eos=True))
        t2 = asyncio.create_task(g2.__anext__())   # waiting
        await asyncio.sleep(0.1)
        with pytest.raises(QueueFullError):
            await collect(eng, "c", "three", max_tokens=2)
        with pytest.raises(ValueError, match="already in use"):
            await collect(eng, "a", "dup", max_tokens=2)
        await g1.aclose()
        await t2
        await g2.aclose()

    try:
        asyncio.run(main())
        assert eng.is_alive
    finally:
        eng.shutdown()


class _Crashing(FakeEngine):
    def step(self):
        raise RuntimeError("boom")


def test_engine_crash_fails_requests_and_health():
    eng = AsyncLLMEngine(_Crashing({"max_model_len": 64}))

    async def main():
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(eng, "a", "x", max_tokens=4)

    asyncio.run(main())
    with pytest.raises(EngineDeadError):
        eng.check_health()


def test_idle_engine_does_not_step():
    eng = make()
    try:
        asyncio.run(collect(eng, "a", "x", max_tokens=3, ignore_eos=True))
        n = len(eng.step_log())
        time.sleep(0.2)
        assert len(eng.step_log()) == n
    finally:
        eng.shutdown()


@pytest.mark.skipif(not use_real_engine(), reason="real engine or model weights missing")
def test_real_engine_greedy_equals_run_requests():
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine, run_requests

    cfg = EngineConfig(strategy="ngram", max_num_seqs=4, torch_threads=1)
    prompt = "def add(a, b):\n    "
    want = run_requests(LLMEngine(cfg), [("x", prompt, SamplingParams(max_tokens=24))])["x"]
    eng = AsyncLLMEngine.from_config(cfg)
    try:
        text, ids, last = asyncio.run(collect(eng, "x", prompt, max_tokens=24))
        assert ids == want["token_ids"] and text == want["text"]
    finally:
        eng.shutdown()
