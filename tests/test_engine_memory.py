"""A replica's memory report on the embedded models, against hand-computed sizes."""

from __future__ import annotations

import pytest

from actors.engine.llm_engine import run_requests
from actors.engine.types import SamplingParams

# embedded target: 6 layers x 2 KV heads x 64 head dim x 2 (K, V) x 4 bytes (fp32 on the CPU)
TARGET_BPT = 6 * 2 * 64 * 2 * 4
DRAFT_BPT = 1 * 2 * 64 * 2 * 4          # models/draft: 1 layer, same attention shape


def test_target_memory_and_exact_peak_kv(make_engine):
    eng = make_engine("autoregressive", max_num_seqs=2, max_model_len=256)
    m0 = eng.memory()
    assert m0["target_kv_bytes_per_token"] == TARGET_BPT
    # 2 slots x (256 + 72 margin) tokens, all 6 layers' K and V
    assert m0["target_kv_allocated_bytes"] == 2 * (256 + 72) * TARGET_BPT
    n_params = eng.model.num_params()          # tied LM head counted once by both
    assert m0["target_weight_bytes"] == 4 * n_params
    assert m0["target_fused_weight_bytes"] > 0 and m0["draft_weight_bytes"] == 0
    assert m0["process_rss_bytes"] > m0["target_weight_bytes"]
    ids = eng.tokenizer("def add(a, b):", add_special_tokens=False)["input_ids"]
    eng.reset_peak_memory()
    run_requests(eng, [("r", ids, SamplingParams(max_tokens=20, ignore_eos=True))])
    m = eng.memory()
    # prefill writes the prompt; each of the 19 decode steps writes the previous output token
    assert m["target_kv_peak_tokens"] == len(ids) + 20 - 1
    assert m["target_kv_peak_used_bytes"] == (len(ids) + 19) * TARGET_BPT
    assert m["target_kv_tokens_used"] == 0     # the finished request released its slot


def test_draft_model_reports_its_own_cache(make_engine):
    eng = make_engine("draft_model", max_num_seqs=2, max_model_len=256)
    m = eng.memory()
    assert m["draft_kv_bytes_per_token"] == DRAFT_BPT
    assert m["draft_kv_allocated_bytes"] == 2 * (256 + 72) * DRAFT_BPT
    draft = eng.proposer.draft
    assert m["draft_weight_bytes"] == 4 * draft.num_params()
    ids = eng.tokenizer("import os\n", add_special_tokens=False)["input_ids"]
    eng.reset_peak_memory()
    run_requests(eng, [("a", ids, SamplingParams(max_tokens=24, ignore_eos=True)),
                       ("b", ids, SamplingParams(max_tokens=24, ignore_eos=True))], batch_size=2)
    m = eng.memory()
    k = eng.num_speculative_tokens
    # two requests; the draft cache holds at most the sequence plus the k-1 unverified drafts
    assert 0 < m["draft_kv_peak_tokens"] <= 2 * (len(ids) + 24 + k)
    assert m["target_kv_peak_tokens"] <= 2 * (len(ids) + 24 + k)
    assert m["draft_kv_peak_used_bytes"] == m["draft_kv_peak_tokens"] * DRAFT_BPT


@pytest.mark.parametrize("strategy", ["dflash"])
def test_block_drafter_shares_target_tensors(make_engine, strategy):
    eng = make_engine(strategy, max_num_seqs=2, max_model_len=256)
    m = eng.memory()
    # the drafter reuses the target's embedding and LM head (not its own parameters)
    assert m["draft_weight_bytes"] == 4 * eng.proposer.drafter.num_params()
    assert m["draft_kv_bytes_per_token"] == DRAFT_BPT       # 1 context layer, 2 KV heads x 64
    # per slot: max_model_len positions + one block of scratch for the block's own K/V
    bs = eng.proposer.block_size
    assert m["draft_kv_allocated_bytes"] == 2 * (256 + bs) * DRAFT_BPT
    # the fused inference copies (q|k|v, o, gate|up, down, the context fusion fc) and their
    # bfloat16-packed twins (the C kernels': 2 bytes a weight; k|v a view of q|k|v's) are
    # counted apart; the transposed LM head is the target's (counted there), not a second copy
    d = eng.proposer.drafter
    layer = d.layers[0]
    assert layer._kv_pk.untyped_storage().data_ptr() == layer._qkv_pk.untyped_storage().data_ptr()
    assert m["draft_fused_weight_bytes"] == 4 * sum(
        t.numel() for t in (layer._qkv_wt, layer._o_wt, layer._gate_up_wt, layer._down_wt,
                            layer._qk_norm_w, d._fc_wt)) + 2 * sum(
        t.numel() for t in (layer._qkv_pk, layer._o_pk, layer._gate_up_pk, layer._down_pk,
                            d._fc_pk))


def test_slot_pool_tracks_used_and_peak_tokens():
    from actors.engine.kv_cache import KVSlotPool

    pool = KVSlotPool(2, 100)
    pool.allocate("a")
    pool.allocate("b")
    pool.append("a", 10)
    pool.append("b", 5)
    pool.append("a", 8)                 # a verification row: 1 + 7 drafts written
    assert pool.used == 23 and pool.peak_used == 23
    pool.rollback("a", 12)              # 6 rejected drafts leave the cache
    assert pool.used == 17 and pool.peak_used == 23
    pool.free("b")
    assert pool.used == 12
    pool.reset_peak()
    assert pool.peak_used == 12
    pool.append("a", 3)
    assert pool.peak_used == 15
