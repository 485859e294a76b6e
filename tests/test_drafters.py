"""DFlash / DFlash 2 / DSpark: block boundaries, the non-anticipating scheduler,
greedy equivalence with autoregressive decoding and lossless sampling."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from actors.drafters.config import DrafterConfig
from actors.drafters.length_scheduler import StepCostCurve, schedule_lengths
from actors.drafters.model import BlockDrafter, DynamicConv2
from actors.engine.llm_engine import run_requests
from actors.engine.model import CausalLM, ModelConfig
from actors.engine.types import ProposeInput, SamplingParams
from tests.lossless import assert_sampling_lossless

MAX_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread here: on a shared 2-core box two OpenMP threads spin-wait
    for each other and these engine-heavy tests run several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
SCHEDULED = ("dspark", {"scheduler": True})
STRATEGIES = [("dflash", {}), ("dflash2", {}), ("dspark", {}), SCHEDULED]


def _tiny_target(seed=0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    return CausalLM(cfg).eval()


def _random_drafter(target, **switches) -> BlockDrafter:
    torch.manual_seed(1)
    d = BlockDrafter(DrafterConfig.for_target(target.config, "dspark", **switches))
    with torch.no_grad():  # move the zero-initialised heads off their identity start
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d.bind_target(target).eval()


# -- the convolution never crosses a block boundary ---------------------------------
def test_conv_never_crosses_block_boundary():
    torch.manual_seed(0)
    conv = DynamicConv2(16, 4)
    with torch.no_grad():
        conv.up.weight.normal_()
    x = torch.randn(2, 3 * 8, 16)
    y = conv(x, 8)
    x2 = x.clone()
    x2[:, :8] += torch.randn(2, 8, 16)  # change every input of block 0
    y2 = conv(x2, 8)
    assert torch.equal(y[:, 8:], y2[:, 8:])  # blocks 1, 2 (incl. their position 0) unchanged
    x3 = x.clone()
    x3[:, 8] += 1.0  # block 1 position 0 does reach block 1 position 1 (the conv is live)
    assert not torch.allclose(conv(x3, 8)[:, 9], y[:, 9])


def test_block_drafter_blocks_are_independent():
    """Two blocks laid end to end (training layout): changing block 0's anchor
    and context leaves block 1 bit-identical, conv included."""
    target = _tiny_target()
    d = _random_drafter(target, use_conv=True)
    C = 20
    aux = torch.randn(1, C, len(d.config.target_layer_ids) * 32)
    kv = d.context_kv(aux, torch.arange(C)[None])
    anchors = torch.tensor([[5, 12]])
    ids = torch.tensor([[3, 4]])
    mask = torch.arange(C)[None, None] < anchors[..., None]
    h = d.block_hidden(ids, anchors, kv, mask)
    h2 = d.block_hidden(torch.tensor([[50, 4]]), anchors, kv, mask)
    bs = d.config.block_size
    assert torch.equal(h[:, bs:], h2[:, bs:])
    assert not torch.allclose(h[:, :bs], h2[:, :bs])


def test_conv_params_within_5_percent():
    target = CausalLM.from_pretrained("models/target")
    d = BlockDrafter(DrafterConfig.for_target(target.config, "dflash2", use_conv=True,
                                              use_selector=True))
    assert d.num_params("conv") <= 0.05 * d.num_params()


# -- the scheduler ------------------------------------------------------------------
def test_schedule_lengths_respond_to_cost_and_stay_in_bounds():
    surv = [np.cumprod([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])[:m] for m in (7, 3, 0)]
    flat = StepCostCurve([1, 1000], [5.0, 5.0])
    assert schedule_lengths(surv, flat) == [7, 3, 0]  # free tokens: verify all allowed
    linear = StepCostCurve([1, 1000], [1.0, 1000.0])
    assert schedule_lengths(surv, linear) == [0, 0, 0]  # each token costs a whole step
    knee = StepCostCurve([1, 8, 64, 512], [10.0, 12.0, 30.0, 200.0])
    one = schedule_lengths([surv[0]], knee)[0]
    many = schedule_lengths([surv[0]] * 64, knee)
    assert 0 < one <= 7 and max(many) <= one and sum(many) < 64 * one


def test_vectorised_walks_equal_the_sequential_walks():
    """DSpark's Markov walk over the candidate table (with the exact fallback for a
    previous token outside the candidates) and DFlash 2's path walk over the [V, 3r]
    projection table (on a CPU: ``selector_walk_f32``, one C call) give the step-by-step
    walks' tokens, z and logits."""
    from actors.drafters.decode import markov_walk

    target = _tiny_target()
    d = _random_drafter(target, use_markov=True, use_selector=True)
    torch.manual_seed(3)
    B, n = 5, 7
    hd = torch.randn(B, n, target.config.hidden_size)
    anchors = torch.randint(0, target.config.vocab_size, (B,))
    base = d.lm_logits(hd)
    seq = markov_walk(d, hd, base, anchors, max_elements=0)
    for k in (16, 2):  # 2 candidates: most rows leave the table and finish exactly
        vec = markov_walk(d, hd, base, anchors, candidates=k, max_elements=1 << 22)
        assert torch.equal(vec[0], seq[0])
        assert torch.allclose(vec[1], seq[1], atol=1e-5) and torch.allclose(vec[2], seq[2],
                                                                             atol=1e-4)
    # the sequential reference itself: step i's argmax feeds step i + 1
    z = torch.nn.functional.silu(d.markov.prev(d.embed(seq[0][:, 2])) + d.markov.hid(hd[:, 3]))
    assert torch.equal((base[:, 3] + z.float() @ d.markov_vocab_proj().T).argmax(-1), seq[0][:, 3])
    top = base.topk(8, -1)
    logp = top.values - torch.logsumexp(base, -1, keepdim=True)
    sel = d.selector
    plain = sel.walk(hd, logp, top.indices, anchors, d.embed)
    tabled = sel.walk(hd, logp, top.indices, anchors, d.embed,
                      d.vocab_table("selector", sel.cand, sel.right, sel.left))
    assert torch.equal(plain, tabled)


def _scheduled_proposer(tmp_path, target):
    from actors.proposers.dspark import DSparkOptions, DSparkProposer

    d = _random_drafter(target, use_markov=True, use_confidence=True)
    d.save(tmp_path / "dspark")
    opts = DSparkOptions(drafter=str(tmp_path / "dspark"), scheduler=True,
                         step_cost_ms=[(1, 10.0), (8, 12.0), (16, 20.0), (64, 60.0)])
    return DSparkProposer(target, 7, 4, 256, None, opts)


def test_scheduler_is_non_anticipating(tmp_path):
    """The verification lengths chosen at a step do not change when the target's
    logits for the drafted tokens change (here: the target's final norm, which
    the drafter never reads, is perturbed after the context was observed), and
    ``propose`` never runs the target."""
    target = _tiny_target()
    prop = _scheduled_proposer(tmp_path, target)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (30, 41, 17)]
    for i, s in enumerate(seqs):
        with torch.no_grad():
            aux = target(torch.tensor([s[:-1]]), aux_layers=prop.aux_layers).aux_hidden[0]
        prop.observe_target(f"r{i}", 0, s[:-1], aux)
    batch = [ProposeInput(f"r{i}", s, m, SamplingParams(), None)
             for i, (s, m) in enumerate(zip(seqs, (7, 7, 3)))]
    calls = []
    hook = target.register_forward_pre_hook(lambda *a: calls.append(1))
    first = prop.propose(batch)
    hook.remove()
    assert not calls, "propose ran the target: the schedule could see its verdict"

    def verify_logits(model, s, draft):
        with torch.no_grad():
            return model(torch.tensor([s + draft])).logits[0, len(s) - 1:]

    changed = copy.deepcopy(target)
    with torch.no_grad():
        changed.model.norm.weight.mul_(torch.rand_like(changed.model.norm.weight) * 3)
    prop.target = changed
    second = prop.propose(batch)
    assert [p.token_ids for p in first] == [p.token_ids for p in second]
    assert any(not torch.allclose(verify_logits(target, s, p.token_ids),
                                  verify_logits(changed, s, p.token_ids))
               for s, p in zip(seqs, first) if p.token_ids)
    for p, b in zip(first, batch):
        assert len(p.token_ids) <= min(b.max_draft, prop.block_size - 1)


# -- greedy equivalence and lossless sampling on the committed drafters -------------
def _greedy(engine, prompts, **kw):
    reqs = [(p["id"], p["prompt"], SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
    return run_requests(engine, reqs, **kw)


@pytest.fixture(scope="module")
def prompts24(heldout_prompts):
    return heldout_prompts[:12] + heldout_prompts[24:36]  # 12 code + 12 prose


@pytest.fixture(scope="module")
def ar_reference(make_engine, prompts24):
    return _greedy(make_engine("autoregressive", max_num_seqs=8), prompts24)


@pytest.mark.parametrize("strategy,opts", STRATEGIES, ids=["dflash", "dflash2", "dspark",
                                                           "dspark_scheduled"])
def test_greedy_identical_to_autoregressive(strategy, opts, make_engine, prompts24,
                                            ar_reference):
    eng = make_engine(strategy, max_num_seqs=8, num_speculative_tokens=7,
                      strategy_options=opts)
    b1 = _greedy(eng, prompts24)
    arrivals = [(i % 8) * 3 + (i // 8) * 30 for i in range(len(prompts24))]
    b8 = _greedy(eng, prompts24, batch_size=8, arrival_steps=arrivals)
    for p in prompts24:
        ref = ar_reference[p["id"]]["token_ids"]
        assert b1[p["id"]]["token_ids"] == ref, p["id"]
        assert b8[p["id"]]["token_ids"] == ref, p["id"]
    accepted = sum(b1[p["id"]]["stats"].num_accepted_tokens for p in prompts24)
    assert accepted > 0, "the drafter never had a token accepted"


def test_dflash2_sampling_lossless_chi_square(make_engine):
    """2,000 seeded trials: the joint of the first three emitted tokens (prefill
    token, then the first two speculative positions) matches the target's."""
    assert_sampling_lossless(make_engine("dflash2", max_num_seqs=64, num_speculative_tokens=2),
                             seed0=5000)


def test_fused_inference_path_matches_the_modules():
    """``BlockDrafter.fuse`` (fused q|k|v and gate|up GEMMs, rope table, host argmax,
    the lean Markov walk) computes what the plain modules compute, up to float
    rounding, and drafts the same tokens; ``train()`` drops the fused copies; a
    deferred confidence equals the one computed in the step."""
    from actors.drafters.decode import draft_block, draft_confidence

    target = _tiny_target()
    target.fuse()
    d = _random_drafter(target, use_conv=True, use_markov=True, use_confidence=True)
    C, B = 30, 3
    torch.manual_seed(5)
    aux = torch.randn(B, C, len(d.config.target_layer_ids) * 32)
    pos = torch.arange(C)[None].expand(B, C)
    anchors = torch.tensor([[29], [17], [23]])
    ids = torch.tensor([[3], [40], [7]])
    mask = torch.arange(C)[None, None] < anchors[..., None]

    def run():
        kv = d.context_kv(aux, pos)
        h = d.block_hidden(ids, anchors, kv, mask)
        return kv, h, draft_block(d, h, ids[:, 0], top_k=1)

    kv0, h0, d0 = run()
    d.fuse()
    kv1, h1, d1 = run()
    assert d.layers[0]._qkv_wt is not None
    for (k0, v0), (k1, v1) in zip(kv0, kv1):
        assert torch.allclose(k0, k1, atol=1e-5) and torch.allclose(v0, v1, atol=1e-5)
    assert torch.allclose(h0, h1, atol=1e-5)
    assert not torch.equal(h0, torch.zeros_like(h0))
    # the block's K/V written into scratch room past the context (no concatenation)
    bs = d.config.block_size
    room = [tuple(torch.cat([t, torch.full_like(t[:, :, :bs], 7.0)], 2) for t in kv)
            for kv in kv1]
    for fused in (True, False):
        d.fuse(fused)
        h_room = d.block_hidden(ids, anchors, room, mask, ctx_room=True)
        assert torch.allclose(h_room, h1, atol=1e-5)
    d.fuse()
    assert not torch.equal(room[0][0][:, :, -bs:], torch.full_like(room[0][0][:, :, -bs:], 7.0))
    assert torch.equal(d0.tokens, d1.tokens)
    assert torch.allclose(d0.logits, d1.logits, atol=1e-4)
    assert torch.allclose(d0.confidence, d1.confidence, atol=1e-5)
    late = draft_block(d, h1, ids[:, 0], top_k=1, confidence=False)
    assert late.confidence is None and torch.equal(late.tokens, d1.tokens)
    assert torch.equal(draft_confidence(d, late.hidden, late.markov_z, late.logits),
                       d1.confidence)
    d.train()
    assert d.layers[0]._qkv_wt is None and not d._fast()


def test_ngram_lookup_equals_the_sliding_window_search():
    """The candidate-ends lookup proposes what a search of every window does: the tokens
    after the most recent earlier occurrence of the longest suffix n-gram (max_n..min_n),
    on sequences of a small vocabulary (many repeats), lists and arrays alike."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    from actors.proposers.ngram import ngram_lookup

    def windows_search(tokens, min_n, max_n, k):
        L = len(tokens)
        for n in range(min(max_n, L - 1), min_n - 1, -1):
            hits = np.flatnonzero((sliding_window_view(tokens[:L - 1], n)
                                   == tokens[L - n:]).all(axis=1))
            if len(hits):
                return tokens[int(hits[-1]) + n:int(hits[-1]) + n + k].tolist()
        return []

    rng = np.random.default_rng(0)
    found = 0
    for trial in range(400):
        vocab = int(rng.integers(2, 12))
        toks = rng.integers(0, vocab, int(rng.integers(1, 60)))
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        k = int(rng.integers(0, 6))
        want = windows_search(toks, min_n, max_n, k) if k > 0 and len(toks) >= 2 else []
        assert ngram_lookup(toks.tolist(), min_n, max_n, k) == want, (toks.tolist(), min_n, max_n, k)
        assert ngram_lookup(toks, min_n, max_n, k) == want
        found += bool(want)
    assert found > 100       # most sequences of a small vocabulary have a match
    assert ngram_lookup([5, 1, 2, 3, 9, 1, 2, 3], 2, 4, 3) == [9, 1, 2]
    assert ngram_lookup([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]   # the most recent


def _decision_tie(d_c, d_t, row: int, strategy: str) -> bool:
    """Whether two drafts of one row that differ do so at a numerical tie: at their first
    differing position the torch path's logits (dflash: the backbone's; dspark: the Markov
    head's corrected ones) put the two tokens within 1e-4, or (dflash2) the two paths'
    candidate log-probs there agree to 1e-4 (the selector's inputs: its pick then
    differs only by a score tie)."""
    a, b = d_t.tokens[row].tolist(), d_c.tokens[row].tolist()
    i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
    if strategy == "dflash2":
        return bool(torch.allclose(d_c.logits[row, i], d_t.logits[row, i], atol=1e-4))
    lg = d_t.logits[row, i]
    return abs(float(lg[a[i]] - lg[b[i]])) < 1e-4


@pytest.mark.parametrize("strategy", ["dflash", "dflash2", "dspark"])
def test_stack_draft_path_equals_the_torch_path(strategy, make_engine, prompts24):
    """The drafter on the C calls (``draft_stack``: the context K/V written by
    ``context_kv_f32``; the block forward, final norm, shared LM head, top-1 and top-k of
    every row in one ``block_draft_f32`` call, the anchor's output dropped after the last
    layer's attention (after its MLP convolution for DFlash 2, which reads the row before),
    and in the same call DFlash 2's selector walk or DSpark's Markov walk) against the
    torch form on the same state, at every draft of 3 concurrent requests with uneven contexts: the draft
    positions' hidden states and logits agree to float rounding, the top-k candidates
    are the torch ``topk``'s (values to rounding), and the drafted tokens are the torch
    path's except at a numerical tie (``_decision_tie``); the context K/V the C code
    wrote equal ``BlockDrafter.context_kv`` of the same target states."""
    from actors.drafters.decode import draft_block
    from actors.proposers.dflash import draft_stack

    eng = make_engine(strategy, max_num_seqs=4, num_speculative_tokens=7)
    prop = eng.proposer
    if prop.stack is None:
        pytest.skip("no decoder-stack kernel on this machine")
    d = prop.drafter
    checked = {"draft": 0, "ctx": 0, "ties": 0}
    orig_observe, orig_c = prop.observe_target, prop._block_draft_c

    def observe(rid, start, token_ids, aux):
        orig_observe(rid, start, token_ids, aux)
        if aux is None or not len(token_ids):
            return
        s = prop.cache.slot(rid)
        pos = torch.arange(start, start + len(token_ids))[None]
        for layer, (k, v) in enumerate(d.context_kv(aux[None], pos)):
            got_k = prop.cache.k[layer][s, start:start + len(token_ids)].transpose(0, 1)
            got_v = prop.cache.v[layer][s, start:start + len(token_ids)].transpose(0, 1)
            assert torch.allclose(got_k, k[0], atol=1e-5), (layer, float((got_k - k[0]).abs().max()))
            assert torch.allclose(got_v, v[0], atol=1e-5)
        checked["ctx"] += 1

    batches = []
    orig_draft = prop.draft

    def draft(batch):
        batches.append(batch)
        return orig_draft(batch)

    def c_call(anchor_ids, positions, slots, top_k):
        got = orig_c(anchor_ids, positions, slots, top_k)
        assert got is not None      # the C call applies on this engine
        hid, logits, top1, ki, kv = got[:5]
        # DFlash 2's selector and DSpark's Markov walk run in the same call
        assert (len(got) == 6) == (strategy != "dflash"), len(got)
        anchors = torch.tensor(anchor_ids)
        want = prop._block_hidden_ops(batches[-1], slots, anchors, positions)
        assert torch.allclose(hid, want[:, 1:], atol=2e-5), float((hid - want[:, 1:]).abs().max())
        sel = prop.use_selector
        k_ = top_k or 1
        d_c = draft_block(d, None, anchors, k_, sel, confidence=False, computed=got)
        d_t = draft_block(d, want, anchors, k_, sel, confidence=False)
        # the logits: the LM head's, or (dspark) the Markov head's corrected ones
        assert torch.allclose(logits, d_t.logits, atol=1e-4), float((logits - d_t.logits).abs().max())
        if strategy == "dspark":
            assert torch.allclose(d_c.markov_z, d_t.markov_z, atol=1e-5)
        else:
            assert torch.equal(top1, logits.argmax(-1))
        if top_k:
            top = logits.topk(top_k, dim=-1)
            assert torch.equal(kv, top.values)
            assert torch.equal(ki, top.indices) or torch.equal(
                logits.gather(-1, ki), top.values)      # equal values: order among ties
        for row in range(len(positions)):
            if not torch.equal(d_c.tokens[row], d_t.tokens[row]):
                assert _decision_tie(d_c, d_t, row, strategy), (
                    row, d_c.tokens[row].tolist(), d_t.tokens[row].tolist())
                checked["ties"] += 1
        checked["draft"] += 1
        return got

    prop.observe_target, prop._block_draft_c, prop.draft = observe, c_call, draft
    try:
        got = _greedy(eng, prompts24[:3], batch_size=3)
    finally:
        del prop.observe_target, prop._block_draft_c, prop.draft
    assert checked["draft"] >= 8 and checked["ctx"] >= 8, checked
    assert checked["ties"] <= checked["draft"] // 8, checked
    assert prop.last_path == "stack"
    assert all(len(r["token_ids"]) == MAX_TOKENS for r in got.values())
    assert draft_stack(d.train(), prop.cache) is None   # training: the torch form only
    d.eval().fuse()
