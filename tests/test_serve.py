"""HTTP end to end through Ray Serve on a local Ray (one module-scoped service, in the
one-hop layout: each strategy its own application at ``/strategies/<name>`` plus the
model-field ingress at ``/``). Tests that touch a generation route run on both routes
(``route`` fixture): the strategy's own route and the ingress's ``model`` field.

Metrics are checked on Ray's Prometheus export port (the node's
``metrics_export_port``, reporting every second here): the spec-decode
counters must appear there as ``ray_specload_spec_decode_*``.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from configs import metric_names as mn  # noqa: E402
from configs.net import free_port  # noqa: E402
from tests.serve_fixtures import ONE_SLOT, app_args, local_service, parse_sse, use_real_engine  # noqa: E402
from tests.tiers_file import write_tiers  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    ", "The history of the city begins", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def service():
    """(base_url, metrics_url, args, real): a Serve app on a free 127.0.0.1 port."""
    real = use_real_engine()
    args = app_args(real)
    with local_service(args) as (base_url, metrics_url):
        yield base_url, metrics_url, args, real


@pytest.fixture(scope="module")
def client(service):
    with httpx.Client(base_url=service[0], timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def strategies(service) -> list[str]:
    return [s.get("name") or s["engine"]["strategy"] for s in service[2]["strategies"]
            if s.get("name") != ONE_SLOT]


ROUTES = ("strategy", "model-field")


@pytest.fixture(params=ROUTES)
def route(request) -> str:
    """Which HTTP route a generation test takes: the strategy's own (one hop) or the
    ingress's ``/v1`` with the ``model`` field."""
    return request.param


def v1(route: str, model: str, path: str = "completions") -> str:
    """The path of ``/v1/<path>`` for ``model`` on ``route``."""
    return (f"/strategies/{model}" if route == "strategy" else "") + f"/v1/{path}"


def complete(client, model, prompt, route="model-field", **kw) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}
    r = client.post(v1(route, model), json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, model, prompt, route="model-field", **kw) -> list:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **kw}
    with client.stream("POST", v1(route, model), json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse_sse(r.iter_lines())


def assert_alive(client, model="autoregressive", route="model-field"):
    out = complete(client, model, "hello", route, max_tokens=2)
    assert out["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------ basics
def test_ray_stays_on_loopback(service):
    """The test's Ray records and dials 127.0.0.1, not the host's own address (conftest sets
    configs.net.RAY_SINGLE_NODE_LOOPBACK_ENV; Ray would otherwise rewrite 127.0.0.1)."""
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


def test_models_and_health(client, strategies):
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/health", params={"deep": 1}).status_code == 200
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert set(strategies) | {ONE_SLOT} == set(ids)
    assert all(isinstance(m["max_model_len"], int) for m in client.get("/v1/models").json()["data"])
    routes = client.get("/specload/routes").json()["routes"]
    assert routes == {m: f"/strategies/{m}" for m in ids}
    for m in ids:   # each strategy's own route: its health and its one model
        assert client.get(f"/strategies/{m}/health").json() == {"status": "ok", "strategies": [m]}
        (card,) = client.get(f"/strategies/{m}/v1/models").json()["data"]
        assert card["id"] == m and isinstance(card["max_model_len"], int)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_stream_equals_non_stream(client, strategies, prompt, route):
    for model in strategies:
        full = complete(client, model, prompt, route)
        other = complete(client, model, prompt, "model-field" if route == "strategy" else "strategy")
        assert other["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
        events = stream(client, model, prompt, route)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert text == full["choices"][0]["text"]
        assert ids == full["choices"][0]["token_ids"]
        usage = events[-2]["usage"]           # usage chunk: no choices, before [DONE]
        assert events[-2]["choices"] == []
        assert usage == full["usage"]
        assert usage["completion_tokens"] == len(ids)
        final = chunks[-1]
        assert final["choices"][0]["finish_reason"] in ("stop", "length")
        spec = final[mn.SPEC_DECODE_FIELD]
        for key in (mn.NUM_DRAFTS, mn.NUM_DRAFT_TOKENS, mn.NUM_ACCEPTED_TOKENS,
                    mn.NUM_ACCEPTED_TOKENS_PER_POS, mn.ACCEPTANCE_LENGTH, mn.DRAFT_MS,
                    mn.VERIFY_MS, mn.QUEUE_MS):
            assert key in spec and key in full[mn.SPEC_DECODE_FIELD]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def _direct(args, real, strategy, prompt, max_tokens):
    """Greedy text of the engine itself, same engine config, no Serve."""
    from actors.engine.types import SamplingParams

    entry = next(s for s in args["strategies"] if s["engine"]["strategy"] == strategy)
    cfg = dict(entry["engine"])
    if real:
        from actors.engine.config import EngineConfig
        from actors.engine.llm_engine import LLMEngine, run_requests
        from actors.serve.app import resolve_engine_config

        eng = LLMEngine(EngineConfig(**resolve_engine_config(cfg)))
        res = run_requests(eng, [("x", prompt, SamplingParams(max_tokens=max_tokens))])
        return res["x"]["text"], res["x"]["token_ids"]
    from tests.fake_engine import FakeEngine

    eng = FakeEngine(cfg)
    eng.add_request("x", prompt, SamplingParams(max_tokens=max_tokens))
    text, ids = "", []
    while eng.has_unfinished_requests():
        for o in eng.step():
            text += o.new_text
            ids += o.new_token_ids
    return text, ids


def test_greedy_equals_engine_and_across_strategies(service, client, strategies):
    _, _, args, real = service
    for prompt in PROMPTS:
        texts = {m: complete(client, m, prompt, max_tokens=32)["choices"][0]
                 for m in strategies}
        ref = texts["autoregressive"]
        for m, choice in texts.items():
            assert choice["text"] == ref["text"], m
            assert choice["token_ids"] == ref["token_ids"], m
        direct_text, direct_ids = _direct(args, real, "autoregressive", prompt, 32)
        assert ref["text"] == direct_text
        assert ref["token_ids"] == direct_ids


def test_chat_completions(client, route):
    body = {"model": "ngram", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Say hello"}]}
    path = v1(route, "ngram", "chat/completions")
    full = client.post(path, json=body).json()
    assert full["object"] == "chat.completion"
    msg = full["choices"][0]["message"]
    assert msg["role"] == "assistant" and full[mn.SPEC_DECODE_FIELD] is not None
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        events = parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert text == msg["content"]


def test_sampling_with_seed_is_reproducible(client):
    kw = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7, "max_tokens": 16}
    a = complete(client, "ngram", PROMPTS[1], **kw)["choices"][0]["text"]
    b = complete(client, "ngram", PROMPTS[1], **kw)["choices"][0]["text"]
    assert a == b


def test_stop_and_token_id_prompt(client):
    out = complete(client, "autoregressive", PROMPTS[0], max_tokens=32)
    text = out["choices"][0]["text"]
    if len(text) > 6:
        stop = text[3:6]
        cut = complete(client, "autoregressive", PROMPTS[0], max_tokens=32, stop=[stop])
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert stop not in cut["choices"][0]["text"]
        assert text.startswith(cut["choices"][0]["text"])
    ids = complete(client, "autoregressive", [1, 2, 3, 4], max_tokens=4)
    assert ids["usage"]["prompt_tokens"] == 4


def test_stop_token_ids_on_every_strategy_and_route(client, strategies, route):
    """Issue 42: ``stop_token_ids: [t]`` for a token t a greedy request emits at position p
    returned every max_tokens token with finish_reason "length" (the field was ignored).
    Now: the ids up to and including t, "stop", ``stop_reason`` t, usage counting t, the
    text without t's (vLLM's convention); the same on every strategy, streamed or not."""
    for model in strategies:
        ref = complete(client, model, PROMPTS[0], route, max_tokens=24, ignore_eos=True)
        ids = ref["choices"][0]["token_ids"]
        assert ref["choices"][0]["finish_reason"] == "length" and len(ids) == 24
        t = ids[16]
        pos = ids.index(t)
        out = complete(client, model, PROMPTS[0], route, max_tokens=24, ignore_eos=True,
                       stop_token_ids=[t])
        c = out["choices"][0]
        assert c["token_ids"] == ids[:pos + 1], (model, route)
        assert c["finish_reason"] == "stop" and c["stop_reason"] == t, (model, c)
        assert out["usage"]["completion_tokens"] == pos + 1
        assert ref["choices"][0]["text"].startswith(c["text"])
        events = stream(client, model, PROMPTS[0], route, max_tokens=24, ignore_eos=True,
                        stop_token_ids=[t])
        chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
        assert [i for e in chunks for i in e["choices"][0]["token_ids"]] == ids[:pos + 1]
        assert "".join(e["choices"][0]["text"] for e in chunks) == c["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"][0]["stop_reason"] == t
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == pos + 1


# ------------------------------------------------------------------ nulls, extreme params
def test_null_fields_and_extreme_params(client, strategies):
    """Issue 9 faults 1 and 3 over HTTP: explicit nulls mean the defaults (they were 400s);
    temperature 1e-40 / top_p 1e-9 / top_k 1 are greedy-equivalent 200s (1e-40 was a 500)."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "top_k", "seed", "stop",
                               "stream_options", "max_tokens", "logprobs", "echo",
                               "presence_penalty", "frequency_penalty", "logit_bias",
                               "best_of", "suffix", "user", "ignore_eos")}
    r = client.post("/v1/completions", json={"model": "ngram", "prompt": PROMPTS[0], **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16   # OpenAI's completions default
    chat = client.post("/v1/chat/completions", json={
        "model": "ngram", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        **{k: v for k, v in nulls.items() if k not in ("echo", "best_of", "suffix",
                                                       "max_tokens")}})
    assert chat.status_code == 200, chat.text
    for model in strategies:
        ref = complete(client, model, PROMPTS[0], max_tokens=16)["choices"][0]["token_ids"]
        for kw in ({"temperature": 1e-40, "seed": 1}, {"temperature": 1.0, "top_p": 1e-9},
                   {"temperature": 1.0, "top_k": 1}):
            out = complete(client, model, PROMPTS[0], max_tokens=16, **kw)
            assert out["choices"][0]["token_ids"] == ref, (model, kw)


# ------------------------------------------------------------------ bad input
BAD = [
    ("{not json", 400, None, None),
    ("[1, 2]", 400, None, None),
    (json.dumps({"model": "nope", "prompt": "hi"}), 404, "model", "model_not_found"),
    (json.dumps({"prompt": "hi"}), 400, "model", None),
    (json.dumps({"model": "ngram", "prompt": "hi", "temperature": -1}), 400, "temperature", None),
    (json.dumps({"model": "ngram", "prompt": "hi", "top_p": 0}), 400, "top_p", None),
    (json.dumps({"model": "ngram", "prompt": "hi", "max_tokens": 0}), 400, "max_tokens", None),
    (json.dumps({"model": "ngram", "prompt": "hi", "max_tokens": "many"}), 400, "max_tokens",
     None),
    (json.dumps({"model": "ngram", "prompt": "hi", "top_k": -5}), 400, "top_k", None),
    (json.dumps({"model": "ngram", "prompt": "hi", "n": 2}), 400, "n", None),
    (json.dumps({"model": "ngram", "prompt": "hi", "presence_penalty": 0.5}), 400,
     "presence_penalty", None),
    (json.dumps({"model": "ngram", "prompt": "hi", "max_tokens": True}), 400, "max_tokens", None),
    (json.dumps({"model": "ngram", "prompt": ""}), 400, "prompt", None),
    (json.dumps({"model": "ngram", "prompt": ["a", "b"]}), 400, "prompt", None),
    (json.dumps({"model": "ngram", "prompt": "word " * 5000}), 400, "prompt",
     "context_length_exceeded"),
    # issue 42: a field the service does not implement is a 400 naming it, never ignored
    (json.dumps({"model": "ngram", "prompt": "hi", "no_such_field": 1}), 400, "no_such_field",
     None),
    (json.dumps({"model": "ngram", "prompt": "hi", "min_p": 0.2}), 400, "min_p", None),
    (json.dumps({"model": "ngram", "prompt": "hi", "stop_token_ids": [-3]}), 400,
     "stop_token_ids", None),
]


@pytest.mark.parametrize("body,status,param,code", BAD)
@pytest.mark.parametrize("stream_flag", [False, True])
def test_bad_input(client, body, status, param, code, stream_flag, route):
    """The same 4xx bodies on both routes (a strategy's route refuses other models: 404)."""
    if stream_flag and body.startswith("{\"model\""):
        body = json.dumps({**json.loads(body), "stream": True})
    r = client.post(v1(route, "ngram"), content=body,
                    headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code
    assert_alive(client, "ngram", route)


def test_bad_chat(client, route):
    r = client.post(v1(route, "ngram", "chat/completions"), json={"model": "ngram", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert_alive(client, "ngram", route)


# ------------------------------------------------------------------ overload, disconnect
def _open_stream(base, body, first_content: bool, route: str):
    """Open a streaming request; return (client, response, lines iterator) after the
    headers (and after the first content chunk when ``first_content``)."""
    c = httpx.Client(base_url=base, timeout=120)
    req = c.build_request("POST", v1(route, body["model"]), json={**body, "stream": True})
    r = c.send(req, stream=True)
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    if first_content:
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["token_ids"]:
                break
    return c, r, lines


def _info(client, name=ONE_SLOT):
    return client.get("/specload/info").json()[name]


def _wait(pred, timeout_s):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def test_queue_full_429_then_disconnect_frees_slot(service, client, route):
    """ONE_SLOT: max_num_seqs=1, max_waiting=1. A runs, B waits, C gets 429. A's client
    disconnects: B is admitted at once (long before A could have finished)."""
    base = service[0]
    long = {"model": ONE_SLOT, "prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True,
            "max_tokens": 900}
    ca, ra, _ = _open_stream(base, long, first_content=True, route=route)
    cb = rb = None
    try:
        assert _wait(lambda: _info(client)["num_running"] == 1, 10) is not None
        cb, rb, lines_b = _open_stream(base, long, first_content=False, route=route)
        assert _wait(lambda: _info(client)["num_waiting"] == 1, 10) is not None
        r = client.post(v1(route, ONE_SLOT), json={**long, "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 0
        assert r.json()["error"]["type"] == "rate_limit_error"
        t_close = time.monotonic()
        ra.close()
        ca.close()
        # B leaves the waiting queue and gets the slot: A was aborted.
        admitted = _wait(lambda: _info(client)["num_waiting"] == 0, 5)
        assert admitted is not None, "B was not admitted after A disconnected"
        for line in lines_b:   # B streams tokens now
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["token_ids"]:
                break
        gap = time.monotonic() - t_close
        assert gap < 5, f"B's first token came {gap:.1f}s after A disconnected"
        rows = client.get("/specload/step_log", params={"strategy": "autoregressive"}).json()
        assert rows["rows"]
    finally:
        for x in (rb, cb):
            if x is not None:
                x.close()
    assert _wait(lambda: _info(client)["num_running"] == 0, 10) is not None
    assert complete(client, ONE_SLOT, "hi", route, max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_non_stream_disconnect_frees_slot(service, client, route):
    base = service[0]
    body = {"model": ONE_SLOT, "prompt": PROMPTS[1], "temperature": 0, "ignore_eos": True,
            "max_tokens": 900}

    def fire():
        try:
            httpx.post(base + v1(route, ONE_SLOT), json=body, timeout=0.8)
        except httpx.TimeoutException:
            pass

    t = threading.Thread(target=fire)
    t.start()
    assert _wait(lambda: _info(client)["num_running"] == 1, 10) is not None
    t.join()
    assert _wait(lambda: _info(client)["num_running"] == 0, 5) is not None


# ------------------------------------------------------------------ step log, metrics
def test_step_log_route(client):
    complete(client, "ngram", PROMPTS[2], max_tokens=8)
    since = time.time() - 3600
    rows = []
    for _ in range(50):
        rows = client.get("/specload/step_log",
                          params={"strategy": "ngram", "since": since}).json()["rows"]
        if rows:
            break
        time.sleep(0.1)
    assert rows
    for col in mn.STEP_LOG_COLUMNS:
        assert col in rows[0]
    assert {r[mn.STEP_STRATEGY] for r in rows} == {"ngram"}
    later = client.get("/specload/step_log",
                       params={"since": rows[-1][mn.STEP_TS]}).json()["rows"]
    assert all(r[mn.STEP_TS] > rows[-1][mn.STEP_TS] for r in later)
    assert client.get("/specload/step_log", params={"strategy": "nope"}).status_code == 404
    bad = client.get("/specload/step_log", params={"limit": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    bad = client.get("/specload/step_log", params={"after": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
    # paging by arrival: a page's next is the cursor of the rows stored after it
    page = client.get("/specload/step_log", params={"strategy": "ngram", "since": since}).json()
    assert page["total"] >= len(page["rows"]) >= len(rows) and page["next"] >= page["total"]
    assert client.get("/specload/step_log", params={"strategy": "ngram", "after": page["next"]}
                      ).json()["rows"] == []
    complete(client, "ngram", PROMPTS[1], max_tokens=4)
    new = []
    for _ in range(50):
        new = client.get("/specload/step_log",
                         params={"strategy": "ngram", "after": page["next"]}).json()
        if new["rows"]:
            break
        time.sleep(0.1)
    assert new["rows"] and new["total"] - page["total"] == len(new["rows"])
    assert not {(r[mn.STEP_REPLICA], r["seq"]) for r in new["rows"]} & {
        (r[mn.STEP_REPLICA], r["seq"]) for r in page["rows"]}        # no row twice


def test_prometheus_spec_decode_counters(service, client):
    metrics_url = service[1]
    for p in PROMPTS:
        complete(client, "ngram", p, max_tokens=16)
    want = ["ray_specload_" + mn.PROM_SPEC_NUM_DRAFTS,
            "ray_specload_" + mn.PROM_SPEC_NUM_DRAFT_TOKENS,
            "ray_specload_" + mn.PROM_SPEC_NUM_ACCEPTED_TOKENS,
            "ray_specload_" + mn.PROM_BATCH_SIZE,
            "ray_specload_" + mn.PROM_STEP_TIME_MS,
            "ray_specload_" + mn.PROM_VERIFICATION_TOKENS,
            "ray_specload_" + mn.PROM_QUEUE_DEPTH,
            "ray_specload_" + mn.PROM_REQUEST_SUCCESS,       # requests the server saw finish
            "ray_specload_" + mn.PROM_GENERATION_TOKENS]     # and their output tokens
    text = ""
    for _ in range(60):
        try:
            text = httpx.get(metrics_url, timeout=5).text
        except httpx.HTTPError:
            text = ""
        if all(w in text for w in want):
            break
        time.sleep(1)
    missing = [w for w in want if w not in text]
    assert not missing, f"not exported: {missing}"
    drafts = [line for line in text.splitlines()
              if line.startswith("ray_specload_" + mn.PROM_SPEC_NUM_DRAFTS)
              and 'strategy="ngram"' in line]
    assert drafts and any(float(line.rsplit(" ", 1)[1]) > 0 for line in drafts)
    # the scraper reads the request counter: at least the requests this test sent finished on ngram
    from loadgen.run import server_metrics as sm

    values, _ = sm.parse_page(text, mn.ENGINE_SPECLOAD)
    assert values.get(("ngram", mn.SRV_REQUESTS_FINISHED, sm.NO_POSITION), 0) >= len(PROMPTS)
    assert values.get(("ngram", mn.SRV_GENERATION_TOKENS, sm.NO_POSITION), 0) >= len(PROMPTS)


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/embeddings", 404),
                                                ("GET", "/v1/completions", 405),
                                                ("GET", "/specload/step_log?since=abc", 400),
                                                ("GET", "/strategies/ngram/v1/embeddings", 404),
                                                ("GET", "/strategies/ngram/v1/completions", 405),
                                                ("GET", "/strategies/nope/v1/models", 404)])
def test_framework_errors_use_openai_shape(client, method, path, status):
    r = client.request(method, path)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert client.get("/health").status_code == 200


def test_api_key_on_the_service(service, tmp_path):
    """A second service with an ingress key: 401 in OpenAI's shape without it, 200 with it,
    on both routes; the load generator sends it (--api-key) on the strategy's own route
    (--route auto finds it) and writes it nowhere."""
    import subprocess
    import sys

    from actors.serve.app import run_applications, strategy_app_name
    from tests.serve_fixtures import REPO

    key = "sk-serve-test-7d3e91"
    args = {"strategies": [{"name": "keyed", "engine": {"strategy": "autoregressive",
                                                        "num_speculative_tokens": 0, "max_num_seqs": 4,
                                                        "max_model_len": 4096, "step_ms": 2},
                            "ray_actor_options": {"num_cpus": 0.1}}],
            "ingress": {"ray_actor_options": {"num_cpus": 0.05}, "api_key": key},
            "engine_factory": "tests.fake_engine:make_fake_engine"}
    run_applications(args, name="keyed", route_prefix="/keyed")
    try:
        base = service[0] + "/keyed"
        own = base + "/strategies/keyed"
        body = {"model": "keyed", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            for r in (httpx.get(base + "/v1/models", headers=headers, timeout=30),
                      httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=30),
                      httpx.get(base + "/specload/step_log", headers=headers, timeout=30),
                      httpx.get(base + "/specload/routes", headers=headers, timeout=30),
                      httpx.get(own + "/v1/models", headers=headers, timeout=30),
                      httpx.post(own + "/v1/completions", json=body, headers=headers, timeout=30)):
                assert r.status_code == 401, r.text
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert key not in r.text
        auth = {"Authorization": f"Bearer {key}"}
        for b in (base, own):
            assert httpx.get(b + "/health", timeout=30).status_code == 200      # open for probes
            assert httpx.get(b + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"] == "keyed"
            r = httpx.post(b + "/v1/completions", json=body, headers=auth, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # the load generator against it: key sent on every call, in no file written
        tiers = write_tiers(tmp_path, {"users": 2, "spawn_rate": 100, "duration_s": 1,
                                       "max_tokens": 4, "slo": {"ttft_ms": 5000, "tpot_ms": 1000}},
                            request_timeout_s=30, drain_timeout_s=5)
        p = subprocess.run([sys.executable, "-m", "loadgen", "--tier", "low", "--output", "short",
                            "--target", base, "--tiers-file", str(tiers), "--results",
                            str(tmp_path / "res"), "--api-key", key], capture_output=True, text=True,
                           timeout=120, cwd=REPO)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert "cell 1/1 keyed low/short: ok" in p.stdout and key not in p.stdout + p.stderr
        files = [f for f in (tmp_path / "res").rglob("*") if f.is_file()]
        assert files and not [f for f in files if key.encode() in f.read_bytes()]
        (manifest,) = (tmp_path / "res").rglob("manifest.json")
        assert json.loads(manifest.read_text())["routes"] == {
            "keyed": {"route": "strategy", "base_url": own}}
    finally:
        serve.delete(strategy_app_name("keyed", "keyed"))
        serve.delete("keyed")


def test_a_long_step_log_passes_the_handle_calls(service):
    """The Serve proxy receives the ingress's answer over gRPC (``PROXY_ENV``, as ``cluster up``
    starts it): a cell's step rows far over Ray's 4 MiB default message size (a 30 s cell of a
    busy strategy is ~29 MB) reach the client whole, not as an HTTP 500 RESOURCE_EXHAUSTED
    (without PROXY_ENV's RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH this test reads 500)."""
    import httpx
    from ray import serve

    from actors.serve.app import STORE_DEPLOYMENT, run_applications
    from configs.serve_config import REPLICA_ENV

    rt = {"env_vars": dict(REPLICA_ENV)}
    args = {"strategies": [{"name": "steps", "engine": {"strategy": "autoregressive",
                                                        "num_speculative_tokens": 0, "max_num_seqs": 2,
                                                        "max_model_len": 4096, "step_ms": 2},
                            "ray_actor_options": {"num_cpus": 0.05, "runtime_env": rt}}],
            "ingress": {"ray_actor_options": {"num_cpus": 0.05, "runtime_env": rt}},
            "engine_factory": "tests.fake_engine:make_fake_engine"}
    run_applications(args, name="steps", route_prefix="/steps")
    try:
        store = serve.get_deployment_handle(STORE_DEPLOYMENT, "steps")
        t0 = 2_000_000_000.0
        pad = "x" * 1000
        rows = [{mn.STEP_MODEL: "steps", mn.STEP_TS: t0 + i * 1e-3, "pad": pad} for i in range(12_000)]
        for i in range(0, len(rows), 2000):
            store.append.remote(rows[i:i + 2000]).result()
        r = httpx.get(service[0] + "/steps/specload/step_log",
                      params={"strategy": "steps", "since": t0 - 1}, timeout=120)
        assert r.status_code == 200, r.text[:300]
        assert len(r.content) > 2 * 4 * 1024 * 1024
        got = r.json()["rows"]
        assert len(got) == 12_000 and got[-1][mn.STEP_TS] == rows[-1][mn.STEP_TS]
    finally:
        serve.delete("steps")


def test_body_over_the_limit_is_a_413_on_both_routes(client, route):
    """A body over 4 MiB failed between the ingress and the replica (one gRPC message) with
    a plain-text 500; both fronts now answer 413 in OpenAI's shape before any hop."""
    from actors.serve.openai_request import MAX_REQUEST_BYTES

    body = {"model": "ngram", "prompt": "x" * (MAX_REQUEST_BYTES + 1000), "max_tokens": 2}
    r = client.post(v1(route, "ngram"), json=body)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    big_ok = client.post(v1(route, "ngram"), json={**body, "prompt": "x" * 600_000})
    assert big_ok.status_code == 400                        # under the limit: the context check
    assert big_ok.json()["error"]["code"] == "context_length_exceeded"
    assert_alive(client, "ngram", route)


def test_reset_prefix_cache_on_the_ingress_and_each_strategy_route(client, strategies):
    """vLLM's POST /reset_prefix_cache: on the ingress for one strategy (``?model=``) or all,
    and on each strategy's own route; an unknown model is a 404 with the OpenAI error body."""
    one = client.post("/reset_prefix_cache", params={"model": strategies[0]})
    assert one.status_code == 200 and one.json() == {"success": True, "strategies": {strategies[0]: True}}
    every = client.post("/reset_prefix_cache").json()
    assert every["success"] is True and set(every["strategies"]) >= set(strategies)
    for s in strategies:
        r = client.post(f"/strategies/{s}/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"success": True}, (s, r.text)
    bad = client.post("/reset_prefix_cache", params={"model": "nope"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
    assert_alive(client)   # serving goes on after the resets
