"""A C attention kernel for the compiled flat forward on a CPU (``specload::flat_attention``).

The flat forward (``Attention._flat_attention``) sends a batch's tokens as one sequence;
each token attends its own cache slot up to its own position. Written in torch, inductor
fuses it into loops that compute every token x every position of its group's longest
context (the rest masked), reduce each 64-wide dot product horizontally per score, and
read a slot's K/V once per query head and token. This kernel reads each token's own
positions only and does a run of up to ``TILE`` tokens of one slot (a verify row, a prompt
chunk) and one K/V head together, so the slot's rows come from memory once per run and
then from the caches; for head sizes 64 and 128 a head's query and accumulator stay in
registers, and the softmax's exps are glibc's vector ``expf`` (libmvec) where it exists.
Measured on the tiny target's shapes (h=4, kvh=2, D=64, one thread): 41 tokens of 16 rows
over contexts of 40-400, 0.35 ms a call (0.46 with a scalar ``expf``); inside a 16-user
ngram step 0.35 ms a layer, where inductor's loops took about 1.2 (round 8's profile).

Where the compiler targets AVX-512 (``simd_built()``), head sizes 64 and 128 run on
intrinsics: a query's scores 16 keys at a time, their 16 dot products reduced together
by one transpose-and-add tree (``reduce16``) instead of a horizontal sum each, the
softmax's max kept as a 16-lane running max (the scalar max loop was 30% of the call),
and the weighted sum of 4 (64) or 2 (128) queries per V row read. Measured here (one
thread, h=4, kvh=2, D=64, medians of 5 interleaved, the Python call included): a run of
8 tokens over 256 / 768 positions 37 / 87 us a call against 68 / 174 on the plain loops
(1.8x / 2.0x); one token 14 / 33 against 17 / 39. Elsewhere it is plain C (no intrinsics)
(``-O3 -march=native``: the compiler vectorises the loops for this CPU, as inductor does
for its own kernels), ``csrc/flat_attention.c``, built at first use with the other kernels
into one library of typed operators (``kernel_build.load_ops``; its ``flat_attention``
operator). Registered as the torch op ``specload::flat_attention`` (this module's
import), so ``torch.compile`` calls it from its graph.
``load()`` returns None where no compiler works; the caller keeps the torch form.

Math: softmax(q K^T * scale) V per token and head, float32, keys 0..pos[t] of slot
slot[t]; the same as ``F.scaled_dot_product_attention`` with that mask (Vaswani et al.
2017, eq. 1), up to float rounding (sums in another order: ~1e-7).
"""

from __future__ import annotations

import functools

import torch

# (cache_dir, cpu_id: re-exported for callers of this module)
from actors.engine.kernel_build import (Kernels, cache_dir, cpu_id,  # noqa: F401
                                        load_kernels, register_op)


TILE = 8        # tokens of one slot that share each K/V row read


@functools.lru_cache(maxsize=1)
def load() -> Kernels | None:
    """The built kernels (``kernel_build.load_ops``: built on first use, cached on disk);
    None (with a warning logged) when they cannot be built or loaded."""
    return load_kernels("flat_attention", "the torch form is used")


def simd_built() -> bool:
    """Whether the built kernel has the AVX-512 code (head sizes 64 and 128: scores 16 keys
    at a time, reduced together; weighted sums of several queries per V row read)."""
    lib = load()
    return lib is not None and lib.simd


def flat_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, slot: torch.Tensor,
                   pos: torch.Tensor, scale: float, simd: bool = True) -> torch.Tensor:
    """q [T, h, D] float32; ck, cv [S, L, kvh, D] float32 (the layer's cache, the
    batch's own K/V written already); slot, pos [T] int64 -> [T, h, D]: token t attends
    positions 0..pos[t] of slot slot[t]. The CPU implementation of the
    ``specload::flat_attention`` op (call it as ``torch.ops.specload.flat_attention``:
    the dispatcher's path costs about 15 us a call here, ``torch.library.custom_op``'s
    about 45). Raises RuntimeError when the kernel is not built (``load()`` None) or its
    scratch cannot be allocated, ValueError on a dtype, shape, slot or position it does
    not take. simd=False runs the plain C loops even where the AVX-512 code is built
    (``simd_built()``), for tests and side-by-side benchmarks."""
    lib = load()
    if lib is None:
        raise RuntimeError("the flat attention kernel is not built (see the log)")
    if q.dtype != torch.float32 or ck.dtype != torch.float32 or cv.dtype != torch.float32:
        raise ValueError("flat_attention takes float32 tensors")
    T, h, D = q.shape
    S, L, kvh, Dk = ck.shape
    if Dk != D or cv.shape != ck.shape or h % kvh or slot.shape != (T,) or pos.shape != (T,):
        raise ValueError(f"flat_attention: shapes q {tuple(q.shape)}, cache "
                         f"{tuple(ck.shape)}, slot {tuple(slot.shape)}, pos {tuple(pos.shape)}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if not (ck.is_contiguous() and cv.is_contiguous()):
        ck, cv = ck.contiguous(), cv.contiguous()
    if slot.dtype != torch.int64 or pos.dtype != torch.int64 or not (
            slot.is_contiguous() and pos.is_contiguous()):
        slot, pos = slot.to(torch.int64).contiguous(), pos.to(torch.int64).contiguous()
    out = torch.empty((T, h, D), dtype=q.dtype)
    if T:
        rc = lib.ops.flat_attention.default(q, ck, cv, slot, pos, out, float(scale),
                                            TILE if simd else -TILE)
        if rc == -2:
            raise ValueError(f"flat_attention: a slot outside 0..{S - 1} or a position "
                             f"outside 0..{L - 1}")
        if rc != 0:
            raise RuntimeError("flat_attention: out of memory for its scratch")
    return out


# the op, for torch.compile's graphs (``kernel_build.register_op``)
register_op("flat_attention", "flat_attention(Tensor q, Tensor ck, Tensor cv, Tensor slot, "
            "Tensor pos, float scale) -> Tensor", flat_attention,
            lambda q, ck, cv, slot, pos, scale: q.new_empty(q.shape))
