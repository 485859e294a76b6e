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
weights at 1 row, 1.5x at 4, 1.1x at 8, slower from 16 (measured here, one thread, the
AVX2 code), so there it serves batches of at most ``MAX_ROWS`` rows (decode and verify
steps) and prefill chunks stay on ``torch.mm`` and the float32 copies. Where the compiler
targets AVX-512 the kernel computes 6 rows x 64 columns per tile (24 zmm accumulators)
and widens without shuffles (the layout below): 130-145 GFLOP/s one thread from 6 rows
up, about MKL's float32 GEMM on L2-resident weights (measured here), and ahead of it on a
model's weights (read from L3 at half the bytes), so it serves up to ``MAX_ROWS_WIDE``
rows: a verify of any length runs on the same code as a decode (no cliff at 8 rows).

Layout: ``pack`` turns a ``linear_t`` weight [K, N] (N a multiple of 64) into
[N / 64, K, 64] bfloat16: each 64-column block is contiguous, so a block streams from
memory once and is reused from the caches for every row of the batch; with the AVX-512
code each 32-column half is interleaved (int32 lane i holds columns i and 16 + i:
``interleaved()``). AVX-512 or AVX2 + FMA intrinsics where the compiler targets them
(``-march=native``; ``isa()`` says which), plain C loops elsewhere.
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

from actors.engine.kernel_build import load_kernel, load_kernel_outcome, record, register_op

MAX_ROWS = 8        # batches of more rows run on torch.mm (the AVX2 kernel is slower from ~16)
# ... with the AVX-512 code (``isa() == 512``: 6-row tiles of 64 columns, 130-145 GFLOP/s
# one thread from 6 rows up, measured here, vs MKL's 1024^3 GEMM ~150): this many
MAX_ROWS_WIDE = 1024
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

#if defined(__AVX512F__)
#include <immintrin.h>
#define SPECLOAD_LINEAR_ISA 512
/* 16 bfloat16 values -> 16 float32 (exact: the bits shifted into the high half) */
/* The AVX-512 layout interleaves each 32-column half of a block (``pack``): int32 lane i
   of a 64-byte load holds column i (low 16 bits) and column 16 + i (high 16 bits), so
   widening is one ALU op per 16 floats, no shuffle: the low column shifted up, the high
   one masked (both exact). */
#define LO16(v) _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
#define HI16(v) _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)))
#define LOAD32(p) _mm512_loadu_si512((const void *)(p))
/* rows 0..MT-1 of x times one packed block (k-major, 64 wide: 4 zmm per k): MT x 4
   accumulators stay in registers (MT <= 6: 24 + 4 weights + 1 broadcast of 32) */
#define TILE512(MT)                                                                       \
static void tile512_##MT(const float *x, int64_t sx, const uint16_t *blk, float *y,       \
                         int64_t sy, int64_t K) {                                         \
    __m512 acc[MT][4];                                                                    \
    for (int i = 0; i < MT; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps(); \
    for (int64_t k = 0; k < K; ++k) {                                                     \
        const uint16_t *wr = blk + k * 64;                                                \
        __m512i a = LOAD32(wr), b = LOAD32(wr + 32);                                      \
        __m512 w0 = LO16(a), w1 = HI16(a), w2 = LO16(b), w3 = HI16(b);                    \
        for (int i = 0; i < MT; ++i) {                                                    \
            __m512 xv = _mm512_set1_ps(x[i * sx + k]);                                    \
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);                               \
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);                               \
            acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);                               \
            acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);                               \
        }                                                                                 \
    }                                                                                     \
    for (int i = 0; i < MT; ++i)                                                          \
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + i * sy + 16 * j, acc[i][j]);     \
}
TILE512(2) TILE512(3) TILE512(4) TILE512(5) TILE512(6)

/* rows 0..MT-1 of x times one 32-column half of a packed block (7 <= MT <= 12: 2 MT
   accumulators + 2 weights + 1 broadcast of 32 registers). Per k one load and two widening
   ops serve 2 MT FMAs: the widening shares the FMA ports, so 8 rows here (16 FMAs per 2
   widens) beat two 4-row tiles over 64 columns (16 per 4). */
#define TILE512H(MT)                                                                      \
static void tile512h_##MT(const float *x, int64_t sx, const uint16_t *blk, float *y,      \
                          int64_t sy, int64_t K) {                                        \
    for (int hf = 0; hf < 2; ++hf) {                                                      \
        __m512 acc[MT][2];                                                                \
        for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();         \
        for (int64_t k = 0; k < K; ++k) {                                                 \
            __m512i a = LOAD32(blk + k * 64 + 32 * hf);                                   \
            __m512 w0 = LO16(a), w1 = HI16(a);                                            \
            for (int i = 0; i < MT; ++i) {                                                \
                __m512 xv = _mm512_set1_ps(x[i * sx + k]);                                \
                acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);                           \
                acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);                           \
            }                                                                             \
        }                                                                                 \
        for (int i = 0; i < MT; ++i) {                                                    \
            _mm512_storeu_ps(y + i * sy + 32 * hf, acc[i][0]);                            \
            _mm512_storeu_ps(y + i * sy + 32 * hf + 16, acc[i][1]);                       \
        }                                                                                 \
    }                                                                                     \
}
TILE512H(7) TILE512H(8) TILE512H(9) TILE512H(10) TILE512H(11) TILE512H(12)

/* one row: two accumulator sets over even / odd k (8 independent FMA chains) */
static void tile512_1(const float *x, const uint16_t *blk, float *y, int64_t K) {
    __m512 c[8];
    for (int j = 0; j < 8; ++j) c[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 1 < K; k += 2) {
        const uint16_t *wr = blk + k * 64;
        __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
        __m512i a = LOAD32(wr), b = LOAD32(wr + 32), d = LOAD32(wr + 64), e = LOAD32(wr + 96);
        c[0] = _mm512_fmadd_ps(x0, LO16(a), c[0]);
        c[1] = _mm512_fmadd_ps(x0, HI16(a), c[1]);
        c[2] = _mm512_fmadd_ps(x0, LO16(b), c[2]);
        c[3] = _mm512_fmadd_ps(x0, HI16(b), c[3]);
        c[4] = _mm512_fmadd_ps(x1, LO16(d), c[4]);
        c[5] = _mm512_fmadd_ps(x1, HI16(d), c[5]);
        c[6] = _mm512_fmadd_ps(x1, LO16(e), c[6]);
        c[7] = _mm512_fmadd_ps(x1, HI16(e), c[7]);
    }
    for (; k < K; ++k) {
        const uint16_t *wr = blk + k * 64;
        __m512 x0 = _mm512_set1_ps(x[k]);
        __m512i a = LOAD32(wr), b = LOAD32(wr + 32);
        c[0] = _mm512_fmadd_ps(x0, LO16(a), c[0]);
        c[1] = _mm512_fmadd_ps(x0, HI16(a), c[1]);
        c[2] = _mm512_fmadd_ps(x0, LO16(b), c[2]);
        c[3] = _mm512_fmadd_ps(x0, HI16(b), c[3]);
    }
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + 16 * j, _mm512_add_ps(c[j], c[j + 4]));
}

static void block_rows(const float *x, int64_t sx, const uint16_t *blk, float *y, int64_t sy,
                       int64_t M, int64_t K) {
    int64_t m0 = 0;
    while (m0 < M) {
        /* the rows left in tiles of at most 12, as even as possible; tiles of 7-12 rows run
           on 32-column halves (tile512h), of at most 6 on whole blocks (8 rows: one 8-row
           tile, 13: 7 + 6, not 12 + 1: a short tile spends as much on widening as on FMAs) */
        const int64_t left = M - m0, tiles = (left + 11) / 12, mt = (left + tiles - 1) / tiles;
        const float *xm = x + m0 * sx;
        float *ym = y + m0 * sy;
        switch (mt) {
            case 12: tile512h_12(xm, sx, blk, ym, sy, K); break;
            case 11: tile512h_11(xm, sx, blk, ym, sy, K); break;
            case 10: tile512h_10(xm, sx, blk, ym, sy, K); break;
            case 9: tile512h_9(xm, sx, blk, ym, sy, K); break;
            case 8: tile512h_8(xm, sx, blk, ym, sy, K); break;
            case 7: tile512h_7(xm, sx, blk, ym, sy, K); break;
            case 6: tile512_6(xm, sx, blk, ym, sy, K); break;
            case 5: tile512_5(xm, sx, blk, ym, sy, K); break;
            case 4: tile512_4(xm, sx, blk, ym, sy, K); break;
            case 3: tile512_3(xm, sx, blk, ym, sy, K); break;
            case 2: tile512_2(xm, sx, blk, ym, sy, K); break;
            default: tile512_1(xm, blk, ym, K); break;
        }
        m0 += mt;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECLOAD_LINEAR_ISA 256
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
#define SPECLOAD_LINEAR_ISA 0
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

/* the vector width the kernel was built for: 512 (AVX-512), 256 (AVX2 + FMA), 0 (plain C) */
int linear_bf16_isa(void) { return SPECLOAD_LINEAR_ISA; }

/* the packed layout the kernel reads: 1 = each 32-column half interleaved (AVX-512), 0 plain */
int linear_bf16_layout(void) { return SPECLOAD_LINEAR_ISA == 512; }

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
        record("linear_bf16", status="disabled", reason="SPECLOAD_LINEAR_KERNEL=0",
               fallback="float32 mm is used")
        return None
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib = load_kernel("linear_bf16", SOURCE, FLAGS, "linear_bf16_f32", [P, I, P, P, I, I, I],
                      "float32 mm is used")
    if lib is not None:
        lib.linear_bf16_isa.restype = lib.linear_bf16_layout.restype = ctypes.c_int
        lib.linear_bf16_isa.argtypes = lib.linear_bf16_layout.argtypes = []
        lib.specload_isa = int(lib.linear_bf16_isa())          # (read per call: kept here)
        lib.specload_interleaved = bool(lib.linear_bf16_layout())
        record("linear_bf16", **load_kernel_outcome("linear_bf16"), isa=lib.specload_isa,
               max_rows=MAX_ROWS_WIDE if lib.specload_isa == 512 else MAX_ROWS)
    return lib


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
    p = wt.detach().to(torch.bfloat16).view(K, N // BLOCK, BLOCK).permute(1, 0, 2)
    if interleaved():       # [nb, K, 2 halves, 2 (lo, hi), 16] -> [nb, K, 2, 16, 2]
        p = p.reshape(N // BLOCK, K, 2, 2, 16).transpose(3, 4).reshape(N // BLOCK, K, BLOCK)
    return p.contiguous()


def isa() -> int:
    """The vector width the built kernel uses: 512 (AVX-512), 256 (AVX2 + FMA), 0 (plain C,
    or no kernel)."""
    lib = load()
    return lib.specload_isa if lib is not None else 0


def interleaved() -> bool:
    """Whether ``pack``'s blocks interleave each 32-column half (the AVX-512 code's layout:
    int32 lane i holds columns i and 16 + i, widened without a shuffle)."""
    lib = load()
    return lib is not None and lib.specload_interleaved


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


def max_rows() -> int:
    """The most rows a call runs on the kernel (``MAX_ROWS``, ``MAX_ROWS_WIDE`` with the
    AVX-512 code); more run on float32 ``mm``."""
    return MAX_ROWS_WIDE if isa() == 512 else MAX_ROWS


def linear_rows(x: torch.Tensor, wt: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, wt [K, N] float32, packed: ``pack(wt)`` -> x @ wt [M, N]: the kernel
    for at most ``max_rows()`` rows, float32 ``mm`` above. The CPU implementation of the
    ``specload::linear_bf16`` op, which a ``torch.compile`` graph calls (the row count is
    dynamic there: the choice is made inside the op, so it adds no guard to the graph)."""
    if x.shape[0] <= max_rows():
        return linear_packed(x, packed)
    return torch.mm(x, wt)


# the op, for torch.compile's graphs (``kernel_build.register_op``)
register_op("linear_bf16", "linear_bf16(Tensor x, Tensor wt, Tensor packed) -> Tensor", linear_rows,
            lambda x, wt, packed: x.new_empty((x.shape[0], wt.shape[1])))
