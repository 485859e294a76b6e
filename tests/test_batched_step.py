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


def test_runner_views_equal_gathers_in_any_slot_order():
    """Rows on consecutive slots (in any order) read the cache as a view; the logits
    equal those of rows on scattered slots (gather path) for the same tokens."""
    from actors.engine.model import CausalLM, ModelConfig
    from actors.engine.runner import ModelRunner, RowInput

    torch.manual_seed(0)
    cfg = ModelConfig(model_type="qwen3", vocab_size=61, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=128, tie_word_embeddings=True)
    model = CausalLM(cfg).eval()
    model.fuse()
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


def test_packed_group_equals_rows_alone_and_a_plain_forward():
    """A packed step's short rows (decodes, verifies, a short chunk) attend as one padded
    batch (``ModelRunner.packed_group``); their logits equal those of each row attending
    alone (``GROUP_MAX_Q = 0``) and of a plain forward without a cache, on consecutive
    slots (a cache view) and scattered ones (a gather), with a far longer row left alone."""
    from actors.engine.model import CausalLM, ModelConfig
    from actors.engine.runner import ModelRunner, RowInput

    torch.manual_seed(1)
    cfg = ModelConfig(model_type="qwen3", vocab_size=61, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    model = CausalLM(cfg).eval()
    model.fuse()
    # cached contexts (the last one far longer), then: a decode, two verifies of different
    # lengths, a long-context decode, a short new prompt and a 20-token prompt chunk
    ctx_lens = [7, 12, 5, 9, 150]
    ctxs = [torch.randint(0, 61, (n,)).tolist() for n in ctx_lens]
    new = [[3], [4, 5, 6], [7, 8], [9], [10]]
    fresh = [torch.randint(0, 61, (n,)).tolist() for n in (4, 20)]
    for slots in ([0, 1, 2, 3, 4, 5, 6], [6, 0, 3, 9, 1, 4, 8]):
        out = {}
        for name, gmax in (("group", 16), ("alone", 0)):
            runner = ModelRunner(model, 10, 256)
            runner.GROUP_MAX_Q = gmax
            runner.run([RowInput(s, 0, c) for s, c in zip(slots, ctxs)], last_only=True)
            rows = [RowInput(s, len(c), t) for s, c, t in zip(slots, ctxs, new)]
            rows += [RowInput(slots[5], 0, fresh[0]), RowInput(slots[6], 0, fresh[1])]
            assert runner.pack([len(r.token_ids) for r in rows])
            if gmax:
                grp = runner.packed_group(rows, [(r.slot, r.start, 0, len(r.token_ids)) for r in rows])
                assert grp is not None and sorted(grp.seg_ids) == [0, 1, 2, 3, 5]  # 150-ctx row alone
            out[name] = runner.run(rows)[0]
        for a, b in zip(out["group"], out["alone"]):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
        with torch.inference_mode():
            for i, (c, t) in enumerate(zip(ctxs + [[], []], new + fresh)):
                ref = model(torch.tensor([c + t])).logits[0, -len(t):]
                assert torch.allclose(out["group"][i], ref, atol=1e-4), i
