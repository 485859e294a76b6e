"""Reliability of the serving path without Ray (issue 9 faults 1 and 3, issue 12 item 3).

- The OpenAI request audit: every nullable field accepts ``null`` as its default;
  wrong types are 400s naming the field (table-driven, ``parse_request``).
- The typed replica protocol end to end in-process: ``StrategyServer.generate``
  (the replica class itself, on the real engine) -> ``collect_body`` /
  ``sse_events`` (the ingress's body builders). One request faulting inside the
  engine gets a 500 / a stream error event; its neighbours finish as if alone.
- A dead engine: the replica's health says so, /health answers 503, new
  requests get 503.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from actors.engine.errors import EngineDead, InvalidRequest
from actors.engine.types import SamplingParams
from actors.serve.deployments import StrategyReplica as Replica   # the plain class: no Ray
from actors.serve.openai_request import COMPLETIONS_DEFAULT_MAX_TOKENS, parse_request
from actors.serve.openai_response import (ResponseContext, collect_body, health_response,
                                          sse_events)
from actors.serve.protocol import Admitted, ErrorMessage
from configs import metric_names as M
from tests.serve_fixtures import use_real_engine


# ------------------------------------------------------------------ request audit
# (field, endpoints, default after null) for every optional field OpenAI marks nullable
NULLABLE = [
    ("temperature", "both", {"temperature": 1.0}),
    ("top_p", "both", {"top_p": 1.0}),
    ("n", "both", {}),
    ("stream", "both", {}),
    ("stream_options", "both", {}),
    ("top_k", "both", {"top_k": 0}),
    ("seed", "both", {"seed": None}),
    ("stop", "both", {"stop": ()}),
    ("max_tokens", "completions", {"max_tokens": COMPLETIONS_DEFAULT_MAX_TOKENS}),
    ("max_tokens", "chat", {"max_tokens": None}),       # the rest of the context
    ("max_completion_tokens", "chat", {"max_tokens": None}),
    ("ignore_eos", "both", {"ignore_eos": False}),
    ("logprobs", "both", {"logprobs": None}),
    ("top_logprobs", "chat", {"logprobs": None}),
    ("min_tokens", "both", {"min_tokens": 0}),
    ("skip_special_tokens", "both", {"skip_special_tokens": True}),
    ("spaces_between_special_tokens", "both", {"spaces_between_special_tokens": True}),
    ("return_tokens_as_token_ids", "both", {}),
    ("echo", "completions", {}),
    ("presence_penalty", "both", {}), ("frequency_penalty", "both", {}),
    ("logit_bias", "both", {}), ("best_of", "completions", {}), ("suffix", "completions", {}),
    ("tools", "chat", {}), ("tool_choice", "chat", {}), ("response_format", "chat", {}),
    ("user", "both", {}),
]
BASE = {"completions": {"model": "m", "prompt": "def f(x):"},
        "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def _cases(endpoints):
    return ["completions", "chat"] if endpoints == "both" else [endpoints]


@pytest.mark.parametrize("field,endpoint,expect", [
    (f, e, x) for f, es, x in NULLABLE for e in _cases(es)])
def test_null_means_the_default(field, endpoint, expect):
    chat = endpoint == "chat"
    with_null = parse_request({**BASE[endpoint], field: None}, chat)
    without = parse_request(BASE[endpoint], chat)
    assert with_null == without
    for k, v in expect.items():
        assert with_null.params[k] == v
    assert with_null.stream is False and with_null.include_usage is False


# (endpoint, field, bad value): wrong types are 400s naming the field, never coerced
WRONG_TYPES = [
    ("completions", "max_tokens", 1.5), ("completions", "max_tokens", True),
    ("completions", "max_tokens", "16"), ("chat", "max_completion_tokens", 2.0),
    ("completions", "n", 2), ("completions", "n", 1.0), ("completions", "seed", "7"),
    ("completions", "top_k", 1.5), ("completions", "temperature", "0.5"),
    ("completions", "temperature", True), ("completions", "top_p", [1]),
    ("completions", "stream", "yes"), ("completions", "stream", 1),
    ("completions", "stop", 3), ("completions", "stop", [1, 2]),
    ("completions", "ignore_eos", "false"), ("completions", "echo", True),
    ("completions", "logprobs", 1.5), ("completions", "logprobs", True),
    ("chat", "logprobs", 2), ("chat", "top_logprobs", 1.5), ("completions", "min_tokens", "2"),
    ("chat", "skip_special_tokens", 0), ("completions", "presence_penalty", 0.5),
    ("completions", "best_of", 3), ("chat", "tools", [{"type": "function"}]),
    ("completions", "prompt", ""), ("completions", "prompt", ["a", "b"]),
    ("completions", "prompt", None), ("chat", "messages", []), ("completions", "model", None),
    ("chat", "stream_options", {"include_usage": "yes"}),
]


@pytest.mark.parametrize("endpoint,field,value", WRONG_TYPES)
def test_wrong_types_name_the_field(endpoint, field, value):
    with pytest.raises(InvalidRequest) as e:
        parse_request({**BASE[endpoint], field: value}, endpoint == "chat")
    assert e.value.param.split(".")[0] == field, str(e.value)


def test_max_tokens_defaults_and_precedence():
    assert parse_request(BASE["completions"], False).params["max_tokens"] == 16
    assert parse_request(BASE["chat"], True).params["max_tokens"] is None
    both = parse_request({**BASE["chat"], "max_tokens": 5, "max_completion_tokens": 9}, True)
    assert both.params["max_tokens"] == 9
    assert parse_request({**BASE["completions"], "max_tokens": 10**12}, False) \
        .params["max_tokens"] == 10**12   # clipped to the context by the engine
    ok = parse_request({**BASE["completions"], "stream": True,
                        "stream_options": {"include_usage": True}, "stop": "x"}, False)
    assert ok.stream and ok.include_usage and ok.params["stop"] == ("x",)


# ------------------------------------------------------------------ replica -> body
class _FaultOnBoom:
    """Fault hook: requests whose id contains "boom" raise in sampling from their 3rd step."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def __call__(self, phase, rid):
        if "boom" in rid and phase == "sample":
            self.calls[rid] = self.calls.get(rid, 0) + 1
            if self.calls[rid] > 2:
                raise FloatingPointError("injected sampler fault")


def make_faulty_engine(cfg: dict):
    """Engine factory: the real engine with ``_FaultOnBoom`` installed."""
    from actors.serve.engine_core import make_llm_engine

    eng = make_llm_engine(cfg)
    eng.fault_hook = _FaultOnBoom()
    return eng


class _CrashingEngine:
    """A fake engine whose step raises: an engine-level bug, not one request's."""

    def __new__(cls, cfg):
        from tests.fake_engine import FakeEngine

        eng = FakeEngine(cfg)

        def step():
            raise RuntimeError("engine bug")
        eng.step = step
        return eng


def make_crashing_engine(cfg: dict):
    return _CrashingEngine(cfg)


async def _request(replica, rid, prompt, params, stream=False):
    gen = replica.generate(rid, prompt, params)
    first = await gen.__anext__()
    if isinstance(first, ErrorMessage):
        return first
    assert isinstance(first, Admitted)
    ctx = ResponseContext(rid, "ngram", 0, False, first.num_prompt_tokens)
    if stream:
        return [line async for line in sse_events(gen, ctx, include_usage=True)]
    return await collect_body(gen, ctx)


def _events(lines):
    return [json.loads(x[6:]) if x[6:].strip() != "[DONE]" else "[DONE]"
            for x in lines if x.startswith("data: ")]


def test_one_faulty_request_fails_alone_through_the_replica(heldout_prompts):
    prompts = [p["prompt"] for p in heldout_prompts[:3]]
    greedy = {"max_tokens": 24, "temperature": 0.0}

    async def main():
        rep = Replica("ngram", {"strategy": "ngram", "max_num_seqs": 8, "torch_threads": 1},
                      "tests.test_serve_reliability:make_faulty_engine")
        try:
            solo = [await _request(rep, f"solo-{i}", p, greedy) for i, p in enumerate(prompts)]
            mixed = await asyncio.gather(
                _request(rep, "ok-0", prompts[0], greedy),
                _request(rep, "boom-1", prompts[1], greedy),
                _request(rep, "tiny-2", prompts[2], {**greedy, "temperature": 1e-40, "seed": 1}),
                _request(rep, "boom-s", prompts[1], greedy, stream=True),
                _request(rep, "ok-s", prompts[0], greedy, stream=True))
            after = await _request(rep, "after", prompts[1], greedy)
            health = await rep.health()
        finally:
            rep.engine.shutdown()
        return solo, mixed, after, health

    solo, (ok0, boom, tiny, boom_s, ok_s), after, health = asyncio.run(main())
    assert ok0["choices"][0]["text"] == solo[0]["choices"][0]["text"]
    assert ok0["choices"][0]["token_ids"] == solo[0]["choices"][0]["token_ids"]
    assert tiny["choices"][0]["token_ids"] == solo[2]["choices"][0]["token_ids"]  # was a 500
    assert isinstance(boom, ErrorMessage) and boom.status == 500 and boom.code == "engine_error"
    assert "injected sampler fault" in boom.message
    ev = _events(boom_s)
    assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "engine_error"
    assert any(e["choices"][0]["token_ids"] for e in ev[:-2])  # tokens came before the fault
    ev = _events(ok_s)
    assert "".join(e["choices"][0]["text"] for e in ev[:-1] if e["choices"]) == \
        solo[0]["choices"][0]["text"]
    assert ev[-2]["usage"] == solo[0]["usage"] and ev[-2][M.SPEC_DECODE_FIELD]
    assert after["choices"][0]["token_ids"] == solo[1]["choices"][0]["token_ids"]
    assert health == {"alive": True, "error": None}


def test_dead_engine_is_reported():
    async def main():
        rep = Replica("autoregressive", {"strategy": "autoregressive", "max_model_len": 512},
                      "tests.test_serve_reliability:make_crashing_engine")
        try:
            first = await _request(rep, "a", "w1 w2", {"max_tokens": 4})
            for _ in range(100):          # the engine thread dies on its first step
                if not (await rep.health())["alive"]:
                    break
                await asyncio.sleep(0.01)
            return first, await rep.health(), await _request(rep, "b", "w1", {"max_tokens": 4})
        finally:
            rep.engine.shutdown()

    first, health, later = asyncio.run(main())
    assert isinstance(first, ErrorMessage) and first.status == 503, first
    assert health["alive"] is False and "engine bug" in health["error"]
    assert isinstance(later, ErrorMessage) and later.status == 503
    assert later.code == "engine_unavailable"
    with pytest.raises(EngineDead):
        Replica.check_health(type("R", (), {"engine": _dead()})())
    resp = health_response({"ngram": {"alive": True}, "draft_model": health})
    assert resp.status_code == 503 and b"draft_model" in resp.body
    assert health_response({"ngram": {"alive": True}})["status"] == "ok"


def _dead():
    class D:
        def check_health(self):
            raise EngineDead("engine thread stopped: RuntimeError('engine bug')")
    return D()


def test_strategy_options_typo_fails_at_deploy():
    from actors.serve.app import build_app

    args = {"strategies": [{"engine": {"strategy": "ngram",
                                       "strategy_options": {"prompt_lookup_mx": 3}}}]}
    with pytest.raises(ValueError, match="prompt_lookup_mx") as e:
        build_app(args)
    assert "'ngram'" in str(e.value)


# ------------------------------------------------------------------ bad input found by a newcomer
@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
def test_seed_outside_int64_is_a_400_on_every_path(seed):
    """A seed torch cannot take was a 500 (OverflowError in the engine): now a 400 naming
    ``seed`` at the HTTP schema and in SamplingParams (the direct / replica path)."""
    with pytest.raises(InvalidRequest) as e:
        parse_request({**BASE["completions"], "seed": seed}, False)
    assert e.value.param == "seed"
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(seed=seed)
    assert e.value.param == "seed" and "int64" in str(e.value)
    for ok in (2**63 - 1, -(2**63), 0):
        assert parse_request({**BASE["completions"], "seed": ok}, False).params["seed"] == ok
        SamplingParams(seed=ok)


def test_stream_options_need_stream():
    for stream in (False, None):
        with pytest.raises(InvalidRequest) as e:
            parse_request({**BASE["chat"], "stream": stream,
                           "stream_options": {"include_usage": True}}, True)
        assert e.value.param == "stream_options"


def test_error_bodies_do_not_echo_huge_inputs():
    """A 2 MB stop list in a request that fails validation came back in a 2 MB 400."""
    from actors.serve.openai_request import error_response
    from actors.serve.protocol import MAX_ERROR_MESSAGE_CHARS

    big = "x" * 2_000_000
    with pytest.raises(InvalidRequest) as e:
        parse_request({"model": "m", "stop": big}, False)          # prompt missing
    assert e.value.param == "prompt" and len(str(e.value)) < 1000
    with pytest.raises(InvalidRequest) as e:
        parse_request({**BASE["completions"], "temperature": big}, False)
    assert e.value.param == "temperature" and len(str(e.value)) < 1000
    body = json.loads(error_response(400, "stop: " + big).body)
    assert len(body["error"]["message"]) < MAX_ERROR_MESSAGE_CHARS + 100
    err = ErrorMessage(400, big, "invalid_request_error", "stop").body()
    assert len(err["error"]["message"]) < MAX_ERROR_MESSAGE_CHARS + 100


@pytest.mark.skipif(not use_real_engine(), reason="SPECLOAD_TEST_FAKE_ENGINE=1 asked for the fake engine")
def test_prompt_far_over_the_context_is_refused_before_tokenizing():
    """A 6 MB prompt was tokenized (seconds, stalling its replica) before its 400: the
    longest vocabulary entry bounds how few tokens it can be, so it is refused at once."""
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(strategy="autoregressive", max_num_seqs=1, torch_threads=1))
    calls = []
    tokenizer = eng.tokenizer
    eng.tokenizer = lambda *a, **k: calls.append(a) or tokenizer(*a, **k)
    with pytest.raises(InvalidRequest) as e:
        eng.add_request("huge", "def f(x): return x\n" * 300_000, SamplingParams())
    assert e.value.code == "context_length_exceeded" and "at least" in str(e.value)
    assert calls == []                                     # never tokenized
    with pytest.raises(InvalidRequest, match="max_model_len"):   # near the bound: tokenized
        eng.add_request("long", "x " * 5000, SamplingParams())
    assert len(calls) == 1
    assert eng.add_request("fine", "def f(x):", SamplingParams()) > 0


def test_unhandled_route_error_is_an_openai_500():
    """An exception no route handled was Starlette's plain-text 500; every specload app
    answers it in OpenAI's shape."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from actors.serve.openai_request import install_error_handlers

    app = install_error_handlers(FastAPI())

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "internal_error" and "kaput" in r.json()["error"]["message"]
