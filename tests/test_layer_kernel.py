"""The decoder stack in one C call (``actors.engine.layer_kernel``) and the runner's use of it.

A flat batch of at most ``STACK_MAX_TOKENS`` tokens must give the logits and the K/V the
op-by-op forward gives (up to the order of float32 sums), for every architecture the
engine loads (Qwen3's q/k norms, Qwen2's q/k/v bias, Llama's neither); refuse a slot or
position out of range before computing anything; and stay out of the way where it does
not apply (float32 weights, the kernel off, aux layers, bigger batches).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from actors.engine import layer_kernel
from actors.engine.config import DEFAULT_DRAFT, DEFAULT_TARGET
from actors.engine.model import CausalLM, ModelConfig
from actors.engine.runner import ModelRunner, RowInput


def _bf16_model(model_type: str, seed: int = 0, layers: int = 2) -> CausalLM:
    """A random model whose weights are all bfloat16 values (as a bf16 checkpoint loads)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type=model_type, vocab_size=192, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, attention_bias=model_type == "qwen2")
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.fuse()
    return model


def _prefilled_pair(model: CausalLM, slots: int, ctx: list[list[int]], compile_: bool = False):
    """(runner, ops): two runners on ``model`` with ``ctx[s]`` prefilled in slot s; ``ops``
    without the stack kernel (the op-by-op reference); ``runner`` compiled if asked."""
    runner, ops = ModelRunner(model, slots, 128), ModelRunner(model, slots, 128)
    ops.STACK_KERNEL = False
    if compile_:
        assert runner.compile() and runner._flat is not None
    for r in (runner, ops):
        r.run_packed([RowInput(s, 0, c) for s, c in enumerate(ctx)], last_only=True)
    return runner, ops


@contextlib.contextmanager
def _stack_calls():
    """Counts the stack kernel's calls: yields a list that gets each call's token count."""
    calls: list[int] = []
    real = layer_kernel.run_stack
    layer_kernel.run_stack = lambda *a: calls.append(a[1].shape[0]) or real(*a)
    try:
        yield calls
    finally:
        layer_kernel.run_stack = real


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(1)
    ctxs = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (7, 30, 5, 12)]
    slots = [3, 0, 5, 1]
    new = [[3], [4, 5, 6, 7, 8], [9, 10], [11]]
    rows = [RowInput(s, len(c), t) for s, c, t in zip(slots, ctxs, new)] + [
        RowInput(2, 0, [1, 2, 3, 4])]                       # a first chunk (slot 2, empty)
    return ctxs, slots, new, rows


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_stack_equals_the_op_by_op_forward(model_type):
    """Decodes, uneven verifies and a prompt's first chunk on scattered slots, with all,
    per-row and last-only logits: the stack call's logits and cache writes equal the
    op-by-op flat forward's, and a plain forward without a cache."""
    model = _bf16_model(model_type)
    assert model.packable() and not model.model.layers[0].norm_folded
    ctxs, slots, new, rows = _batch(model.config.vocab_size)
    stack, ops = ModelRunner(model, 6, 64), ModelRunner(model, 6, 64)
    ops.STACK_KERNEL = False
    assert stack.stack() is not None and ops.stack() is None
    for r in (stack, ops):
        r.run_packed([RowInput(s, 0, c) for s, c in zip(slots, ctxs)], last_only=True)
    calls = []
    real = layer_kernel.run_stack
    layer_kernel.run_stack = lambda *a: calls.append(a[1].shape[0]) or real(*a)
    try:
        for last in (False, [False, True, False, False, True], True):
            got, _ = stack.run_flat(rows, last)
            want, _ = ops.run_flat(rows, last)
            for g_, w_ in zip(got, want):
                assert g_.shape == w_.shape and torch.allclose(g_, w_, rtol=1e-5, atol=1e-4), (
                    model_type, (g_ - w_).abs().max())
    finally:
        layer_kernel.run_stack = real
    assert calls == [13, 13, 13]          # every forward took the stack call, all 13 tokens
    for i in range(model.config.num_hidden_layers):
        assert torch.allclose(stack.cache.k[i], ops.cache.k[i], atol=1e-5)
        assert torch.allclose(stack.cache.v[i], ops.cache.v[i], atol=1e-5)
    with torch.inference_mode():
        for i, (c, t) in enumerate(zip(ctxs, new)):
            ref = model(torch.tensor([c + t])).logits[0, -1]
            assert torch.allclose(got[i][-1], ref, atol=1e-4), (model_type, i)


def test_stack_returns_the_aux_layers_hidden_states():
    """The DFlash family's target forward asks for layers' outputs (``aux_layers``): the
    stack call returns them per row, [len_i, A * H] in layer order, equal to the op-by-op
    forward's, with the same logits."""
    model = _bf16_model("qwen3", seed=9, layers=3)
    ctxs, slots, new, rows = _batch(model.config.vocab_size)
    stack, ops = ModelRunner(model, 6, 64), ModelRunner(model, 6, 64)
    ops.STACK_KERNEL = False
    for r in (stack, ops):
        r.run_packed([RowInput(s, 0, c) for s, c in zip(slots, ctxs)], last_only=True)
    calls = []
    real = layer_kernel.run_stack
    layer_kernel.run_stack = lambda *a: calls.append(a[6]) or real(*a)
    try:
        got, got_aux = stack.run(rows, last_only=True, aux_layers=(2, 0))
        want, want_aux = ops.run(rows, last_only=True, aux_layers=(2, 0))
    finally:
        layer_kernel.run_stack = real
    assert calls == [(2, 0)]
    for g_, w_, ga, wa, r in zip(got, want, got_aux, want_aux, rows):
        assert torch.allclose(g_, w_, rtol=1e-5, atol=1e-4)
        assert ga.shape == wa.shape == (len(r.token_ids), 2 * model.config.hidden_size)
        assert torch.allclose(ga, wa, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="aux layers"):
        stack.run([RowInput(0, 40, [1])], aux_layers=(3,))


@pytest.mark.parametrize("path", [DEFAULT_TARGET, DEFAULT_DRAFT])
def test_embedded_checkpoints_decode_on_the_stack(path):
    """The embedded models (bfloat16 checkpoints) take the stack call for a lone decode, a
    batch of 16 tokens, and one of 17 where the weight kernel is the AVX-512 code (the
    stack's limit is then ``layer_kernel.MAX_TOKENS_WIDE``), not on the AVX2 / plain code
    (``MAX_TOKENS``, 16); the logits match the op-by-op forward's either way."""
    model = CausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(2)
    ctx = [torch.randint(1, model.config.vocab_size, (20 + 3 * s,), generator=gen).tolist()
           for s in range(17)]
    runner, ops = _prefilled_pair(model, 17, ctx)
    assert runner.stack() is not None and runner.flat([1]) and runner.flat([4] * 4)
    with _stack_calls() as calls:
        for rows in ([RowInput(5, len(ctx[5]), [7])],
                     [RowInput(s, len(ctx[s]), [9]) for s in range(16)],
                     [RowInput(s, len(ctx[s]) + 1, [11]) for s in range(17)]):
            got, _ = runner.run(rows, last_only=True)
            want, _ = ops.run(rows, last_only=True)
            for g_, w_ in zip(got, want):
                assert torch.allclose(g_, w_, atol=1e-4)
    wide = layer_kernel.linear_kernel.isa() == 512
    assert runner.stack_max_tokens == (layer_kernel.MAX_TOKENS_WIDE if wide else 16)
    assert calls == ([1, 16, 17] if wide else [1, 16])      # else 17 decodes: op by op


def test_out_of_range_slot_or_position_is_refused_before_anything_is_computed():
    model = _bf16_model("qwen3", seed=3, layers=1)
    runner = ModelRunner(model, 2, 32)
    stack = runner.stack()
    k0 = runner.cache.k[0].clone()
    x = model.model.embed_tokens(torch.tensor([5, 6]))
    x0 = x.clone()
    cos, sin = model.rotary(torch.tensor([0, 1]), torch.float32, signed=True)
    cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    for slot, pos in (([0, 2], [0, 1]), ([0, -1], [0, 1]), ([0, 0], [0, stack.L])):
        with pytest.raises(ValueError, match="outside"):
            layer_kernel.run_stack(stack, x, cos, sin, torch.tensor(slot), torch.tensor(pos))
        assert torch.equal(x, x0) and torch.equal(runner.cache.k[0], k0)


def test_the_operators_refuse_a_mistyped_tensor_by_name_before_computing():
    """The kernels' operators (``csrc/ops.cpp``, typed schemas) check every tensor before
    a pointer is taken: a wrong dtype, a non-contiguous or too small tensor, a missing
    layer tensor or a cache of the wrong shape raises ValueError naming the argument, and
    nothing is written (the activations and the K/V cache are as before)."""
    model = _bf16_model("qwen3", seed=3, layers=1)
    runner = ModelRunner(model, 2, 32)
    stack = runner.stack()
    lib = layer_kernel.load()
    ops = lib.ops
    k0 = runner.cache.k[0].clone()
    x = model.model.embed_tokens(torch.tensor([5, 6])).detach().contiguous()
    x0 = x.clone()
    cos, sin = model.rotary(torch.tensor([0, 1]), torch.float32, signed=True)
    cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    slot, pos = torch.tensor([0, 1]), torch.tensor([0, 0])
    good = dict(x=x, cos=cos, sin=sin, slot=slot, pos=pos)

    def call(layers=stack.layers, dims=stack.dims_arg, **kw):
        a = {**good, **kw}
        return ops.decoder_stack.default(layers, stack.conv, dims, a["x"], a["cos"], a["sin"],
                                         a["slot"], a["pos"], stack.eps, stack.qk_eps, None, 0,
                                         0, None)

    cases = [
        (dict(x=x.double()), "x: wants a contiguous Float"),
        (dict(slot=slot.int()), "slot: wants a contiguous Long"),
        (dict(pos=pos[:1]), "pos: wants 2 elements"),
        (dict(cos=torch.zeros(2, 32)[:, ::2]), "cos: .*not contiguous"),
        (dict(x=torch.zeros(2, 48)), r"x: wants \[T, H = 64\]"),
        (dict(layers=[None] + stack.layers[1:]), r"layers\[0\]\.w_in: missing"),
        (dict(layers=stack.layers[:-1]), "16 tensors a layer"),
        (dict(dims=[64, 128, 4, 4, 16]), "qk_w: wants 128 elements"),   # kvh 4 for the model's 2
        (dict(layers=stack.layers[:8] + [runner.cache.k[0][:, :, :1].contiguous()]
              + stack.layers[9:]), "caches"),                 # a cache of 1 K/V head
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call(**kw)
        assert torch.equal(x, x0) and torch.equal(runner.cache.k[0], k0)
    # a packed weight of another dtype, by its field's name
    bad = list(stack.layers)
    bad[layer_kernel.LAYER_FIELDS.index("qkv")] = bad[4].float()
    with pytest.raises(ValueError, match="qkv: wants a contiguous BFloat16"):
        call(layers=bad)
    # the other operators check theirs the same way
    with pytest.raises(ValueError, match="packed: wants a contiguous BFloat16"):
        ops.linear_bf16.default(x, model.model.layers[0].mlp.gate_up_packed.float(),
                                torch.empty(2, 256))
    with pytest.raises(ValueError, match="anchors: wants 2 elements"):
        ops.markov_walk.default(torch.zeros(2, 3, 8), torch.zeros(2, 3, 4), torch.zeros(8, 4),
                                torch.zeros(4, 8), torch.zeros(1, dtype=torch.long),
                                torch.empty(2, 3, 8), torch.empty(2, 3, 4),
                                torch.empty(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="out: wants 6 elements"):
        ops.selector_walk.default(torch.zeros(2, 3, 64), torch.zeros(2, 3, 4),
                                  torch.zeros(2, 3, 4, dtype=torch.long),
                                  torch.zeros(2, dtype=torch.long), torch.zeros(8, 6),
                                  torch.zeros(2, 64), 1.0, torch.empty(5, dtype=torch.long))
    # the same call with good arguments runs (the checks refuse only what is wrong)
    assert call() == 0 and not torch.equal(x, x0)


def test_where_the_stack_does_not_apply(monkeypatch):
    """float32 weights (not packable), the kernel turned off, and aux layers over more
    tokens than the stack takes run op by op; a model re-fused gets a fresh stack."""
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, max_position_embeddings=64)
    m32 = CausalLM(cfg).eval()
    m32.fuse()
    assert ModelRunner(m32, 2, 32).stack() is None
    model = _bf16_model("qwen3", seed=5, layers=1)
    runner = ModelRunner(model, 2, 32)
    runner.STACK_MAX_TOKENS = 16        # (the AVX2 code's limit: 17 aux tokens are past it)
    first = runner.stack()
    assert first is not None and runner.stack() is first
    model.fuse()                                           # new packed copies: a new stack
    assert runner.stack() is not first
    calls = []
    monkeypatch.setattr(layer_kernel, "run_stack", lambda *a: calls.append(1))
    runner.run_packed([RowInput(0, 0, [1, 2, 3])], last_only=True)
    runner.run([RowInput(0, 3, list(range(1, 18)))], last_only=True, aux_layers=(0,))
    assert calls == []
    monkeypatch.setenv("SPECLOAD_LAYER_KERNEL", "0")
    layer_kernel.load.cache_clear()
    try:
        assert layer_kernel.load() is None and ModelRunner(model, 2, 32).stack() is None
    finally:
        monkeypatch.delenv("SPECLOAD_LAYER_KERNEL")
        layer_kernel.load.cache_clear()


@pytest.mark.parametrize("strategy", ["autoregressive", "ngram", "draft_model"])
def test_engine_greedy_output_with_the_stack_equals_op_by_op_up_to_ties(strategy, monkeypatch):
    """The embedded target (and draft) end to end: greedy outputs with the stack call equal
    the op-by-op engine's, or diverge only where the two tokens' logits tie (< 1e-4)."""
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine, run_requests
    from actors.engine.types import SamplingParams

    prompts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
               "import os\nimport sys\n", "class Point:\n    def __init__(self, x, y):\n"]
    outs, used = {}, {}
    for on in (True, False):
        monkeypatch.setattr(ModelRunner, "STACK_KERNEL", on)
        eng = LLMEngine(EngineConfig(strategy=strategy, max_num_seqs=4,
                                     draft_model=str(DEFAULT_DRAFT)
                                     if strategy == "draft_model" else None))
        calls = []
        real = layer_kernel.run_stack
        monkeypatch.setattr(layer_kernel, "run_stack", lambda *a: calls.append(1) or real(*a))
        ids = [eng.tokenizer(p)["input_ids"] for p in prompts]
        res = run_requests(eng, [(f"r{i}", x, SamplingParams(max_tokens=24, ignore_eos=True))
                                 for i, x in enumerate(ids)], batch_size=4)
        monkeypatch.setattr(layer_kernel, "run_stack", real)
        outs[on] = [res[f"r{i}"]["token_ids"] for i in range(len(ids))]
        used[on] = len(calls)
    assert used[True] > 0 and used[False] == 0
    for x, a, b in zip(ids, outs[True], outs[False]):
        if a == b:
            continue
        i = next(j for j, (s, t) in enumerate(zip(a, b)) if s != t)
        with torch.inference_mode():
            lg = eng.model(torch.tensor([x + a[:i]])).logits[0, -1]
        assert abs(float(lg[a[i]] - lg[b[i]])) < 1e-4, f"diverges at {i}: not a tie"


def test_compiled_runner_warms_up_its_graph_past_the_stack():
    """With a compiled forward (``enforce_eager`` off) the warm-up traces the graph itself
    (not the stack call), so batches over ``STACK_MAX_TOKENS`` tokens run on it without a
    recompile, and small ones still take the stack call; both match the op-by-op logits."""
    model = _bf16_model("qwen3", seed=7, layers=1)
    gen = torch.Generator().manual_seed(3)
    ctx = [torch.randint(1, 192, (10 + s,), generator=gen).tolist() for s in range(20)]
    runner, ops = _prefilled_pair(model, 20, ctx, compile_=True)
    runner.STACK_MAX_TOKENS = 16        # (the AVX2 code's limit; the 20-token batch is past it)
    with _stack_calls() as calls:
        for rows in ([RowInput(s, len(ctx[s]), [3, 4]) for s in range(4)],       # 8 tokens
                     [RowInput(s, len(ctx[s]) + 2, [5]) for s in range(20)]):    # 20
            got = runner.run_flat(rows, True)
            assert got is not None, "the compiled forward refused a batch: a recompile due"
            want, _ = ops.run(rows, last_only=True)
            for g_, w_ in zip(got[0], want):
                assert torch.allclose(g_, w_, rtol=1e-5, atol=1e-4)
    assert calls == [8] and runner.flat_fallbacks == 0


@pytest.mark.parametrize("path", [DEFAULT_DRAFT])
def test_greedy_steps_equal_one_forward_per_token_up_to_ties(path):
    """``greedy_steps`` (n argmax steps of a batch in one C call, the draft model's drafting)
    picks the tokens that stepping one forward at a time picks (argmax of each step's
    logits; a difference only where the two best logits are a numerical tie) and leaves
    the same K/V in the cache."""
    model = CausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(4)
    ctx = [torch.randint(1, model.config.vocab_size, (9 + 5 * s,), generator=gen).tolist()
           for s in range(3)]
    a, b = _prefilled_pair(model, 3, ctx)
    b.STACK_KERNEL = True                      # both on the stack; b steps in Python
    first = [c[-1] for c in ctx]
    n = 5
    got = layer_kernel.greedy_steps(a.stack(), model, first, [0, 1, 2],
                                    [len(c) - 1 for c in ctx], n)
    assert got is not None and len(got) == 3 and all(len(g) == n for g in got)
    for s, c in enumerate(ctx):
        tok, want = c[-1], []
        for j in range(n):
            lg, _ = b.run([RowInput(s, len(c) - 1 + j, [tok])], last_only=True)
            top = torch.topk(lg[0][-1], 2)
            tok = int(top.indices[0])
            if got[s][j] != tok:      # only a tie may differ (then the rest follows another path)
                assert float(top.values[0] - lg[0][-1][got[s][j]]) < 1e-4, (s, j)
                break
            want.append(tok)
        else:
            assert got[s] == want
            for layer in range(model.config.num_hidden_layers):
                end = len(c) - 1 + n
                assert torch.allclose(a.cache.k[layer][s, :end], b.cache.k[layer][s, :end],
                                      atol=1e-5)
    # a position past the cache: not served (the caller steps in torch), nothing raised
    L = a.stack().L
    assert layer_kernel.greedy_steps(a.stack(), model, first, [0, 1, 2], [L - 2, 0, 0], 8) is None


@pytest.mark.parametrize("path", [DEFAULT_DRAFT])
def test_greedy_draft_equals_catch_up_then_steps_up_to_ties(path):
    """``greedy_draft`` (a draft model's whole greedy proposal in one C call: each row's
    pending tokens fed in one flat forward, only their last token's output past the last
    layer's attention, then n - 1 argmax steps) picks the tokens that a catch-up forward
    of the pending tokens and one forward per token pick (a difference only at a
    numerical tie of the two best logits) and leaves the same K/V in the cache; rows of
    1, 3 and 6 pending tokens in one call."""
    model = CausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(5)
    ctx = [torch.randint(1, model.config.vocab_size, (9 + 5 * s,), generator=gen).tolist()
           for s in range(3)]
    pend = [torch.randint(1, model.config.vocab_size, (m,), generator=gen).tolist()
            for m in (1, 3, 6)]
    a, b = _prefilled_pair(model, 3, ctx)
    b.STACK_KERNEL = True
    n = 4
    got = layer_kernel.greedy_draft(a.stack(), model, pend, [0, 1, 2],
                                    [len(c) for c in ctx], n)
    assert got is not None and [len(g) for g in got] == [n] * 3
    ties = 0
    for s, (c, p) in enumerate(zip(ctx, pend)):
        lg, _ = b.run([RowInput(s, len(c), p)], last_only=True)
        want, pos = [], len(c) + len(p)
        for j in range(n):
            top = torch.topk(lg[0][-1], 2)
            tok = int(top.indices[0])
            if got[s][j] != tok:      # only a tie may differ (then the rest follows another path)
                assert float(top.values[0] - lg[0][-1][got[s][j]]) < 1e-4, (s, j)
                ties += 1
                break
            want.append(tok)
            if j < n - 1:
                lg, _ = b.run([RowInput(s, pos, [tok])], last_only=True)
                pos += 1
        else:
            assert got[s] == want
            end = len(c) + len(p) + n - 1
            for layer in range(model.config.num_hidden_layers):
                assert torch.allclose(a.cache.k[layer][s, :end], b.cache.k[layer][s, :end],
                                      atol=1e-5)
                assert torch.allclose(a.cache.v[layer][s, :end], b.cache.v[layer][s, :end],
                                      atol=1e-5)
    assert ties <= 1
    # past the cache, or an empty row: not served (the caller runs its torch steps)
    L = a.stack().L
    assert layer_kernel.greedy_draft(a.stack(), model, pend, [0, 1, 2], [L - 3, 0, 0], n) is None
    assert layer_kernel.greedy_draft(a.stack(), model, [[1], [], [2]], [0, 1, 2], [0, 0, 0],
                                     n) is None


def test_stack_attention_honours_torch_threads():
    """The decoder stack's attention takes ``torch.get_num_threads()`` as its products do
    (``Kernels.sync_threads`` -> the ``set_threads`` operator): a 64-token prompt
    chunk over a 448-token context (past the 2^15-key threshold where the call splits its
    (token group, K/V head) items between threads) gives the same logits and the same K/V
    with 2 threads as with 1, bit for bit (each item is computed whole by one thread)."""
    model = CausalLM.from_pretrained(DEFAULT_TARGET)
    lib = layer_kernel.load()
    if lib is None or not lib.openmp:
        pytest.skip("no OpenMP build of the decoder-stack kernel on this machine")
    gen = torch.Generator().manual_seed(6)
    ctx = torch.randint(1, model.config.vocab_size, (448,), generator=gen).tolist()
    chunk = torch.randint(1, model.config.vocab_size, (64,), generator=gen).tolist()
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            runner = ModelRunner(model, 1, 1024)
            runner.run([RowInput(0, 0, ctx)], last_only=True)
            lg, _ = runner.run([RowInput(0, len(ctx), chunk)], last_only=False)
            assert runner.last_path == "stack" and lib.threads == n
            outs.append((lg[0], runner.cache.k[0][0, :512].clone()))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
