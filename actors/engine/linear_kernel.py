"""A C kernel for a linear layer of few rows whose weights are bfloat16 values (``linear_packed``).

A decode step at batch 1 on a CPU is a chain of matrix-vector products: every weight is
read from memory once per step and used for one multiply-add, so the step's time is the
weights' bytes over the memory bandwidth (on this project's 2-core box the 23 MB of the
embedded target's float32 weights took 4.3 ms of an 8.6 ms step, 25 ``mm`` calls averaging
174 us). The embedded checkpoints are stored in bfloat16 (``torch_dtype: bfloat16``, as
published LLM checkpoints are), so their float32 copies carry 16 zero low bits per
weight: half of every byte read is zeros. This kernel keeps such weights as their
bfloat16 bits and widens them in registers (a 16-bit shift: exact), multiplying float32
activations and summing in float32, so nothing is rounded that float32 ``mm`` would not
round; only the order of the sums differs (~1e-7 relative, as between two GEMM
libraries). It reads half the bytes: 1.7-2.1x faster than ``torch.mm`` over a step's 25
weights at 1 row, 1.5x at 4, 1.1x at 8, slower from 16 (measured here, one thread), so it
serves batches of at most ``MAX_ROWS`` rows (decode and verify steps); prefill chunks
stay on ``torch.mm`` and the float32 copies.

Layout: ``pack`` turns a ``linear_t`` weight [K, N] (N a multiple of 64) into
[N / 64, K, 64] bfloat16: each 64-column block is contiguous, so a block streams from
memory once and is reused from the caches for every row of the batch. AVX2 + FMA
intrinsics where the compiler targets them (``-march=native``), plain C loops elsewhere.
Built by ``actors.engine.kernel_build`` at first use; ``load()`` returns None where no
compiler works, and ``SPECLOAD_LINEAR_KERNEL=0`` turns the kernel off (the float32 path
then runs alone, for side-by-side benchmarks).

A ``torch.compile`` graph (the compiled flat forward, traced once over dynamic batch
sizes) calls it as the ``specload::linear_bf16`` op, which picks the kernel or ``mm`` by
the rows it gets, so the graph holds no row-count guard.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from actors.engine.kernel_build import load_kernel, register_op

MAX_ROWS = 8        # batches of more rows run on torch.mm (the kernel is slower from ~16)
BLOCK = 64          # columns per packed block

SOURCE = r"""
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WIDEN(p) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
/* rows 0..MT-1 of x, columns c0..c0+8*NV-1 of one packed block (k-major, 64 wide) */
#define TILE(MT, NV)                                                                      \
static void tile_##MT##_##NV(const float *x, int64_t sx, const uint16_t *blk, float *y,   \
                             int64_t sy, int64_t K, int64_t c0) {                         \
    __m256 acc[MT][NV];                                                                   \
    for (int i = 0; i < MT; ++i) for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps(); \
    for (int64_t k = 0; k < K; ++k) {                                                     \
        const uint16_t *wr = blk + k * 64 + c0;                                           \
        __m256 wv[NV];                                                                    \
        for (int j = 0; j < NV; ++j) wv[j] = WIDEN(wr + 8 * j);                           \
        for (int i = 0; i < MT; ++i) {                                                    \
            __m256 xv = _mm256_broadcast_ss(x + i * sx + k);                              \
            for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
        }                                                                                 \
    }                                                                                     \
    for (int i = 0; i < MT; ++i)                                                          \
        for (int j = 0; j < NV; ++j) _mm256_storeu_ps(y + i * sy + c0 + 8 * j, acc[i][j]); \
}
TILE(1, 8) TILE(2, 4) TILE(4, 2)

static void block_rows(const float *x, int64_t sx, const uint16_t *blk, float *y, int64_t sy,
                       int64_t M, int64_t K) {
    int64_t m0 = 0;
    while (m0 < M) {
        int64_t left = M - m0;
        const float *xm = x + m0 * sx;
        float *ym = y + m0 * sy;
        if (left >= 4) {
            for (int c = 0; c < 64; c += 16) tile_4_2(xm, sx, blk, ym, sy, K, c);
            m0 += 4;
        } else if (left >= 2) {
            for (int c = 0; c < 64; c += 32) tile_2_4(xm, sx, blk, ym, sy, K, c);
            m0 += 2;
        } else {
            tile_1_8(xm, sx, blk, ym, sy, K, 0);
            m0 += 1;
        }
    }
}
#else
static void block_rows(const float *x, int64_t sx, const uint16_t *blk, float *y, int64_t sy,
                       int64_t M, int64_t K) {
    for (int64_t i = 0; i < M; ++i) {
        float acc[64];
        for (int j = 0; j < 64; ++j) acc[j] = 0.f;
        for (int64_t k = 0; k < K; ++k) {
            float xv = x[i * sx + k];
            const uint16_t *wr = blk + k * 64;
            for (int j = 0; j < 64; ++j) acc[j] += xv * bf16_to_f32(wr[j]);
        }
        memcpy(y + i * sy, acc, sizeof acc);
    }
}
#endif

/* y[M, N] = x[M, K] @ W[K, N]; w packed [N/64][K][64] (bfloat16 bits); x rows sx apart.
   Each 64-column block is read once and used for every row. */
int linear_bf16_f32(const float *x, int64_t sx, const uint16_t *w, float *y,
                    int64_t M, int64_t K, int64_t N) {
    if (N % 64) return -1;
    for (int64_t b = 0; b < N / 64; ++b)
        block_rows(x, sx, w + b * K * 64, y + b * 64, N, M, K);
    return 0;
}
"""

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno")


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use, cached on disk); None (with a
    warning logged) when it cannot be built or loaded, or ``SPECLOAD_LINEAR_KERNEL=0``."""
    if os.environ.get("SPECLOAD_LINEAR_KERNEL", "1") == "0":
        return None
    P, I = ctypes.c_void_p, ctypes.c_int64
    return load_kernel("linear_bf16", SOURCE, FLAGS, "linear_bf16_f32", [P, I, P, P, I, I, I],
                       "float32 mm is used")


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of float32 ``w`` is a bfloat16 value (its low 16 bits zero)."""
    return w.dtype == torch.float32 and bool(
        (w.detach().contiguous().view(torch.int32) & 0xFFFF).eq(0).all())


def pack(wt: torch.Tensor) -> torch.Tensor | None:
    """A ``linear_t`` weight wt [K, N] float32 -> [N / 64, K, 64] bfloat16 (``linear_packed``'s
    layout), or None where the kernel cannot serve it: not a CPU float32 tensor, N not a
    multiple of 64, a value that is not a bfloat16 value (the kernel would round it), or no
    kernel (``load()``)."""
    if wt.device.type != "cpu" or wt.dim() != 2 or wt.shape[1] % BLOCK or not bf16_exact(wt) \
            or load() is None:
        return None
    K, N = wt.shape
    return wt.detach().to(torch.bfloat16).view(K, N // BLOCK, BLOCK).permute(1, 0, 2).contiguous()


def linear_packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided; columns contiguous), packed [N / 64, K, 64]
    bfloat16 (``pack``) -> x @ W [M, N] float32, sums in float32 (module docstring).
    Raises RuntimeError when the kernel is not built, ValueError on a dtype or shape it
    does not take."""
    lib = load()
    if lib is None:
        raise RuntimeError("the bf16 linear kernel is not built (see the log)")
    nb, K, blk = packed.shape
    if x.dtype != torch.float32 or packed.dtype != torch.bfloat16 or blk != BLOCK \
            or x.dim() != 2 or x.shape[1] != K or not packed.is_contiguous():
        raise ValueError(f"linear_packed: x {tuple(x.shape)} {x.dtype}, packed "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    M, N = x.shape[0], nb * BLOCK
    y = torch.empty((M, N), dtype=torch.float32)
    if M:
        lib.linear_bf16_f32(x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), M, K, N)
    return y


def linear_rows(x: torch.Tensor, wt: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, wt [K, N] float32, packed: ``pack(wt)`` -> x @ wt [M, N]: the kernel
    for at most ``MAX_ROWS`` rows, float32 ``mm`` above. The CPU implementation of the
    ``specload::linear_bf16`` op, which a ``torch.compile`` graph calls (the row count is
    dynamic there: the choice is made inside the op, so it adds no guard to the graph)."""
    if x.shape[0] <= MAX_ROWS:
        return linear_packed(x, packed)
    return torch.mm(x, wt)


# the op, for torch.compile's graphs (``kernel_build.register_op``)
register_op("linear_bf16", "linear_bf16(Tensor x, Tensor wt, Tensor packed) -> Tensor", linear_rows,
            lambda x, wt, packed: x.new_empty((x.shape[0], wt.shape[1])))
