"""Prefix caching and compact KV slots: same tokens, fewer prompt tokens computed."""

from __future__ import annotations

import pytest

from actors.engine.kv_cache import KVSlotPool
from actors.engine.llm_engine import run_requests
from actors.engine.types import SamplingParams


def test_free_compact_keeps_owned_slots_a_prefix():
    pool = KVSlotPool(4, 8)
    for rid in "abcd":
        pool.allocate(rid)
    pool.append("d", 3)
    assert pool.free_compact("b") == ("d", 3, 1)      # the highest moved into the hole
    assert [pool.slot(r) for r in "acd"] == [0, 2, 1] and pool.length("d") == 3
    assert pool.free_compact("d") == ("c", 2, 1)
    assert pool.free_compact("c") is None             # the highest itself: nothing moves
    assert pool.allocate("e") == 1                    # the lowest free slot
    assert pool.num_free == 2


def _run(eng, prompts, n=12):
    reqs = [(f"r{i}-{id(prompts)}", p, SamplingParams(max_tokens=n, temperature=0.0))
            for i, p in enumerate(prompts)]
    rows = []
    eng.on_step = rows.append
    out = run_requests(eng, reqs, batch_size=4, arrival_steps=[2 * i for i in range(len(reqs))])
    eng.on_step = None
    return [out[r[0]]["token_ids"] for r in reqs], sum(r["prefill_tokens"] for r in rows)


@pytest.mark.parametrize("strategy", ["autoregressive", "ngram", "draft_model"])
def test_prefix_cache_hits_give_the_same_tokens(make_engine, heldout_prompts, strategy):
    prompts = [p["prompt"] for p in heldout_prompts[:6]]
    k = 0 if strategy == "autoregressive" else 4
    plain = make_engine(strategy, num_speculative_tokens=k)
    cached = make_engine(strategy, num_speculative_tokens=k, enable_prefix_caching=True)
    ref, ref_prefill = _run(plain, prompts + prompts)
    first, _ = _run(cached, prompts)                  # stores the prompts' K/V
    again, again_prefill = _run(cached, prompts)      # every prompt now starts cached
    assert cached.prefix_cache is not None and cached.prefix_cache.hits > 0
    assert first == ref[:6] and again == ref[6:]      # greedy: identical tokens
    assert again_prefill < ref_prefill / 2 / 2        # most prompt tokens not computed again


def test_prefix_cache_is_off_for_drafters_that_read_target_hidden_states(make_engine):
    assert make_engine("dflash", enable_prefix_caching=True).prefix_cache is None


@pytest.mark.parametrize("strategy", ["autoregressive", "ngram", "draft_model", "dflash"])
def test_reset_prefix_cache_makes_the_next_run_prefill_everything(make_engine, heldout_prompts, strategy):
    """vLLM's reset_prefix_cache: after it, the same prompts are prefilled whole again (the
    load generator resets before each cell, so no cell reuses an earlier cell's prompts);
    greedy tokens unchanged. A strategy without prefix caching (dflash) has nothing to forget."""
    prompts = [p["prompt"] for p in heldout_prompts[:4]]
    k = 0 if strategy == "autoregressive" else 4
    eng = make_engine(strategy, num_speculative_tokens=k, enable_prefix_caching=True)
    assert eng.reset_prefix_cache() is True    # the fixture may hand out an engine used before
    cold, cold_prefill = _run(eng, prompts)
    warm, warm_prefill = _run(eng, prompts)
    assert eng.reset_prefix_cache() is True
    again, again_prefill = _run(eng, prompts)
    assert again_prefill == cold_prefill                      # every prompt token computed again
    assert cold == warm == again
    if eng.prefix_cache is not None:
        assert warm_prefill < cold_prefill / 2
    else:
        assert warm_prefill == cold_prefill
