/* specload::linear_bf16: a few-row linear layer with bfloat16 weights, float32 sums.
   Design, layout and measurements: actors/engine/linear_kernel.py. Built by
   actors/engine/kernel_build.py (built with ops.cpp: kernel_build.FLAGS). */
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
/* software prefetch of the packed weights PF_ROWS k-rows ahead (both cache lines of a
   64-column row): a step's weights come from L3, and the hardware prefetcher alone left
   the tiles waiting on them */
#ifndef WIDE_FROM
#define WIDE_FROM 16
#endif
#ifndef PF_ROWS
#define PF_ROWS 32
#endif
#define PREFETCH_W(p) do { _mm_prefetch((const char *)((p) + PF_ROWS * 64), _MM_HINT_T0); \
                           _mm_prefetch((const char *)((p) + PF_ROWS * 64 + 32), _MM_HINT_T0); } while (0)
/* rows 0..MT-1 of x times one packed block (k-major, 64 wide: 4 zmm per k): MT x 4
   accumulators stay in registers (MT <= 7: 28 + the weights and a broadcast, 32 in all
   with the weights loaded two at a time) */
#define TILE512(MT)                                                                       \
static void tile512_##MT(const float *x, int64_t sx, const uint16_t *blk, float *y,       \
                         int64_t sy, int64_t K) {                                         \
    __m512 acc[MT][4];                                                                    \
    for (int i = 0; i < MT; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps(); \
    for (int64_t k = 0; k < K; ++k) {                                                     \
        const uint16_t *wr = blk + k * 64;                                                \
        PREFETCH_W(wr);                                                                   \
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
TILE512(2) TILE512(3) TILE512(4) TILE512(5) TILE512(6) TILE512(7)

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
            PREFETCH_W(blk + k * 64);                                                     \
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
TILE512H(8) TILE512H(9) TILE512H(10) TILE512H(11) TILE512H(12)

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
        /* up to WIDE_FROM rows: tiles of 7 rows first (7 x 64 columns, 28 accumulators:
           the largest tile that streams a block once), then the rest (8 rows: 7 + 1,
           16: 7 + 7 + 2); more rows: tiles of at most 12 on 32-column halves, as even as
           possible. Measured with a step's 25 weights streaming from L3 (one thread):
           7 rows 0.73 ms (0.87-0.93 as 4 + 3 or one 7-row half tile), 8 rows 0.89
           (0.93-1.06 as 4 + 4) */
        const int64_t left = M - m0, tiles = (left + 11) / 12;
        const int64_t mt = M <= WIDE_FROM ? (left < 7 ? left : 7) : (left + tiles - 1) / tiles;
        const float *xm = x + m0 * sx;
        float *ym = y + m0 * sy;
        switch (mt) {
            case 12: tile512h_12(xm, sx, blk, ym, sy, K); break;
            case 11: tile512h_11(xm, sx, blk, ym, sy, K); break;
            case 10: tile512h_10(xm, sx, blk, ym, sy, K); break;
            case 9: tile512h_9(xm, sx, blk, ym, sy, K); break;
            case 8: tile512h_8(xm, sx, blk, ym, sy, K); break;
            case 7: tile512_7(xm, sx, blk, ym, sy, K); break;
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

/* threads a product may use (the caller's torch_threads: linear_bf16_set_threads); with
   OpenMP (built with -fopenmp: the process's libgomp.so.1, torch's own copy once torch is
   loaded) the 64-column blocks are split between them */
static int specload_threads = 1;
void linear_bf16_set_threads(int n) { specload_threads = n > 0 ? n : 1; }
int linear_bf16_threads(void) {
#ifdef _OPENMP
    return specload_threads;
#else
    return 1;
#endif
}

/* y[M, N] = x[M, K] @ W[K, N]; w packed [N/64][K][64] (bfloat16 bits); x rows sx apart.
   Each 64-column block is read once and used for every row; with several threads
   (linear_bf16_threads) the blocks are split between them when there are at least two
   per thread and 2^16 multiply-adds in all. */
int linear_bf16_f32(const float *x, int64_t sx, const uint16_t *w, float *y,
                    int64_t M, int64_t K, int64_t N) {
    if (N % 64) return -1;
    const int64_t nb = N / 64;
#ifdef _OPENMP
    const int nt = specload_threads;
    if (nt > 1 && nb >= 2 * nt && M * K * N >= (1 << 16)) {
        #pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t b = 0; b < nb; ++b)
            block_rows(x, sx, w + b * K * 64, y + b * 64, N, M, K);
        return 0;
    }
#endif
    for (int64_t b = 0; b < nb; ++b)
        block_rows(x, sx, w + b * K * 64, y + b * 64, N, M, K);
    return 0;
}
