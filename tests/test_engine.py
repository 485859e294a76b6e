"""Engine correctness: lossless speculation, KV rollback, bad input.

docs/design.md "Lossless verification": greedy output must be token-identical to
``autoregressive`` for every strategy; sampled output must follow the
target's distribution.
"""

from __future__ import annotations

import pytest
import torch

from actors.engine.llm_engine import run_requests
from actors.engine.runner import RowInput
from actors.engine.types import SamplingParams
from tests.lossless import assert_sampling_lossless

STRATEGIES = ["draft_model", "ngram"]
MAX_TOKENS = 24


def _greedy(engine, prompts, batch_size=1, arrival_steps=None, max_tokens=MAX_TOKENS):
    reqs = [(p["id"], p["prompt"], SamplingParams(max_tokens=max_tokens)) for p in prompts]
    return run_requests(engine, reqs, batch_size=batch_size, arrival_steps=arrival_steps)


@pytest.fixture(scope="module")
def reference(make_engine, heldout_prompts):
    """Autoregressive greedy outputs at batch 1 (the ground truth)."""
    return _greedy(make_engine("autoregressive", max_num_seqs=8), heldout_prompts[:24] +
                   heldout_prompts[24:32])


@pytest.mark.parametrize("strategy", ["autoregressive"] + STRATEGIES)
def test_greedy_identical_batch1(strategy, make_engine, heldout_prompts, reference):
    prompts = heldout_prompts[:24] + heldout_prompts[24:32]
    out = _greedy(make_engine(strategy, max_num_seqs=8), prompts)
    for p in prompts:
        assert out[p["id"]]["token_ids"] == reference[p["id"]]["token_ids"], p["id"]
        assert len(out[p["id"]]["token_ids"]) == MAX_TOKENS or \
            out[p["id"]]["finish_reason"] == "stop"
    if strategy != "autoregressive":
        drafted = sum(out[p["id"]]["stats"].num_draft_tokens for p in prompts)
        accepted = sum(out[p["id"]]["stats"].num_accepted_tokens for p in prompts)
        assert drafted > 0 and accepted > 0, "the strategy never speculated"


@pytest.mark.parametrize("strategy", ["autoregressive"] + STRATEGIES)
def test_greedy_identical_staggered_batch8(strategy, make_engine, heldout_prompts, reference):
    # 8 requests of different lengths arriving at different steps, 4 cohorts of 8.
    prompts = heldout_prompts[:24] + heldout_prompts[24:32]
    arrivals = [(i % 8) * 3 + (i // 8) * 40 for i in range(len(prompts))]
    out = _greedy(make_engine(strategy, max_num_seqs=8), prompts, batch_size=8,
                  arrival_steps=arrivals)
    for p in prompts:
        assert out[p["id"]]["token_ids"] == reference[p["id"]]["token_ids"], p["id"]


@pytest.mark.parametrize("strategy,opts", [("draft_model", {}),
                                           ("ngram", {"prompt_lookup_min": 1})])
def test_sampling_lossless_chi_square(strategy, opts, make_engine):
    """>= 2,000 seeded trials: the joint of the first three emitted tokens (the
    prefill token then the first two speculative positions) matches the target."""
    engine = make_engine(strategy, max_num_seqs=64, strategy_options=opts,
                         num_speculative_tokens=2)
    assert_sampling_lossless(engine)


def test_sampling_seed_reproducible(make_engine, heldout_prompts):
    eng = make_engine("draft_model", max_num_seqs=8)
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    a = run_requests(eng, [("a", heldout_prompts[0]["prompt"], p)])
    b = run_requests(eng, [("b", heldout_prompts[0]["prompt"], p),
                           ("c", heldout_prompts[1]["prompt"], p)], batch_size=2)
    assert a["a"]["token_ids"] == b["b"]["token_ids"]


def test_kv_rollback_equals_fresh_prefill(make_engine, heldout_prompts):
    """After steps with rejected drafts, the target's cache for the accepted
    sequence equals a fresh prefill of that sequence."""
    eng = make_engine("draft_model", max_num_seqs=4, num_speculative_tokens=4)
    eng.add_request("r", heldout_prompts[3]["prompt"], SamplingParams(max_tokens=40))
    req = eng.requests["r"]
    rejected = 0
    while "r" in eng.requests:
        before = req.stats.num_draft_tokens - req.stats.num_accepted_tokens
        eng.step()
        rejected += (req.stats.num_draft_tokens - req.stats.num_accepted_tokens) - before
        if rejected and "r" in eng.requests and not req.in_prefill and req.stats.num_steps > 4:
            break
    assert rejected > 0, "no rejection happened; pick a harder prompt"
    n = req.num_computed
    assert eng.kv.length("r") == n == len(req.all_ids) - 1
    slot = req.slot
    ids = req.all_ids[:n]
    fresh = eng.kv.allocate("fresh")
    eng.runner.run([RowInput(fresh, eng.kv.append("fresh", n), ids)], last_only=True)
    for layer in range(eng.model.config.num_hidden_layers):
        k, v = eng.runner.cache.k[layer], eng.runner.cache.v[layer]
        assert torch.allclose(k[slot, :n], k[fresh, :n], atol=1e-5)
        assert torch.allclose(v[slot, :n], v[fresh, :n], atol=1e-5)
    eng.kv.free("fresh")
    eng.abort_request("r")
    assert not eng.has_unfinished_requests()
    assert eng.kv.num_free == 4 and eng.proposer.pool.num_free == 4


@pytest.mark.parametrize("field,kwargs", [
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("temperature", dict(temperature=-0.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_leave_running_requests_unharmed(make_engine, heldout_prompts, reference):
    eng = make_engine("ngram", max_num_seqs=8)
    good = [heldout_prompts[i] for i in (0, 1)]
    for p in good:
        eng.add_request(p["id"], p["prompt"], SamplingParams(max_tokens=MAX_TOKENS))
    got = {p["id"]: [] for p in good}
    for _ in range(3):
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("empty", "", SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("long", "x " * 5000, SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request(good[0]["id"], "hello", SamplingParams())
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    for p in good:
        assert got[p["id"]] == reference[p["id"]]["token_ids"]


def test_unknown_strategy_is_a_clear_error():
    from actors.engine.config import EngineConfig

    with pytest.raises(ValueError, match="strategy"):
        EngineConfig(strategy="medusa")


def test_stop_string_and_streaming_deltas(make_engine, heldout_prompts, reference):
    eng = make_engine("ngram", max_num_seqs=4)
    p = heldout_prompts[0]
    full = eng.tokenizer.decode(reference[p["id"]]["token_ids"])
    stop = full[len(full) // 2:len(full) // 2 + 3]
    res = run_requests(eng, [("s", p["prompt"], SamplingParams(max_tokens=MAX_TOKENS,
                                                               stop=[stop]))])["s"]
    assert res["finish_reason"] == "stop"
    assert res["text"] == full[:full.find(stop)]
    assert stop not in res["text"]


def test_max_tokens_caps_speculative_emission(make_engine, heldout_prompts):
    eng = make_engine("ngram", max_num_seqs=8)
    for n in (1, 2, 5):
        res = run_requests(eng, [("m", heldout_prompts[5]["prompt"],
                                  SamplingParams(max_tokens=n, ignore_eos=True))])["m"]
        assert len(res["token_ids"]) == n and res["finish_reason"] == "length"
