"""AsyncLLMEngine on the fake engine (no Ray): streaming, abort on disconnect, errors.

Every test runs both ways a replica can host its engine: on a thread of this
process (``AsyncLLMEngine``) and in its own process (``ProcessAsyncLLMEngine``,
the replicas' default)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from actors.engine.types import SamplingParams
from actors.serve.async_engine import AsyncLLMEngine, EngineDeadError, ProcessAsyncLLMEngine
from configs import metric_names as mn
from actors.engine.errors import QueueFull as QueueFullError
from tests.fake_engine import FakeEngine
from tests.serve_fixtures import process_running, use_real_engine


MODES = ["thread", "process"]


def make(mode: str = "thread", **cfg) -> AsyncLLMEngine:
    cfg = {"strategy": "ngram", "max_model_len": 4096, "step_ms": 2, **cfg}
    if mode == "process":
        return ProcessAsyncLLMEngine("tests.fake_engine:make_fake_engine", cfg)
    return AsyncLLMEngine(FakeEngine(cfg))


def idle(eng: AsyncLLMEngine) -> bool:
    return eng.num_running == 0 and eng.num_waiting == 0


async def collect(eng, rid, prompt, **kw):
    text, ids, last = "", [], None
    async for out in eng.generate(rid, prompt, SamplingParams(**kw)):
        text += out.new_text
        ids += out.new_token_ids
        last = out
    return text, ids, last


@pytest.mark.parametrize("mode", MODES)
def test_generate_matches_engine_and_batches(mode):
    eng = make(mode, max_num_seqs=8)

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


@pytest.mark.parametrize("mode", MODES)
def test_consumer_stop_aborts_request(mode):
    eng = make(mode, max_num_seqs=1, step_ms=5)

    async def main():
        gen = eng.generate("a", "long prompt", SamplingParams(max_tokens=5000, ignore_eos=True))
        await gen.__anext__()
        assert eng.num_running == 1
        await gen.aclose()                      # what a disconnect does
        for _ in range(1000):                  # bounded: at most ~10 s
            if idle(eng):
                break
            await asyncio.sleep(0.01)
        assert eng.num_running == 0
        # the one slot is free again: the next request runs (a liveness bound, not a speed
        # check: with the slot still held it would wait for 5000 tokens)
        _, ids, last = await asyncio.wait_for(
            collect(eng, "b", "short", max_tokens=2, ignore_eos=True), 30)
        return len(ids), last.finish_reason

    try:
        assert asyncio.run(main()) == (2, "length")
    finally:
        eng.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_cancelled_task_aborts_request(mode):
    eng = make(mode, max_num_seqs=1, step_ms=5)

    async def main():
        task = asyncio.create_task(collect(eng, "a", "x y", max_tokens=5000, ignore_eos=True))
        while eng.num_running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(1000):                  # bounded: at most ~10 s
            if idle(eng):
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert asyncio.run(main())
    finally:
        eng.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_add_errors_propagate(mode):
    eng = make(mode, max_num_seqs=1, max_waiting=1, step_ms=20)

    async def main():
        with pytest.raises(ValueError, match="prompt"):
            await collect(eng, "e", "", max_tokens=2)
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(eng, "e2", "w " * 5000, max_tokens=2)
        g1 = eng.generate("a", "one", SamplingParams(max_tokens=500, ignore_eos=True))
        await g1.__anext__()                   # running
        g2 = eng.generate("b", "two", SamplingParams(max_tokens=500, ignore_eos=True))
        t2 = asyncio.create_task(g2.__anext__())   # waiting
        for _ in range(1000):                      # bounded: at most ~10 s
            if eng.num_waiting == 1:
                break
            await asyncio.sleep(0.01)
        assert eng.num_waiting == 1
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


def make_crashing(cfg: dict) -> FakeEngine:
    return _Crashing(cfg)


@pytest.mark.parametrize("mode", MODES)
def test_engine_crash_fails_requests_and_health(mode):
    eng = (ProcessAsyncLLMEngine("tests.test_serve_async_engine:make_crashing",
                                 {"max_model_len": 64}) if mode == "process"
           else AsyncLLMEngine(_Crashing({"max_model_len": 64})))

    async def main():
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(eng, "a", "x", max_tokens=4)

    asyncio.run(main())
    with pytest.raises(EngineDeadError):
        eng.check_health()


@pytest.mark.parametrize("mode", MODES)
def test_idle_engine_does_not_step(mode):
    eng = make(mode)
    try:
        asyncio.run(collect(eng, "a", "x", max_tokens=3, ignore_eos=True))
        n = len(eng.step_log())
        time.sleep(0.2)
        assert len(eng.step_log()) == n
    finally:
        eng.shutdown()


@pytest.mark.skipif(not use_real_engine(), reason="SPECLOAD_TEST_FAKE_ENGINE=1 asked for the fake engine")
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


@pytest.mark.skipif(not use_real_engine(), reason="SPECLOAD_TEST_FAKE_ENGINE=1 asked for the fake engine")
def test_real_engine_in_its_process_greedy_equals_run_requests():
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine, run_requests

    cfg = {"strategy": "dflash2", "max_num_seqs": 4, "torch_threads": 1}
    prompts = ["def add(a, b):\n    ", "import os\n", "The"]
    want = run_requests(LLMEngine(EngineConfig(**cfg)),
                        [(f"x{i}", p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)],
                        batch_size=1)
    eng = ProcessAsyncLLMEngine("actors.serve.engine_core:make_llm_engine", cfg)
    try:
        assert eng.engine_pid != os.getpid() and eng.max_model_len > 0

        async def main():
            got = await asyncio.gather(*[collect(eng, f"x{i}", p, max_tokens=24)
                                         for i, p in enumerate(prompts)])
            return got, await eng.memory(reset_peak=True)

        got, memory = asyncio.run(main())
        for i, (text, ids, last) in enumerate(got):
            assert ids == want[f"x{i}"]["token_ids"] and text == want[f"x{i}"]["text"]
            assert last.stats.num_drafts == want[f"x{i}"]["stats"].num_drafts > 0
        assert memory["strategy"] == "dflash2" and memory["target_weight_bytes"] > 0
        rows = eng.step_log()
        assert sum(r[mn.STEP_EMITTED_TOKENS] + r[mn.STEP_PREFILL_EMITTED_TOKENS]
                   for r in rows) == sum(len(ids) for _, ids, _ in got)
    finally:
        eng.shutdown()
    assert eng._core.proc.poll() == 0          # a clean exit on shutdown


def test_engine_process_death_fails_requests_and_health():
    """The engine's process killed by its pid: streams end with EngineDeadError, the
    health check fails, new requests are refused."""
    eng = make("process", max_num_seqs=2, step_ms=5)

    async def main():
        gen = eng.generate("a", "long", SamplingParams(max_tokens=5000, ignore_eos=True))
        await gen.__anext__()
        os.kill(eng.engine_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine process is gone"):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await collect(eng, "b", "x", max_tokens=2)

    try:
        asyncio.run(main())
        with pytest.raises(EngineDeadError):
            eng.check_health()
    finally:
        eng.shutdown()


def test_engine_process_exits_with_its_replica(tmp_path):
    """A replica process killed by -9 mid-stream takes its engine process with it
    (the engine sees its socket close); nothing is left running."""
    script = tmp_path / "replica.py"
    script.write_text(
        "import asyncio, sys\n"
        "from actors.engine.types import SamplingParams\n"
        "from actors.serve.async_engine import ProcessAsyncLLMEngine\n"
        "eng = ProcessAsyncLLMEngine('tests.fake_engine:make_fake_engine',\n"
        "    {'strategy': 'ngram', 'max_model_len': 4096, 'step_ms': 5})\n"
        "async def main():\n"
        "    gen = eng.generate('a', 'x', SamplingParams(max_tokens=100000, ignore_eos=True))\n"
        "    await gen.__anext__()\n"
        "    print(eng.engine_pid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        engine_pid = int(proc.stdout.readline())
        assert psutil.Process(engine_pid).ppid() == proc.pid
        proc.kill()                              # the replica, by its pid
        proc.wait(10)
        deadline = time.monotonic() + 10
        while process_running(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_running(engine_pid), f"engine process {engine_pid} outlived its replica"
    finally:
        if proc.poll() is None:
            proc.kill()
