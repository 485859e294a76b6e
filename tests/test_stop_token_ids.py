"""vLLM's ``stop_token_ids`` on every strategy (issue 42).

A greedy request with ``stop_token_ids: [t]`` for a token t the model emits at
position p stops there: token ids up to and including t (vLLM keeps the stop token
in the ids and counts it), its text without t's text unless
``include_stop_str_in_output``, finish_reason "stop", ``stop_reason`` t; identical
to autoregressive. Speculative strategies emit several tokens per step: a stop token
inside an accepted block cuts the block there, and the request's counters keep no
token after it (tokens = 1 prefill token + verification steps + accepted drafts).
"""

from __future__ import annotations

import pytest

from actors.engine.llm_engine import run_requests
from actors.engine.types import SamplingParams

STRATEGIES = [("autoregressive", {}), ("draft_model", {}), ("ngram", {"prompt_lookup_min": 1}),
              ("dflash", {}), ("dflash2", {}), ("dspark", {})]
MAX_TOKENS = 24
N_PROMPTS = 8


def _engine(make_engine, strategy, opts):
    kw = {} if strategy == "autoregressive" else {"num_speculative_tokens": 5}
    return make_engine(strategy, max_num_seqs=8, strategy_options=opts, **kw)


@pytest.fixture(scope="module")
def reference(make_engine, heldout_prompts):
    eng = make_engine("autoregressive", max_num_seqs=8, strategy_options={})
    reqs = [(p["id"], p["prompt"], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
            for p in heldout_prompts[:N_PROMPTS]]
    return run_requests(eng, reqs)


def _stop_plan(reference, prompts):
    """Per prompt: (stop token t = the token at position 2/3 of the output, the first
    position where t occurs)."""
    plan = {}
    for p in prompts:
        ids = reference[p["id"]]["token_ids"]
        t = ids[(2 * len(ids)) // 3]
        plan[p["id"]] = (t, ids.index(t))
    return plan


def _counters_match(res) -> bool:
    st = res["stats"]
    return len(res["token_ids"]) == 1 + st.num_steps + st.num_accepted_tokens


@pytest.mark.parametrize("strategy,opts", STRATEGIES, ids=[s for s, _ in STRATEGIES])
def test_stop_token_ids_cut_where_autoregressive_does(strategy, opts, make_engine,
                                                      heldout_prompts, reference):
    eng = _engine(make_engine, strategy, opts)
    prompts = heldout_prompts[:N_PROMPTS]
    plan = _stop_plan(reference, prompts)
    cuts = []   # (tokens the step emitted, tokens kept) of each step a stop token ended
    orig = eng.detok.append

    def append(r, tokens, logprobs=None):
        kept = orig(r, tokens, logprobs)
        if r.stop_reason is not None and isinstance(r.stop_reason, int):
            cuts.append((len(tokens), kept))
        return kept

    eng.detok.append = append
    try:
        for include in (False, True):
            reqs = [(p["id"], p["prompt"], SamplingParams(
                max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=(plan[p["id"]][0],),
                include_stop_str_in_output=include)) for p in prompts]
            for batch in (1, 8):
                out = run_requests(eng, reqs, batch_size=batch)
                for p in prompts:
                    t, pos = plan[p["id"]]
                    ref = reference[p["id"]]["token_ids"]
                    res = out[p["id"]]
                    assert res["token_ids"] == ref[:pos + 1], (p["id"], include, batch)
                    assert res["finish_reason"] == "stop" and res["stop_reason"] == t
                    want = eng.detok.decode(ref[:pos + 1] if include else ref[:pos],
                                            skip_special_tokens=True)
                    assert res["text"] == want, (p["id"], include)
                    assert _counters_match(res), (p["id"], res["stats"])
    finally:
        del eng.detok.append
    assert len(cuts) == 4 * N_PROMPTS
    if strategy != "autoregressive":   # a stop token inside a multi-token block was cut there
        assert any(emitted > kept for emitted, kept in cuts), cuts


def test_stop_token_ids_wait_for_min_tokens(make_engine, heldout_prompts, reference):
    """Like EOS, a stop token id is masked before min_tokens (vLLM's min-tokens processor)."""
    eng = make_engine("ngram", max_num_seqs=8, strategy_options={"prompt_lookup_min": 1},
                      num_speculative_tokens=5)
    p = heldout_prompts[0]
    ref = reference[p["id"]]["token_ids"]
    t = ref[1]
    first = ref.index(t)
    res = run_requests(eng, [("m", p["prompt"], SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=(t,),
        min_tokens=first + 2))])["m"]
    assert t not in res["token_ids"][:first + 2]
    assert res["finish_reason"] in ("stop", "length")
    if res["finish_reason"] == "stop":
        assert res["token_ids"][-1] == t and res["stop_reason"] == t
        assert len(res["token_ids"]) > first + 2
    assert _counters_match(res)


def test_bad_stop_token_ids_name_the_field():
    from actors.engine.errors import InvalidRequest

    for bad in ((-1,), ("3",), (True,)):
        with pytest.raises(InvalidRequest) as exc:
            SamplingParams(stop_token_ids=bad)
        assert exc.value.param == "stop_token_ids"


# ------------------------------------------------------------------ through the replica
def test_stop_token_ids_through_the_replica_body_and_stream(heldout_prompts, reference):
    """The request body -> ``parse_request`` -> the strategy replica (the class a
    replica's own listener and the proxy route both run, in-process here) -> the
    non-streamed body and the SSE stream: cut at the stop token, ``finish_reason`` stop,
    ``stop_reason`` the id, usage counting it; the same for autoregressive and ngram."""
    import asyncio
    import json

    from actors.serve.deployments import StrategyReplica as Replica
    from actors.serve.openai_request import parse_request
    from actors.serve.openai_response import ResponseContext, collect_body, sse_events
    from actors.serve.protocol import Admitted

    p = heldout_prompts[0]
    ref = reference[p["id"]]["token_ids"]
    t = ref[(2 * len(ref)) // 3]
    pos = ref.index(t)

    async def one(rep, body, stream):
        req = parse_request(body, False)
        gen = rep.generate(f"r{stream}", req.prompt, req.params)
        first = await gen.__anext__()
        assert isinstance(first, Admitted), first
        ctx = ResponseContext("r", body["model"], 0, False, first.num_prompt_tokens)
        if stream:
            return [json.loads(x[6:]) for x in
                    [line async for line in sse_events(gen, ctx, include_usage=True)]
                    if x.startswith("data: ") and "[DONE]" not in x]
        return await collect_body(gen, ctx)

    async def main(strategy):
        rep = Replica(strategy, {"strategy": strategy, "max_num_seqs": 4, "torch_threads": 1,
                                 "num_speculative_tokens": 0 if strategy == "autoregressive"
                                 else 4})
        body = {"model": strategy, "prompt": p["prompt"], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stop_token_ids": [t]}
        try:
            return (await one(rep, body, False),
                    await one(rep, {**body, "stream": True,
                                    "stream_options": {"include_usage": True}}, True))
        finally:
            rep.engine.shutdown()

    for strategy in ("autoregressive", "ngram"):
        body, events = asyncio.run(main(strategy))
        choice = body["choices"][0]
        assert choice["token_ids"] == ref[:pos + 1], strategy
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == t
        assert body["usage"]["completion_tokens"] == pos + 1
        chunks = [e for e in events if e["choices"]]
        assert [i for e in chunks for i in e["choices"][0]["token_ids"]] == ref[:pos + 1]
        assert "".join(e["choices"][0]["text"] for e in chunks) == choice["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"][0]["stop_reason"] == t
        assert events[-1]["usage"]["completion_tokens"] == pos + 1
