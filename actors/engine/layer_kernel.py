"""The decoder stack of a few-token flat batch in one C call (``run_stack``).

A decode step at batch 1 on a CPU spent more time dispatching ops than computing: with
the bfloat16 weight kernel (``linear_kernel``) the tiny target's 25 matrix products of a
step took about 0.9 ms of a 3.1 ms step, the rest was some 40 PyTorch ops a layer
(norms, q/k norms, rotary, cache writes, attention, SiLU, residuals), each a few
microseconds of Python and dispatcher (measured here with cProfile, one thread). A CPU
inference engine runs a layer as one native call (llama.cpp's graph, vLLM CPU's fused
IPEX ops); this module does the same for the flat forward (``ModelRunner.run_flat``) of
at most ``max_tokens()`` tokens (16; 1024 with the AVX-512 weight kernel): every layer of
the stack, in C, in one call (the ``decoder_stack`` operator, ``kernel_build.load_ops``).

Per layer and token (float32 activations, the math of ``DecoderLayer.forward`` with the
packed, unfolded weights, ``CausalLM.fuse``):

    x += o(attn(rope(qk_norm(q, k)), v)) ; x += down(silu(gate) * up)

with ``a = rms(x) * w_in`` feeding q|k|v and ``rms(x) * w_post`` feeding gate|up (RMSNorm,
Zhang & Sennrich 2019), q/k RMSNorm per head where the model has it (Qwen3), rotary
embedding in the HF ``rotate_half`` layout (Su et al. 2021), each token's K/V written to
its slot and position, attention over positions ``0 .. pos[t]`` of its slot
(``attention_kernel``'s C code, Vaswani et al. 2017 eq. 1), and the products on
``linear_kernel``'s bfloat16-weight code. The same float32 operations as the torch
forward, summed in other orders (~1e-7 relative; the tests compare logits to the plain
forward). The final norm and the LM head stay in torch (only the rows whose logits are
wanted).

The C source is ``csrc/decoder_stack.c``, one translation unit with the two kernels it
calls (``#include "flat_attention.c"``, ``"linear_bf16.c"``), built with ``csrc/ops.cpp``'s
typed operators by ``kernel_build.load_ops``; ``load()`` is None where it cannot be built or
``SPECLOAD_LAYER_KERNEL=0``, and the runner keeps the op-by-op forward. The same library
serves the drafters: the DFlash family's (``actors.proposers.dflash.draft_stack``) whole
draft in one call (``BlockDraftCall``, ``block_draft_f32``: its layers with a ``span``,
every block token reading the whole block, DFlash 2's dynamic convolution on each norm's
output (``layer_w``'s ``ca_`` / ``cm_`` fields), the final norm, the shared LM head, the
argmax and the decoding head: DFlash 2's top-k and selector walk or DSpark's Markov walk,
``draft_heads``), its context K/V (``context_kv_f32``), the walks alone
(``selector_walk_f32``, ``markov_walk_f32``), and a draft model's greedy proposal
(``greedy_draft_f32``, ``greedy_steps_f32``).
"""

from __future__ import annotations

import functools
import itertools
import os

import torch

from actors.engine import linear_kernel
from actors.engine.kernel_build import Kernels, load_kernel_outcome, load_kernels, record

# tokens of a batch the stack call serves; more run op by op (the AVX2 weight kernel loses
# to MKL's GEMM from about 16 rows, where the ops' overhead is a smaller share)
MAX_TOKENS = 16
# ... with the AVX-512 weight kernel (``linear_kernel.isa() == 512``, as fast as MKL from 6
# rows): every verify, and prompt chunks up to this many tokens, in one call, so the
# step-cost curve has no cliff where the path changes (``max_tokens``)
MAX_TOKENS_WIDE = 1024


def max_tokens() -> int:
    """The most tokens a batch runs on the stack call: ``MAX_TOKENS_WIDE`` with the
    AVX-512 weight kernel, else ``MAX_TOKENS``."""
    return MAX_TOKENS_WIDE if linear_kernel.isa() == 512 else MAX_TOKENS


# a layer's tensors in the operators' order (``csrc/ops.cpp``'s ``layer_table``, the C
# code's ``layer_w``): None for an absent optional one
LAYER_FIELDS = ("w_in", "w_post", "qkv_b", "qk_w", "qkv", "o", "gate_up", "down", "ck", "cv",
                "ca_down", "ca_b", "cm_down", "cm_b", "ca_up", "cm_up")


@functools.lru_cache(maxsize=1)
def load() -> Kernels | None:
    """The built kernels (``kernel_build.load_ops``: the stack's, the drafters' and the two
    kernels it calls, one library), or None (a warning logged) when they cannot be built,
    or ``SPECLOAD_LAYER_KERNEL=0`` or ``SPECLOAD_LINEAR_KERNEL=0``."""
    if os.environ.get("SPECLOAD_LAYER_KERNEL", "1") == "0" or linear_kernel.load() is None:
        record("decoder_stack", status="disabled", reason="SPECLOAD_LAYER_KERNEL=0"
               if os.environ.get("SPECLOAD_LAYER_KERNEL", "1") == "0" else "no linear_bf16 kernel",
               fallback="layers run op by op")
        return None
    lib = load_kernels("decoder_stack", "layers run op by op")
    if lib is not None:
        record("decoder_stack", **load_kernel_outcome("decoder_stack"), max_tokens=max_tokens(),
               openmp=lib.openmp)
    return lib


class Stack:
    """A model's layers as the stack call takes them, for one KV cache: a ``LayerW`` per
    layer (pointers into tensors this object keeps alive). Build with ``Stack.of``."""

    def __init__(self, model, cache):
        cfg = model.config
        layers = []
        for i, layer in enumerate(model.model.layers):
            at, mlp = layer.self_attn, layer.mlp
            qk_w = at.qk_norm_weight.contiguous() if at.qk_norm else None
            layers.append(dict(w_in=layer.input_layernorm.weight.detach().contiguous(),
                               w_post=layer.post_attention_layernorm.weight.detach().contiguous(),
                               qkv_b=at.qkv_bias, qk_w=qk_w, qkv=at.qkv_packed, o=at.o_packed,
                               gate_up=mlp.gate_up_packed, down=mlp.down_packed,
                               ck=cache.k[i], cv=cache.v[i]))
        a0 = model.model.layers[0].self_attn
        self._init(layers, (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim),
                   float(model.model.layers[0].input_layernorm.eps),
                   float(a0.q_norm.eps) if a0.qk_norm else 0.0)

    def _init(self, layers: list[dict], dims: tuple[int, int, int, int, int], eps: float,
              qk_eps: float) -> None:
        """layers: per layer the tensors of ``LayerW``'s fields (caches [S, L, kvh, D]
        float32 contiguous, weights packed by ``linear_kernel.pack``); dims (H, I, h, kvh,
        D)."""
        # the operators' arguments: every layer's tensors (LAYER_FIELDS), its convolution's
        # rank and block (0, 0 without one), the dims (checked against the tensors per call)
        self.layers = [ts.get(f) for ts in layers for f in LAYER_FIELDS]
        self.conv = [int(v) for ts in layers for v in (ts.get("conv_r", 0), ts.get("conv_block", 0))]
        self.dims_arg = list(dims)
        self.n = len(layers)
        self.S, self.L = layers[0]["ck"].shape[0], layers[0]["ck"].shape[1]
        self.dims = dims
        self.eps, self.qk_eps = eps, qk_eps
        self.scale = dims[4] ** -0.5

    @classmethod
    def of_layers(cls, layers: list[dict], dims: tuple[int, int, int, int, int], eps: float,
                  qk_eps: float) -> "Stack":
        """A stack of other layers than a ``CausalLM``'s (a drafter's: ``_init``)."""
        self = cls.__new__(cls)
        self._init(layers, dims, eps, qk_eps)
        return self

    @staticmethod
    def usable(model, cache) -> bool:
        """Whether ``model`` (fused, packed: ``CausalLM.fuse``) and ``cache`` (float32,
        contiguous, on a CPU) can run on the stack call, and the library built."""
        layers = model.model.layers
        if not layers or model.training or load() is None:
            return False
        for i, layer in enumerate(layers):
            at, mlp = layer.self_attn, layer.mlp
            if getattr(layer, "norm_folded", True) or any(
                    getattr(m, n, None) is None for m, n in
                    ((at, "qkv_packed"), (at, "o_packed"), (mlp, "gate_up_packed"), (mlp, "down_packed"))):
                return False
            ck, cv = cache.k[i], cache.v[i]
            if ck.dtype != torch.float32 or ck.device.type != "cpu" or not (
                    ck.is_contiguous() and cv.is_contiguous()):
                return False
        return getattr(model.config, "hidden_act", "silu") == "silu"

    @classmethod
    def of(cls, model, cache) -> "Stack | None":
        """The ``Stack`` of ``model`` over ``cache``, or None where ``usable`` is False."""
        return cls(model, cache) if cls.usable(model, cache) else None


def _greedy_tables(model) -> tuple | None:
    """What a greedy C call reads of a draft ``CausalLM`` besides its stack: (packed LM
    head, embedding [V, H], rotary cos and signed sin tables [P, D]), or None where one is
    missing or not a float32 contiguous tensor (the caller steps in torch)."""
    lm = getattr(model, "lm_packed", None)
    emb = model.model.embed_tokens.weight
    if lm is None or emb.dtype != torch.float32 or not emb.is_contiguous():
        return None
    model.rotary(torch.zeros(1, 1, dtype=torch.long), torch.float32, signed=True, max_pos=0)
    _, cos_t, _, sin_t = model.rope_table
    if not (cos_t.is_contiguous() and sin_t.is_contiguous()) or cos_t.dtype != torch.float32:
        return None
    return lm, emb, cos_t, sin_t


def greedy_steps(stack: Stack, model, tokens: list[int], slots: list[int],
                 positions: list[int], n: int) -> list[list[int]] | None:
    """``n`` greedy decoding steps of B rows in one C call (``greedy_steps_f32``): row b
    feeds ``tokens[b]`` at ``positions[b]`` of slot ``slots[b]`` (its K/V written there,
    and the next n - 1 inputs' at the following positions), picks the argmax of its
    logits (ties to the lowest id, as ``torch.argmax``) and feeds it next. ``model``: the
    ``CausalLM`` of ``stack`` (final norm, tied or packed LM head, rotary table). Returns
    the picked tokens per row, [B][n], or None where the call does not apply (no packed
    LM head, a position past the rotary table or the cache: the caller steps in torch).
    Raises RuntimeError when the library is missing or out of memory."""
    lib = load()
    if lib is None:
        raise RuntimeError("the decoder stack kernel is not built (see the log)")
    tables = _greedy_tables(model)
    if tables is None or n < 1 or not tokens:
        return None
    lm, emb, cos_t, sin_t = tables
    B = len(tokens)
    tok = torch.tensor(tokens, dtype=torch.long)
    pos = torch.tensor(positions, dtype=torch.long)
    slot = torch.tensor(slots, dtype=torch.long)
    out = torch.empty((n, B), dtype=torch.long)
    lib.sync_threads()
    rc = lib.ops.greedy_steps.default(stack.layers, stack.conv, stack.dims_arg, emb,
                                      model.model.norm.weight, float(model.model.norm.eps), lm,
                                      cos_t, sin_t, tok, slot, pos, out, stack.eps, stack.qk_eps)
    if rc == -2:
        return None
    if rc:
        raise RuntimeError("greedy steps: out of memory for the scratch")
    return out.T.tolist()


def greedy_draft(stack: Stack, model, pending: list[list[int]], slots: list[int],
                 starts: list[int], n: int) -> list[list[int]] | None:
    """A draft model's whole greedy proposal for B rows in one C call
    (``greedy_draft_f32``): row b's ``pending[b]`` tokens (its catch-up: at least the last
    token) go into slot ``slots[b]`` at positions ``starts[b]`` on, the argmax of the last
    one's logits is its first draft, then ``n - 1`` greedy steps (``greedy_steps``).
    ``model``: the ``CausalLM`` of ``stack``. Returns the drafts per row, [B][n], or None
    where the call does not apply (no packed LM head, more tokens than the stack call
    takes, a position past the rotary table: the caller runs its torch steps). Raises
    RuntimeError when the library is missing or out of memory."""
    lib = load()
    if lib is None:
        raise RuntimeError("the decoder stack kernel is not built (see the log)")
    tables = _greedy_tables(model)
    T = sum(len(p) for p in pending)
    if tables is None or n < 1 or not pending or any(not p for p in pending) \
            or T > max_tokens():
        return None
    lm, emb, cos_t, sin_t = tables
    if max(s + len(p) for s, p in zip(starts, pending)) + n - 1 > min(cos_t.shape[0], stack.L):
        return None
    B = len(pending)
    flat = torch.tensor([[t for p in pending for t in p],
                         [s_ for s_, p in zip(slots, pending) for _ in p],
                         [st + i for st, p in zip(starts, pending) for i in range(len(p))]],
                        dtype=torch.long)
    last = torch.tensor(list(itertools.accumulate(len(p) for p in pending)),
                        dtype=torch.long) - 1
    out = torch.empty((n, B), dtype=torch.long)
    lib.sync_threads()
    rc = lib.ops.greedy_draft.default(stack.layers, stack.conv, stack.dims_arg, emb,
                                      model.model.norm.weight, float(model.model.norm.eps), lm,
                                      cos_t, sin_t, flat[0], flat[1], flat[2], last, out,
                                      stack.eps, stack.qk_eps)
    if rc == -2:
        return None
    if rc:
        raise RuntimeError("greedy draft: out of memory for the scratch")
    return out.T.tolist()


class BlockDraftCall:
    """A DFlash-family drafter's whole block forward as one C call (the ``block_draft``
    operator, ``block_draft_f32``), its fixed arguments bound once: ``stack`` (the
    drafter's layers), emb [V, H] (the shared embedding), mask_emb [H], cos_t, sin_t
    [P, D] (the drafter's rotary table, signed sin), norm_w [H] and norm_eps (its final
    norm), lm_packed (the shared LM head, ``linear_kernel.pack`` of [H, V]), and the
    decoding head run in the same call (``csrc/decoder_stack.c``'s ``draft_heads``):
    selector (wq [r, H], table [V, 3r], scale) or markov (pe [V, r], hid_w [r, H] or None,
    hid_b [r], proj_t [r, V]). ``of`` returns None where a tensor is not a float32
    contiguous CPU tensor (the caller runs the torch form)."""

    def __init__(self, stack: Stack, emb, mask_emb, cos_t, sin_t, norm_w, norm_eps: float,
                 lm_packed, selector: tuple | None = None, markov: tuple | None = None):
        self.stack = stack
        self.sel = (None, None, 0.0)
        self.mk = (None, None, None, None)
        self.r = 0
        if selector is not None:
            wq, table, scale = selector
            self.sel = (wq, table, float(scale))
            self.head = "selector"
        elif markov is not None:
            self.mk = tuple(markov)
            self.r = markov[0].shape[1]
            self.head = "markov"
        else:
            self.head = None
        self.V = lm_packed.shape[0] * lm_packed.shape[2]
        self.P = cos_t.shape[0]
        self.H = stack.dims[0]
        # the operator's arguments before the per-call ones (anchors, positions, slots, bs)
        # and between them and the outputs (the tables, the final norm, the LM head)
        self.args = (stack.layers, stack.conv, stack.dims_arg, emb, mask_emb)
        self.tables = (cos_t, sin_t, norm_w, float(norm_eps), lm_packed)

    @classmethod
    def of(cls, stack: Stack, emb, mask_emb, cos_t, sin_t, norm_w, norm_eps: float,
           lm_packed, selector: tuple | None = None,
           markov: tuple | None = None) -> "BlockDraftCall | None":
        """The call, or None where a tensor is not a float32 contiguous CPU tensor (a head
        whose tensors are not is left out: the caller decodes in torch)."""
        def ok(*ts):
            return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                                     and t.is_contiguous()) for t in ts)
        if load() is None or lm_packed is None or not ok(emb, mask_emb, cos_t, sin_t, norm_w):
            return None
        return cls(stack, emb, mask_emb, cos_t, sin_t, norm_w, norm_eps, lm_packed,
                   selector if selector is not None and ok(*selector[:2]) else None,
                   markov if markov is not None and ok(*markov) else None)

    def __call__(self, anchors: list[int], positions: list[int], slots: list[int], bs: int,
                 top_k: int = 0, decode: bool = False) -> tuple:
        """Row b's block [anchors[b], mask x (bs - 1)] at positions positions[b] .. + bs - 1
        of slot slots[b] through the stack (the block reads its context and itself), the
        final norm of the bs - 1 draft positions and the LM head. Returns (hidden
        [B, bs - 1, H], logits [B, bs - 1, V], top1 [B, bs - 1], topk indices and values
        [B, bs - 1, top_k] or None when top_k is 0), and with ``decode`` and a bound head
        a sixth item, (tokens [B, bs - 1], Markov features [B, bs - 1, r] or None): the
        selector's path (needs top_k > 0) or the Markov walk's (the logits are then the
        corrected ones). Raises ValueError on an anchor, slot or position out of range
        (nothing computed), RuntimeError out of memory."""
        lib = load()
        B, n, H, V = len(positions), bs - 1, self.H, self.V
        head = self.head if decode and (self.head != "selector" or top_k > 0) else None
        r = self.r if head == "markov" else 0
        idx = torch.tensor((anchors, positions, slots), dtype=torch.long)
        ints = torch.empty(B * n * (1 + top_k + (head is not None)), dtype=torch.long)
        flts = torch.empty(B * n * (H + V + top_k + r), dtype=torch.float32)
        hid = flts[:B * n * H].view(B, n, H)
        logits = flts[B * n * H:B * n * (H + V)].view(B, n, V)
        top1 = ints[:B * n].view(B, n)
        ki = ints[B * n:B * n * (1 + top_k)].view(B, n, top_k) if top_k else None
        kv = flts[B * n * (H + V):B * n * (H + V + top_k)].view(B, n, top_k) if top_k else None
        toks = ints[B * n * (1 + top_k):].view(B, n) if head is not None else None
        zs = flts[B * n * (H + V + top_k):].view(B, n, r) if r else None
        sel = self.sel if head == "selector" else (None, None, 0.0)
        mk = self.mk if head == "markov" else (None, None, None, None)
        lib.sync_threads()
        rc = lib.ops.block_draft.default(*self.args, idx[0], idx[1], idx[2], bs, *self.tables,
                                         hid, logits, top1, top_k, ki, kv, self.stack.eps,
                                         self.stack.qk_eps, *sel, *mk, zs, toks)
        if rc == -2:
            raise ValueError(f"block draft: an anchor outside 0..{V - 1}, a slot outside "
                             f"0..{self.stack.S - 1} or a block past position "
                             f"{min(self.stack.L, self.P) - 1}")
        if rc:
            raise RuntimeError("block draft: out of memory for its scratch")
        if head is not None:
            return hid, logits, top1, ki, kv, (toks, zs)
        return hid, logits, top1, ki, kv


def run_stack(stack: Stack, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
              slot: torch.Tensor, pos: torch.Tensor, aux_layers: tuple[int, ...] = (),
              span: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every layer of ``stack`` over a flat batch, in place: x [T, H] float32 contiguous
    (the embeddings; the last layer's output on return), cos, sin_signed [T, D] float32
    contiguous (``CausalLM.rotary``'s table rows, signed sin), slot, pos [T] int64
    contiguous: each token's K/V go to slot[t], position pos[t], and it attends positions
    0..pos[t] of that slot (0..span[t] with ``span`` [T] int64 contiguous: a drafter's
    block, whose tokens all read the whole block). Returns the outputs of ``aux_layers`` (layer indices) side by
    side in layer order, [T, len(aux_layers) * H] (``CausalLM.forward``'s ``aux_hidden``),
    or None without them. Raises ValueError on a slot or position out of range (nothing
    computed) or an aux layer outside the stack, RuntimeError when the library is missing
    or out of memory."""
    lib = load()
    if lib is None:
        raise RuntimeError("the decoder stack kernel is not built (see the log)")
    T, H = x.shape[0], stack.dims[0]
    aux, mask = None, 0
    if aux_layers:
        if any(not 0 <= i < min(stack.n, 63) for i in aux_layers):
            raise ValueError(f"decoder stack: aux layers {aux_layers} outside 0..{stack.n - 1}")
        mask = sum(1 << i for i in set(aux_layers))
        aux = torch.empty((T, bin(mask).count("1") * H), dtype=torch.float32)
    lib.sync_threads()
    rc = lib.ops.decoder_stack.default(stack.layers, stack.conv, stack.dims_arg, x, cos,
                                       sin_signed, slot, pos, stack.eps, stack.qk_eps, aux, mask,
                                       bin(mask).count("1"), span)
    if rc == -2:
        raise ValueError(f"decoder stack: a slot outside 0..{stack.S - 1} or a position "
                         f"outside 0..{stack.L - 1}")
    if rc:
        raise RuntimeError("decoder stack: out of memory for its scratch")
    return aux


def context_kv(stack: Stack, aux: torch.Tensor, fc_packed: torch.Tensor, norm_w: torch.Tensor,
               eps: float, cos: torch.Tensor, sin_signed: torch.Tensor, slot: int,
               start: int) -> None:
    """A DFlash-family drafter's context K/V of n tokens of one request, written into
    ``stack``'s caches at positions start..start + n - 1 of ``slot`` (``context_kv_f32``):
    aux [n, A] float32 contiguous (the target's aux hidden states), fc_packed the fusion
    weight (``linear_kernel.pack`` of [A, H]), norm_w [H] the fused states' RMSNorm
    weight, cos, sin_signed [n, D] float32 contiguous the positions' rotary rows. Raises
    ValueError on a slot or positions out of range (nothing written), RuntimeError when
    the library is missing or out of memory."""
    lib = load()
    if lib is None:
        raise RuntimeError("the decoder stack kernel is not built (see the log)")
    n = aux.shape[0]
    lib.sync_threads()
    rc = lib.ops.context_kv.default(stack.layers, stack.conv, stack.dims_arg, aux, fc_packed,
                                    norm_w, float(eps), cos, sin_signed, slot, start,
                                    stack.qk_eps)
    if rc == -2:
        raise ValueError(f"context K/V: slot {slot} outside 0..{stack.S - 1} or positions "
                         f"{start}..{start + n - 1} outside 0..{stack.L - 1}")
    if rc:
        raise RuntimeError("context K/V: out of memory for its scratch")


def selector_walk(hd: torch.Tensor, logv: torch.Tensor, cand: torch.Tensor,
                  anchors: torch.Tensor, table: torch.Tensor, wq: torch.Tensor,
                  scale: float) -> torch.Tensor | None:
    """DFlash 2's path-selector walk in one C call (``selector_walk_f32``;
    ``actors.drafters.heads.PathSelector.walk``'s torch form): hd [B, n, H], logv
    [B, n, K] (the candidates' logits: log-probs up to a per-position constant), table
    [V, 3r], wq [r, H] float32 CPU tensors, cand [B, n, K] and anchors [B] int64. Returns
    the chosen tokens [B, n] (int64), or None where the call does not apply (no
    library, another dtype or device). Raises ValueError on a token outside the
    vocabulary."""
    lib = load()
    fl = (hd, logv, table, wq)
    if lib is None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in fl) \
            or cand.device.type != "cpu" or anchors.device.type != "cpu":
        return None
    hd, logv, table, wq = (t.contiguous() for t in fl)
    cand = cand.to(torch.int64).contiguous()
    anchors = anchors.to(torch.int64).contiguous()
    B, n, K = cand.shape
    out = torch.empty((B, n), dtype=torch.int64)
    rc = lib.ops.selector_walk.default(hd, logv, cand, anchors, table, wq, float(scale), out)
    if rc == -2:
        raise ValueError(f"selector walk: a token outside 0..{table.shape[0] - 1}")
    if rc:
        raise RuntimeError("selector walk: out of memory")
    return out


def markov_walk(base: torch.Tensor, zin: torch.Tensor, pe: torch.Tensor, proj_t: torch.Tensor,
                anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """DSpark's Markov walk in one C call (``markov_walk_f32``; ``actors.drafters.decode.
    markov_walk``'s step-by-step form): base [B, n, V], zin [B, n, r], pe [V, r], proj_t
    [r, V] ((W_lm U)^T, ``BlockDrafter.markov_vocab_proj_t``) float32 CPU tensors, anchors
    [B] int64. Returns (tokens [B, n], z [B, n, r], logits [B, n, V]), the last two
    transposed views of position-major buffers, or None where the call does not apply (no
    library, another dtype or device). Raises ValueError on an anchor outside the
    vocabulary."""
    lib = load()
    ts = (base, zin, pe, proj_t)
    if lib is None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in ts):
        return None
    base, zin, pe, proj_t = (t.contiguous() for t in ts)
    B, n, V = base.shape
    r = zin.shape[-1]
    anchors = anchors.to(torch.int64).contiguous()
    logits = torch.empty((n, B, V), dtype=torch.float32)
    zs = torch.empty((n, B, r), dtype=torch.float32)
    toks = torch.empty((n, B), dtype=torch.int64)
    lib.sync_threads()
    rc = lib.ops.markov_walk.default(base, zin, pe, proj_t, anchors, logits, zs, toks)
    if rc:
        raise ValueError(f"markov walk: an anchor outside 0..{V - 1}")
    return toks.T, zs.transpose(0, 1), logits.transpose(0, 1)
