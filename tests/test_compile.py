"""The compiled flat forward (``enforce_eager`` off, ``ModelRunner.compile``): its math run
eager equals the packed and plain forwards; compiled, the same logits as eager for every
mix of short rows on one graph, no compile after the warm-up whatever the batch, eager
for long rows and for a batch that would recompile, and an engine's greedy output equal
to the eager engine's up to numerical ties.

One small random model on the embedded target's tokenizer keeps inductor's compiles short
(the embedded target's warm-up takes about a minute on 2 cores); every test here builds
the same graphs, so after the first the others mostly hit inductor's cache."""

from __future__ import annotations

import shutil

import pytest
import torch

from actors.engine.model import CausalLM, ModelConfig
from actors.engine.runner import ModelRunner, RowInput

TIE = 1e-4   # a greedy divergence where the two tokens' logits are this close is a tie


def _tiny(vocab: int, seed: int = 0, layers: int = 1) -> CausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
    model = CausalLM(cfg).eval()
    model.fuse()
    return model


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_flat_forward_eager_equals_packed_and_plain():
    """The flat forward's math (``Attention._flat_attention``, each token attending its
    own slot to its own position; in torch and with the C kernel), run eager: the packed
    forward's logits and a plain forward's without a cache, for decodes, uneven verifies, a prompt's first chunk and a
    mixed batch with per-row last-only logits, on scattered slots."""
    model = _tiny(61, seed=4, layers=2)
    gen = torch.Generator().manual_seed(0)
    ctxs = [torch.randint(0, 61, (n,), generator=gen).tolist() for n in (7, 30, 5, 12)]
    slots = [3, 0, 5, 1]
    new = [[3], [4, 5, 6, 7, 8], [9, 10], [11]]
    flat, packed = ModelRunner(model, 6, 64), ModelRunner(model, 6, 64)
    for r in (flat, packed):
        r.run_packed([RowInput(s, 0, c) for s, c in zip(slots, ctxs)], last_only=True)
    flat._flat = model.forward          # the compiled forward's code path, run eager
    rows = [RowInput(s, len(c), t) for s, c, t in zip(slots, ctxs, new)] + [
        RowInput(2, 0, [1, 2, 3, 4])]                       # a first chunk (slot 2, empty)
    assert flat.eager_flat, "the C attention kernel did not build"
    # the torch form, the C kernel's attention, then the eager flat path (no compiled
    # forward: ``run_flat`` calls the model itself, the kernel's attention)
    for kernel, compiled in ((False, True), (True, True), (False, False)):
        flat.flat_kernel = kernel
        flat._flat = model.forward if compiled else None
        for last in (False, [False, False, False, False, True], True):
            got, _ = flat.run_flat(rows, last, strict=False)
            want, _ = packed.run_packed(rows, last)
            for g_, w_ in zip(got, want):
                assert g_.shape == w_.shape and torch.allclose(g_, w_, atol=1e-5)
    with torch.inference_mode():
        for i, (c, t) in enumerate(zip(ctxs, new)):
            ref = model(torch.tensor([c + t])).logits[0, -len(t):]
            assert torch.allclose(got[i], ref[-1:], atol=1e-4), i
    # one token alone (compiled: sent twice, one copy dropped; eager: once)
    want, _ = packed.run_packed([RowInput(0, 35, [7])])
    for compiled in (True, False):
        flat._flat = model.forward if compiled else None
        got, _ = flat.run_flat([RowInput(0, 35, [7])], strict=False)
        assert got[0].shape == (1, 61) and torch.allclose(got[0], want[0], atol=1e-5)
    # eager: decode and verify batches take the flat path, prompt chunks do not
    assert flat.flat([1, 1, 1]) and flat.flat([1, 5, 3]) and not flat.flat([1, 40])


def test_compiled_runner_equals_eager_and_compiles_nothing_after_warm_up(tiny_model_dir):
    model = CausalLM.from_pretrained(tiny_model_dir)
    V = model.config.vocab_size
    compiled, eager = ModelRunner(model, 8, 256), ModelRunner(model, 8, 256)
    assert compiled.compile() is True
    assert compiled.flat_kernel      # the attention by the C kernel inside the graph
    calls = [0]
    fn = compiled._flat

    def counting(*a, **k):
        calls[0] += 1
        return fn(*a, **k)

    compiled._flat = counting
    graphs = _graphs()
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(5, 100, (8,), generator=gen).tolist()
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in lens]
    # the same contexts in both caches: first chunks of up to the longest row the flat
    # forward takes run on the compiled forward, a batch with a longer one eager (a limit
    # lowered here to this small model's lengths: the kernel's is 512 tokens)
    compiled.FLAT_KERNEL_MAX_Q = compiled.FLAT_MAX_Q
    max_q = compiled.flat_limits[0]
    short = [s for s in range(8) if lens[s] <= max_q][:3]
    for part, on_graph in ((short, True), ([s for s in range(8) if s not in short], False)):
        rows = [RowInput(s, 0, prompts[s]) for s in part]
        before = calls[0]
        got, _ = compiled.run(rows, last_only=True)
        want, _ = eager.run(rows, last_only=True)
        assert calls[0] == before + on_graph
        assert all(torch.allclose(g_, w_, atol=1e-4) for g_, w_ in zip(got, want))
    # decodes, verifies of one length, uneven verifies (ngram's 0..k), slots not 0..B-1,
    # a mixed batch with last-only prompt tails, one token alone: all on the one graph
    batches = [([1] * 8, range(8), False), ([1] * 5, range(5), False), ([1], [0], False),
               ([4, 4], [0, 1], False), ([1, 4, 2, 4, 1], range(5), False),
               ([1, 3, 1], [2, 4, 6], False), ([2, 1, 5, 9], range(4),
                                                [False, False, False, True]),
               ([3, 7], [1, 3], True), ([16, 1], [0, 7], False), ([40, 2], [2, 5], True),
               ([90, 1, 3], [6, 0, 1], [True, False, False])]   # a chunk over 64: the kernel's
    del compiled.FLAT_KERNEL_MAX_Q                               # limit again (512)
    for qs, slots, last in batches:
        rows = [RowInput(s, lens[s], torch.randint(0, V, (q,), generator=gen).tolist())
                for s, q in zip(slots, qs)]
        before = calls[0]
        got, _ = compiled.run(rows, last_only=last)
        want, _ = eager.run(rows, last_only=last)
        assert calls[0] == before + 1, qs
        for g_, w_ in zip(got, want):
            assert g_.shape == w_.shape
            assert torch.allclose(g_, w_, atol=1e-4), float((g_ - w_).abs().max())
        for s, q in zip(slots, qs):
            lens[s] += q
    assert compiled.flat_fallbacks == 0
    assert _graphs() == graphs, "a batch after the warm-up compiled a graph"
    # a row longer than the limit (a long prompt chunk): eager, same logits
    compiled.FLAT_KERNEL_MAX_Q = max_q
    n = max_q + 1
    rows = [RowInput(0, lens[0], torch.randint(0, V, (n,), generator=gen).tolist()),
            RowInput(1, lens[1], [3])]
    before = calls[0]
    got, _ = compiled.run(rows)
    want, _ = eager.run(rows)
    assert calls[0] == before
    assert all(torch.allclose(g_, w_, atol=1e-4) for g_, w_ in zip(got, want))
    # another model of the same shapes: its own weights, not the first one's (the warm-up
    # checks its compiled logits against its own eager ones)
    other = ModelRunner(_tiny(V, seed=7), 8, 256)
    assert other.compile() is True
    got, _ = other.run([RowInput(s, 0, [5]) for s in range(3)])
    assert not torch.allclose(got[0], compiled.run([RowInput(0, 0, [5])])[0][0], atol=1e-3)


def test_a_batch_that_would_recompile_runs_eager():
    """``fail_on_recompile``: a batch the graph's guards refuse is not compiled mid-serving;
    the runner counts it and runs it eager, with the eager logits."""
    model = _tiny(61, seed=5)
    runner, eager = ModelRunner(model, 4, 64), ModelRunner(model, 4, 64)

    def refusing(*a, **k):
        raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")

    runner._flat = refusing
    rows = [RowInput(0, 0, [1, 2, 3]), RowInput(1, 0, [4])]
    got, _ = runner.run(rows)
    want, _ = eager.run(rows)
    assert runner.flat_fallbacks == 1
    assert all(torch.allclose(g_, w_, atol=1e-6) for g_, w_ in zip(got, want))


def test_compile_refuses_a_cache_with_live_requests():
    model = _tiny(61, seed=2)
    runner = ModelRunner(model, 4, 64)
    runner.pool.allocate("r0")
    assert runner.compile() is False
    assert runner._flat is None


def test_a_failed_compile_stays_eager_without_the_kernel(monkeypatch):
    """torch.compile failing (no C++ compiler, an unsupported op): eager, and the runner
    does not claim the kernel runs."""
    def failing(*a, **k):
        raise RuntimeError("inductor: no working C++ compiler")

    monkeypatch.setattr(torch, "compile", failing)
    runner = ModelRunner(_tiny(61, seed=2), 4, 64)
    assert runner.compile() is False
    assert runner._flat is None and runner.flat_kernel is False
    # no compiled graph: decodes run flat only by the eager path (the C attention kernel)
    assert runner.flat([1, 1]) is runner.eager_flat
    runner.eager_flat = False
    assert not runner.flat([1, 1])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 1-layer model on the embedded target's tokenizer (a local HF directory)."""
    from actors.engine.config import DEFAULT_TARGET

    d = tmp_path_factory.mktemp("tiny_target")
    src = DEFAULT_TARGET
    vocab = ModelConfig.from_hf_dict(
        __import__("json").loads((src / "config.json").read_text())).vocab_size
    _tiny(vocab, seed=3).save_pretrained(d, dtype=torch.float32)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, d / f.name)
    return d


@pytest.mark.parametrize("strategy", ["autoregressive", "ngram", "draft_model"])
def test_compiled_engine_greedy_equals_eager_up_to_ties(tiny_model_dir, strategy):
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine, run_requests
    from actors.engine.types import SamplingParams

    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
               "for i in range(10):\n    print(i)\nfor i in range(10):\n",
               "import os\nimport sys\nimport os\n", "x = 1\ny = 2\nx = 1\n"] * 2
    outs = {}
    for eager in (True, False):
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), strategy=strategy,
                                     num_speculative_tokens=None if strategy == "autoregressive"
                                     else 3, max_num_seqs=8, enforce_eager=eager,
                                     # (the same tiny model as its own draft: every draft
                                     # accepted, the draft model's steps compiled too)
                                     draft_model=str(tiny_model_dir)
                                     if strategy == "draft_model" else None))
        assert eng.compiled is (not eager)
        if strategy == "draft_model":
            assert (eng.proposer.runner._flat is not None) is (not eager)
        ids = [eng.tokenizer(p)["input_ids"] for p in prompts]
        res = run_requests(eng, [(f"r{i}", x, SamplingParams(max_tokens=24, temperature=0.0,
                                                              ignore_eos=True))
                                 for i, x in enumerate(ids)], batch_size=8)
        outs[eager] = [res[f"r{i}"]["token_ids"] for i in range(len(ids))]
        if strategy != "autoregressive" and not eager:
            drafted = sum(res[f"r{i}"]["stats"].num_draft_tokens for i in range(len(ids)))
            assert drafted > 0          # the verify batches ran (on the compiled forward)
    for x, a, b in zip(ids, outs[True], outs[False]):
        if a == b:
            continue
        i = next(j for j, (s, t) in enumerate(zip(a, b)) if s != t)
        with torch.inference_mode():   # the eager target at the divergence
            lg = eng.model(torch.tensor([x + a[:i]])).logits[0, -1]
        assert abs(float(lg[a[i]] - lg[b[i]])) < TIE, (
            f"compiled greedy output diverges at {i} ({a[i]} vs {b[i]}): not a tie")
