"""logprobs / top_logprobs, skip_special_tokens and min_tokens over HTTP (issues 19 items
4 + 6 and 22): every strategy, both routes (the strategy's own ``/strategies/<name>/v1``
and the ingress's ``model`` field), streamed and not, completions and chat.

One module-scoped Ray Serve service with all six strategies on the real engine (the
fake engine has no logits: skipped only under SPECLOAD_TEST_FAKE_ENGINE=1). ``dflash`` runs its
engine in its own process, so the new fields cross that pickle boundary too.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from configs.net import free_port  # noqa: E402
from configs.serve_config import REPLICA_ENV  # noqa: E402
from tests.logprob_checks import (ALL_STRATEGIES, LOGPROB_TOL, check_greedy_entry,  # noqa: E402
                                  same_or_tie)
from tests.serve_fixtures import parse_sse, use_real_engine  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    ", "The history of the city begins"]
ROUTES = ("strategy", "model-field")
EOS_TEXT = "<|endoftext|>"
TOP = 4


@pytest.fixture(scope="module")
def base_url():
    if not use_real_engine():   # SPECLOAD_TEST_FAKE_ENGINE=1 asked for the fake one
        pytest.skip("SPECLOAD_TEST_FAKE_ENGINE=1: logprobs come from the real engine's logits")
    from actors.serve.app import run_applications

    env = {"env_vars": dict(REPLICA_ENV)}
    strategies = []
    for s in ALL_STRATEGIES:
        engine = {"strategy": s, "max_num_seqs": 4, "max_waiting": 16, "torch_threads": 1}
        if s == "draft_model":
            engine["draft_model"] = "models/draft"
        strategies.append({"engine": engine, "engine_process": s == "dflash",
                           "ray_actor_options": {"num_cpus": 0.25, "runtime_env": env}})
    args = {"strategies": strategies,
            "ingress": {"ray_actor_options": {"num_cpus": 0.1, "runtime_env": env}}}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        run_applications(args, name="specload", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def path(route: str, model: str, chat: bool) -> str:
    return ((f"/strategies/{model}" if route == "strategy" else "")
            + ("/v1/chat/completions" if chat else "/v1/completions"))


def post(client, route, model, chat=False, **body) -> dict:
    body = {"model": model, **body}
    r = client.post(path(route, model, chat), json=body)
    assert r.status_code == 200, r.text
    return r.json()


def post_stream(client, route, model, chat=False, **body) -> list[dict]:
    """The chunks with choices (role chunk included) of a streamed request."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **body}
    with client.stream("POST", path(route, model, chat), json=body) as r:
        assert r.status_code == 200, r.read()
        events = parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    return [e for e in events[:-1] if e["choices"]], events[-2]["usage"]


def completion_lp(choice_lps: list[dict]) -> dict:
    """Streamed completions logprobs objects joined into one."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in choice_lps:
        for k in out:
            out[k] += lp[k]
    return out


def _greedy(prompt, **kw):
    return {"prompt": prompt, "max_tokens": 16, "temperature": 0, **kw}


@pytest.fixture(scope="module")
def reference(client):
    """autoregressive's greedy completions with logprobs (model-field route)."""
    return {p: post(client, "model-field", "autoregressive", **_greedy(p, logprobs=TOP))
            ["choices"][0] for p in PROMPTS}


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("route", ROUTES)
def test_completions_logprobs(client, reference, strategy, route):
    """Non-streamed: ids and token_logprobs equal autoregressive's (up to a tie), the
    chosen token the argmax of top_logprobs (which hold TOP + the chosen at most);
    streamed: per chunk the chunk's tokens only, joined equal to the non-streamed."""
    worst = 0.0
    for p in PROMPTS:
        ref = reference[p]
        full = post(client, route, strategy, **_greedy(p, logprobs=TOP))["choices"][0]
        lp = full["logprobs"]
        ids = full["token_ids"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
            == len(lp["text_offset"]) == len(ids)
        if full["text"].isascii():   # every token whole characters: pieces = the text
            assert "".join(lp["tokens"]) == full["text"]
            assert [full["text"][o:o + len(t)] for t, o in
                    zip(lp["tokens"], lp["text_offset"])] == lp["tokens"]
        n = _same_or_tie_text(ref, full)
        assert n >= 8
        for i in range(n):
            a, b = ref["logprobs"]["token_logprobs"][i], lp["token_logprobs"][i]
            worst = max(worst, abs(a - b))
            assert abs(a - b) < LOGPROB_TOL, (p, i, a, b)
            top = lp["top_logprobs"][i]
            assert lp["tokens"][i] in top and len(top) in (TOP, TOP + 1)
            assert max(top.values()) - lp["token_logprobs"][i] < 1e-4
        chunks, usage = post_stream(client, route, strategy, **_greedy(p, logprobs=TOP))
        for c in chunks:
            ch = c["choices"][0]
            assert len(ch["logprobs"]["tokens"]) == len(ch["token_ids"])
        joined = completion_lp([c["choices"][0]["logprobs"] for c in chunks])
        assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
        assert max(abs(a - b) for a, b in zip(joined["token_logprobs"],
                                               lp["token_logprobs"])) < LOGPROB_TOL
        assert [set(t) for t in joined["top_logprobs"]] == [set(t) for t in lp["top_logprobs"]] \
            or n < len(ids)
        assert usage["completion_tokens"] == len(ids)
        as_ids = post(client, route, strategy, **_greedy(
            p, logprobs=TOP, return_tokens_as_token_ids=True))["choices"][0]["logprobs"]
        assert as_ids["tokens"][:n] == [f"token_id:{t}" for t in ids[:n]]
        assert as_ids["text_offset"][:n] == lp["text_offset"][:n]
        plain = post(client, route, strategy, **_greedy(p))["choices"][0]
        assert plain["logprobs"] is None and plain["token_ids"][:n] == ids[:n]
    print(f"{strategy} {route}: max |token_logprob - autoregressive| = {worst:.2e}")


def _same_or_tie_text(ref: dict, got: dict) -> int:
    """``same_or_tie`` on completions choices (top_logprobs are keyed by token text)."""
    rl, gl = ref["logprobs"], got["logprobs"]
    return _tie(ref["token_ids"], rl["token_logprobs"], rl["top_logprobs"], got["token_ids"],
                gl["tokens"])


def _tie(rids, rlps, rtops: list[dict], gids, gtokens) -> int:
    """``same_or_tie`` from text-keyed top entries: at each position the reference's
    chosen logprob and, when the other output's token is among the reference's top,
    its logprob there."""
    tops = []
    for i, top in enumerate(rtops):
        by_id = {rids[i]: rlps[i]}
        if i < len(gids) and gtokens[i] in top:
            by_id[gids[i]] = top[gtokens[i]]
        tops.append(by_id)
    return same_or_tie(rids, tops, gids)


def chat_body(**kw):
    return {"messages": [{"role": "user", "content": "Write a function that adds two numbers."}],
            "max_tokens": 12, "temperature": 0, **kw}


@pytest.fixture(scope="module")
def chat_reference(client):
    return post(client, "model-field", "autoregressive", chat=True,
                **chat_body(logprobs=True, top_logprobs=TOP))["choices"][0]


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("route", ROUTES)
def test_chat_logprobs(client, chat_reference, strategy, route):
    full = post(client, route, strategy, chat=True,
                **chat_body(logprobs=True, top_logprobs=TOP))["choices"][0]
    content = full["logprobs"]["content"]
    ids = full["token_ids"]
    assert len(content) == len(ids)
    if full["message"]["content"].isascii():
        assert "".join(e["token"] for e in content) == full["message"]["content"]
    ref = chat_reference["logprobs"]["content"]
    n = _tie(chat_reference["token_ids"], [e["logprob"] for e in ref],
             [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in ref], ids,
             [e["token"] for e in content])
    assert n >= 6
    for a, b in zip(ref[:n], content[:n]):
        assert abs(a["logprob"] - b["logprob"]) < LOGPROB_TOL
        assert bytes(b["bytes"]) == b["token"].encode()
        check_greedy_entry(b["token"], b["logprob"],
                           [(e["token"], e["logprob"]) for e in b["top_logprobs"]], TOP)
        assert all(bytes(e["bytes"]) == e["token"].encode() for e in b["top_logprobs"])
    chunks, usage = post_stream(client, route, strategy, chat=True,
                                **chat_body(logprobs=True, top_logprobs=TOP))
    assert chunks[0]["choices"][0]["logprobs"] is None    # the role chunk
    streamed = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed, content)) < LOGPROB_TOL
    assert usage["completion_tokens"] == len(ids)
    none = post(client, route, strategy, chat=True, **chat_body(logprobs=False))
    assert none["choices"][0]["logprobs"] is None


BAD = [
    (False, {"logprobs": 21}, "logprobs"), (False, {"logprobs": -1}, "logprobs"),
    (False, {"logprobs": True}, "logprobs"), (False, {"logprobs": 1.5}, "logprobs"),
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (True, {"top_logprobs": 2}, "top_logprobs"), (True, {"logprobs": 3}, "logprobs"),
    (False, {"min_tokens": -1}, "min_tokens"), (False, {"min_tokens": 17}, "min_tokens"),
    (True, {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    (False, {"min_tokens": 2.5}, "min_tokens"),
    (False, {"skip_special_tokens": "no"}, "skip_special_tokens"),
    (True, {"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
]


@pytest.mark.parametrize("chat,extra,param", BAD)
@pytest.mark.parametrize("route", ROUTES)
def test_bad_values_are_400_naming_the_field(client, chat, extra, param, route):
    body = {"model": "ngram", **(chat_body() if chat else {"prompt": "hi"}), **extra}
    for stream in (False, True):
        r = client.post(path(route, "ngram", chat), json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("route", ROUTES)
def test_explicit_nulls(client, route):
    nulls = {"logprobs": None, "min_tokens": None, "skip_special_tokens": None,
             "spaces_between_special_tokens": None}
    out = post(client, route, "ngram", **_greedy(PROMPTS[0], **nulls))
    assert out["choices"][0]["logprobs"] is None
    chat = post(client, route, "ngram", chat=True, **chat_body(top_logprobs=None, **nulls))
    assert chat["choices"][0]["logprobs"] is None
    zero = post(client, route, "ngram", **_greedy(PROMPTS[0], logprobs=0))["choices"][0]
    assert [list(t) for t in zero["logprobs"]["top_logprobs"]] == [[t] for t in
                                                                   zero["logprobs"]["tokens"]]


# ------------------------------------------------------------------ special tokens
EOS_SAMPLING = {"max_tokens": 16, "temperature": 3.0, "top_k": 2, "ignore_eos": True}


def _eos_prompt() -> list[int]:
    import json

    from transformers import AutoTokenizer

    from tests.serve_fixtures import REPO

    tok = AutoTokenizer.from_pretrained(REPO / "models" / "target")
    rows = (REPO / "data" / "prompts" / "heldout_eval.jsonl").read_text().splitlines()
    return tok(json.loads(rows[15])["prompt"], add_special_tokens=False)["input_ids"][:30]


@pytest.fixture(scope="module")
def eos_prompt():
    return _eos_prompt()


def _seed_with_eos(client, strategy, prompt) -> int:
    for seed in range(40):
        out = post(client, "model-field", strategy, prompt=prompt, seed=seed, **EOS_SAMPLING)
        if 0 in out["choices"][0]["token_ids"]:
            return seed
    pytest.fail(f"{strategy}: no seed in 0..39 emitted EOS")


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_skip_special_tokens(client, eos_prompt, strategy):
    seed = _seed_with_eos(client, strategy, eos_prompt)
    for route in ROUTES:
        res = {}
        for skip in (None, True, False):
            body = {"prompt": eos_prompt, "seed": seed, **EOS_SAMPLING}
            if skip is not None:
                body["skip_special_tokens"] = skip
            full = post(client, route, strategy, **body)
            chunks, usage = post_stream(client, route, strategy, **body)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
            choice = full["choices"][0]
            assert text == choice["text"] and ids == choice["token_ids"]
            assert usage == full["usage"] and usage["completion_tokens"] == 16
            res[skip] = choice
        assert res[None] == res[True]
        assert res[False]["token_ids"] == res[True]["token_ids"]
        n_eos = res[True]["token_ids"].count(0)
        assert n_eos >= 1 and EOS_TEXT not in res[True]["text"]
        assert res[False]["text"].count(EOS_TEXT) == n_eos
        assert res[False]["text"].replace(EOS_TEXT, "") == res[True]["text"]


# ------------------------------------------------------------------ min_tokens
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_min_tokens_blocks_eos(client, eos_prompt, strategy):
    """A seeded sampled request that ends at EOS early: with min_tokens = 10 the same
    request has >= 10 tokens and no EOS among them (both routes, streamed and not)."""
    body = {"prompt": eos_prompt, "max_tokens": 16, "temperature": 3.0, "top_k": 2}
    for seed in range(60):
        out = post(client, "model-field", strategy, seed=seed, **body)["choices"][0]
        if out["finish_reason"] == "stop" and len(out["token_ids"]) < 10:
            break
    else:
        pytest.fail(f"{strategy}: no seed in 0..59 ended at EOS within 10 tokens")
    assert out["token_ids"][-1] == 0
    for route in ROUTES:
        full = post(client, route, strategy, seed=seed, min_tokens=10, **body)["choices"][0]
        ids = full["token_ids"]
        assert len(ids) >= 10 and 0 not in ids[:10]
        assert full["finish_reason"] == ("stop" if ids[-1] == 0 else "length")
        chunks, usage = post_stream(client, route, strategy, seed=seed, min_tokens=10, **body)
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids
        assert usage["completion_tokens"] == len(ids)


@pytest.mark.parametrize("route", ROUTES)
def test_min_tokens_greedy_identical_and_defers_stop(client, route):
    """Greedy with min_tokens and a stop string found inside the first min_tokens tokens'
    text: every strategy returns autoregressive's text, cut at the first match that ends
    after that text."""
    p, m = PROMPTS[0], 6
    ref = post(client, "model-field", "autoregressive", **_greedy(p, max_tokens=32,
                                                                  ignore_eos=True))["choices"][0]
    from transformers import AutoTokenizer

    from tests.serve_fixtures import REPO

    tok = AutoTokenizer.from_pretrained(REPO / "models" / "target")
    text = ref["text"]
    floor = len(tok.decode(ref["token_ids"][:m]))
    stop = sorted(s for s in {text[i] for i in range(floor)} if text.find(s, floor) > 0)[0]
    want = text[:text.find(stop, floor)]
    for strategy in ALL_STRATEGIES:
        body = _greedy(p, max_tokens=32, ignore_eos=True, stop=[stop], min_tokens=m)
        full = post(client, route, strategy, **body)["choices"][0]
        assert full["finish_reason"] == "stop" and full["text"] == want, strategy
        chunks, _ = post_stream(client, route, strategy, **body)
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
