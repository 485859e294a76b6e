"""The batched step: the verifier (one host transfer per step) decides exactly as the
per-row one; the runner's cache views give the gathers' logits."""

from __future__ import annotations

import torch

from actors.engine.sampling import make_generator
from actors.engine.types import SamplingParams
from actors.engine.verifier import verify, verify_batch


def test_verify_batch_equals_per_row_verify():
    torch.manual_seed(0)
    V, B, Q = 50, 6, 5
    logits = torch.randn(B, Q, V) * 3
    lens = [5, 1, 3, 5, 2, 4]
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(),
              SamplingParams(temperature=0.7), SamplingParams(temperature=1.2, top_k=3)]
    drafts, qs = [], []
    for b, n in enumerate(lens):
        # half the drafts copy the target's argmax so both outcomes happen
        am = logits[b, :n - 1].argmax(-1).tolist()
        d = [t if i % 2 == 0 else (t + 1) % V for i, t in enumerate(am)]
        drafts.append(d)
        qs.append(torch.softmax(torch.randn(n - 1, V), -1) if b in (2, 5) and d else None)
    for seed in range(20):
        gens_a = [None if p.greedy else make_generator(seed * 10 + b) for b, p in enumerate(params)]
        gens_b = [None if p.greedy else make_generator(seed * 10 + b) for b, p in enumerate(params)]
        gens_c = [None if p.greedy else make_generator(seed * 10 + b) for b, p in enumerate(params)]
        got = verify_batch(logits, lens, drafts, qs, params, gens_a)
        # the per-row form (views of one forward, as the engine passes them) agrees
        rows = verify_batch([logits[b, :n] for b, n in enumerate(lens)], lens, drafts, qs,
                            params, gens_c)
        assert [(r.num_accepted, r.emitted) for r in rows] == \
               [(r.num_accepted, r.emitted) for r in got]
        want = [verify(logits[b, :lens[b]], drafts[b], qs[b], params[b], gens_b[b])
                for b in range(B)]
        assert [(r.num_accepted, r.emitted) for r in got] == \
               [(r.num_accepted, r.emitted) for r in want]
    # greedy rows accept exactly the matching prefix
    assert got[0].num_accepted == 1 and got[0].emitted[0] == drafts[0][0]
    assert got[1].num_accepted == 0 and got[1].emitted == [int(logits[1, 0].argmax())]


def test_verify_batch_rejects_inconsistent_lengths():
    import pytest

    with pytest.raises(ValueError, match="row 0 has 3 logit positions for 1 draft"):
        verify_batch(torch.zeros(1, 3, 4), [3], [[1]], [None], [SamplingParams()], [None])


def _tiny_fused_model(seed: int, max_positions: int):
    """A random 2-layer GQA qwen3 (vocab 61, hidden 32, 4 query / 2 KV heads), fused for inference."""
    from actors.engine.model import CausalLM, ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(model_type="qwen3", vocab_size=61, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=max_positions, tie_word_embeddings=True)
    model = CausalLM(cfg).eval()
    model.fuse()
    return model


def test_runner_views_equal_gathers_in_any_slot_order():
    """Rows on consecutive slots (in any order) read the cache as a view; the logits
    equal those of rows on scattered slots (gather path) for the same tokens."""
    from actors.engine.runner import ModelRunner, RowInput

    model = _tiny_fused_model(seed=0, max_positions=128)
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (7, 4, 9)]
    nxt = [[5, 6], [7], [8, 9, 10]]
    out = {}
    for name, slots in (("view", [2, 0, 1]), ("gather", [5, 0, 3])):
        runner = ModelRunner(model, 6, 64)
        runner.run([RowInput(s, 0, p) for s, p in zip(slots, prompts)], last_only=True)
        out[name] = runner.run([RowInput(s, len(p), t) for s, p, t in zip(slots, prompts, nxt)])
    for a, b in zip(out["view"][0], out["gather"][0]):
        assert torch.allclose(a, b, atol=1e-5)
    with torch.inference_mode():  # and both equal a plain forward without a cache
        ref = model(torch.tensor([prompts[2] + nxt[2]])).logits[0, -3:]
    assert torch.allclose(out["view"][0][2], ref, atol=1e-4)



def test_uneven_verify_batch_runs_packed_with_the_padded_logits():
    """Verifies of uneven draft lengths (ngram: 0..k per row) whose real tokens fill at most
    ``PACK_FILL`` of the padded B x Q run packed (GEMMs and LM head over real tokens only);
    their logits equal the padded forward's and a plain forward's without a cache, on
    consecutive and scattered slots. A full batch still runs padded."""
    from actors.engine.runner import ModelRunner, RowInput

    model = _tiny_fused_model(seed=1, max_positions=256)
    ctxs = [torch.randint(0, 61, (n,)).tolist() for n in (7, 12, 5, 9, 150)]
    new = [[3], [4, 5, 6, 7, 8], [9], [10, 11], [12]]       # 10 real of 25 padded
    lens = [len(t) for t in new]
    probe = ModelRunner(model, 10, 256)
    assert probe.pack(lens) and not probe.pack([5, 5, 5, 4, 5]) and not probe.pack([1] * 5)
    for slots in ([0, 1, 2, 3, 4], [6, 0, 3, 9, 1]):
        out = {}
        for name, fill in (("packed", ModelRunner.PACK_FILL), ("padded", 0.0)):
            runner = ModelRunner(model, 10, 256)
            runner.PACK_FILL = fill
            runner.run([RowInput(s, 0, c) for s, c in zip(slots, ctxs)], last_only=True)
            out[name] = runner.run([RowInput(s, len(c), t) for s, c, t in zip(slots, ctxs, new)])[0]
        for a, b in zip(out["packed"], out["padded"]):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
        with torch.inference_mode():
            for i, (c, t) in enumerate(zip(ctxs, new)):
                ref = model(torch.tensor([c + t])).logits[0, -len(t):]
                assert torch.allclose(out["packed"][i], ref, atol=1e-4), i
