/* specload::flat_attention: the flat forward's attention on a CPU. Design, math and
   measurements: actors/engine/attention_kernel.py. Built by actors/engine/kernel_build.py
   (built with ops.cpp: kernel_build.FLAGS). */
#include <math.h>
#ifdef SPECLOAD_SIMD_EXPF
/* glibc's vector expf (libmvec), declared as math.h does under -ffast-math only: the
   softmax loop then runs 8 exps at a time */
__attribute__((__simd__("notinbranch"), __nothrow__, __const__)) float expf(float);
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* threads one attention call may use (the caller's torch_threads:
   flat_attention_set_threads; only where built with OpenMP) */
static int attn_threads = 1;
void flat_attention_set_threads(int n) { attn_threads = n > 0 ? n : 1; }


static inline void softmax_rows(float *sc, float *inv, const int64_t *pos, int64_t r,
                                int64_t g, int64_t n) {
    for (int64_t i = 0; i < r; ++i) {
        const int64_t m = pos[i] + 1;
        for (int64_t gi = 0; gi < g; ++gi) {
            float *p = sc + (i * g + gi) * n;
            float mx = p[0];
            for (int64_t j = 1; j < m; ++j) mx = p[j] > mx ? p[j] : mx;
            float sum = 0.f;
            for (int64_t j = 0; j < m; ++j) { p[j] = expf(p[j] - mx); sum += p[j]; }
            inv[i * g + gi] = 1.f / sum;
        }
    }
}

/* One run of r tokens of one slot, one K/V head: scores, softmax, weighted sum. kb / vb:
   the slot's K / V rows of that head (row floats apart); the query of token i, head gi at
   qs + i * qt + gi * qh; its output at os + i * ot + gi * D; sc [r * g, n], inv [r * g]:
   scratch. */
static void run_generic(const float *qs, int64_t qt, int64_t qh, const float *kb,
                        const float *vb, int64_t row, const int64_t *pos, float *os,
                        int64_t ot, int64_t r, int64_t g, int64_t D, int64_t n, float scale,
                        float *sc, float *inv) {
    for (int64_t j = 0; j < n; ++j) {
        const float *kr = kb + j * row;
        for (int64_t i = 0; i < r; ++i) {
            if (j > pos[i]) continue;
            for (int64_t gi = 0; gi < g; ++gi) {
                const float *qq = qs + i * qt + gi * qh;
                float acc = 0.f;
                for (int64_t x = 0; x < D; ++x) acc += qq[x] * kr[x];
                sc[(i * g + gi) * n + j] = acc * scale;
            }
        }
    }
    softmax_rows(sc, inv, pos, r, g, n);
    for (int64_t i = 0; i < r; ++i)
        for (int64_t gi = 0; gi < g; ++gi) {
            float *o = os + i * ot + gi * D;
            const float *p = sc + (i * g + gi) * n;
            memset(o, 0, sizeof(float) * D);
            for (int64_t j = 0; j <= pos[i]; ++j) {
                const float *vr = vb + j * row;
                for (int64_t x = 0; x < D; ++x) o[x] += p[j] * vr[x];
            }
            const float w = inv[i * g + gi];
            for (int64_t x = 0; x < D; ++x) o[x] *= w;
        }
}

/* D known at compile time (64, 128): fully unrolled, vectorised loops; a head's
   query and accumulator stay in registers */
#define RUN_FIXED(DD)                                                                   \
static void run_d##DD(const float *qs, int64_t qt, int64_t qh, const float *kb,        \
                      const float *vb, int64_t row, const int64_t *pos, float *os,     \
                      int64_t ot, int64_t r, int64_t g, int64_t n, float scale,        \
                      float *sc, float *inv) {                                          \
    for (int64_t i = 0; i < r; ++i)                                                     \
        for (int64_t gi = 0; gi < g; ++gi) {                                            \
            float qv[DD];                                                               \
            memcpy(qv, qs + i * qt + gi * qh, sizeof qv);                               \
            float *p = sc + (i * g + gi) * n;                                           \
            for (int64_t j = 0; j <= pos[i]; ++j) {                                     \
                const float *kr = kb + j * row;                                         \
                float acc = 0.f;                                                        \
                for (int x = 0; x < DD; ++x) acc += qv[x] * kr[x];                      \
                p[j] = acc * scale;                                                     \
            }                                                                           \
        }                                                                               \
    softmax_rows(sc, inv, pos, r, g, n);                                                \
    for (int64_t i = 0; i < r; ++i)                                                     \
        for (int64_t gi = 0; gi < g; ++gi) {                                            \
            const float *p = sc + (i * g + gi) * n;                                     \
            float acc[DD];                                                              \
            for (int x = 0; x < DD; ++x) acc[x] = 0.f;                                  \
            for (int64_t j = 0; j <= pos[i]; ++j) {                                     \
                const float *vr = vb + j * row;                                         \
                const float w = p[j];                                                   \
                for (int x = 0; x < DD; ++x) acc[x] += w * vr[x];                       \
            }                                                                           \
            const float w = inv[i * g + gi];                                            \
            float *o = os + i * ot + gi * DD;                                           \
            for (int x = 0; x < DD; ++x) o[x] = acc[x] * w;                             \
        }                                                                               \
}
RUN_FIXED(64)
RUN_FIXED(128)

#if defined(__AVX512F__)
#include <immintrin.h>
#define SPECLOAD_ATTN_SIMD 1
/* 16 vectors -> one whose lane j is the sum of v[j]'s 16 lanes (a transpose-and-add tree:
   15 adds and 30 in-register shuffles for 16 dot products, instead of a horizontal
   reduction per dot product) */
static inline __m512 reduce16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; ++k)
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; ++k) {
        __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                              _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                              _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

/* AVX-512 form of run_d64 / run_d128 (NV = D / 16 vectors a row). Scores: per query, 16
   keys at a time, 16 independent accumulators reduced together (reduce16). Softmax as
   softmax_rows, each query's weights past its own keys set to 0. Weighted sum: QG queries
   at a time share each V row's loads (QG * NV accumulators in registers). */
#define RUN_SIMD(DD, QG)                                                                 \
static void run_simd_d##DD(const float *qs, int64_t qt, int64_t qh, const float *kb,     \
                           const float *vb, int64_t row, const int64_t *pos, float *os,  \
                           int64_t ot, int64_t r, int64_t g, int64_t n, float scale,     \
                           float *sc, float *inv) {                                      \
    enum { NV = DD / 16 };                                                               \
    const int64_t R = r * g;                                                             \
    for (int64_t qi = 0; qi < R; ++qi) {                                                 \
        const int64_t i = qi / g, gi = qi % g, m = pos[i] + 1;                           \
        const float *qq = qs + i * qt + gi * qh;                                         \
        __m512 qv[NV];                                                                   \
        for (int x = 0; x < NV; ++x) qv[x] = _mm512_loadu_ps(qq + 16 * x);              \
        float *p = sc + qi * n;                                                          \
        int64_t j = 0;                                                                   \
        __m512 vmx = _mm512_set1_ps(-INFINITY);  /* the running max, 16 lanes */        \
        for (; j + 16 <= m; j += 16) {                                                   \
            __m512 acc[16];                                                              \
            for (int kk = 0; kk < 16; ++kk) {                                            \
                const float *kr = kb + (j + kk) * row;                                   \
                __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));                    \
                for (int x = 1; x < NV; ++x)                                             \
                    a = _mm512_fmadd_ps(qv[x], _mm512_loadu_ps(kr + 16 * x), a);         \
                acc[kk] = a;                                                             \
            }                                                                            \
            const __m512 sv = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));      \
            vmx = _mm512_max_ps(vmx, sv);                                                \
            _mm512_storeu_ps(p + j, sv);                                                 \
        }                                                                                \
        float mx = _mm512_reduce_max_ps(vmx);                                            \
        for (; j < m; ++j) {                                                             \
            const float *kr = kb + j * row;                                              \
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));                        \
            for (int x = 1; x < NV; ++x)                                                 \
                a = _mm512_fmadd_ps(qv[x], _mm512_loadu_ps(kr + 16 * x), a);             \
            p[j] = _mm512_reduce_add_ps(a) * scale;                                      \
            mx = p[j] > mx ? p[j] : mx;                                                  \
        }                                                                                \
        float sum = 0.f;                                                                 \
        for (int64_t jj = 0; jj < m; ++jj) { p[jj] = expf(p[jj] - mx); sum += p[jj]; }   \
        for (int64_t jj = m; jj < n; ++jj) p[jj] = 0.f;                                  \
        inv[qi] = 1.f / sum;                                                             \
    }                                                                                    \
    for (int64_t q0 = 0; q0 < R; q0 += QG) {                                             \
        const int64_t nq = R - q0 < QG ? R - q0 : QG;                                    \
        int64_t m = 0;                                                                   \
        for (int64_t c = 0; c < nq; ++c) {                                               \
            const int64_t mm = pos[(q0 + c) / g] + 1;                                    \
            m = mm > m ? mm : m;                                                         \
        }                                                                                \
        __m512 acc[QG][NV];                                                              \
        for (int c = 0; c < QG; ++c)                                                     \
            for (int x = 0; x < NV; ++x) acc[c][x] = _mm512_setzero_ps();                \
        const float *p0 = sc + q0 * n;                                                   \
        if (nq == QG) {                                                                  \
            for (int64_t j = 0; j < m; ++j) {                                            \
                const float *vr = vb + j * row;                                          \
                __m512 vv[NV];                                                           \
                for (int x = 0; x < NV; ++x) vv[x] = _mm512_loadu_ps(vr + 16 * x);      \
                for (int c = 0; c < QG; ++c) {                                           \
                    const __m512 w = _mm512_set1_ps(p0[c * n + j]);                      \
                    for (int x = 0; x < NV; ++x) acc[c][x] = _mm512_fmadd_ps(w, vv[x], acc[c][x]); \
                }                                                                        \
            }                                                                            \
        } else {                                                                         \
            for (int64_t j = 0; j < m; ++j) {                                            \
                const float *vr = vb + j * row;                                          \
                for (int c = 0; c < nq; ++c) {                                           \
                    const __m512 w = _mm512_set1_ps(p0[c * n + j]);                      \
                    for (int x = 0; x < NV; ++x)                                         \
                        acc[c][x] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * x), acc[c][x]); \
                }                                                                        \
            }                                                                            \
        }                                                                                \
        for (int64_t c = 0; c < nq; ++c) {                                               \
            const int64_t qi = q0 + c, i = qi / g, gi = qi % g;                          \
            const __m512 w = _mm512_set1_ps(inv[qi]);                                    \
            float *o = os + i * ot + gi * DD;                                            \
            for (int x = 0; x < NV; ++x) _mm512_storeu_ps(o + 16 * x, _mm512_mul_ps(acc[c][x], w)); \
        }                                                                                \
    }                                                                                    \
}
RUN_SIMD(64, 4)
RUN_SIMD(128, 2)
#else
#define SPECLOAD_ATTN_SIMD 0
#endif

/* q [T, h, D] (strides qt, qh between tokens and heads; D contiguous), ck / cv
   [S, L, kvh, D] (contiguous, float32), slot / pos [T] (int64) -> out [T, h, D]
   (contiguous). Token t attends positions 0..pos[t] of slot slot[t]; the h query heads
   are kvh groups of g = h / kvh sharing one K/V head. Runs of up to `tile` consecutive
   tokens with the same slot are done together (their scores side by side). Returns 0;
   -1 when the scratch could not be allocated; -2 when a slot is outside 0..S-1 or a
   position outside 0..L-1 (nothing computed). A negative tile runs -tile tokens together
   on the plain C loops even where the AVX-512 code is built (for tests and benchmarks). */
int flat_attention_simd(void) { return SPECLOAD_ATTN_SIMD; }

int flat_attention_f32(const float *q, int64_t qt, int64_t qh,
                       const float *ck, const float *cv,
                       const int64_t *slot, const int64_t *pos, float *out,
                       int64_t T, int64_t h, int64_t kvh, int64_t D, int64_t S, int64_t L,
                       float scale, int64_t tile) {
    const int64_t g = h / kvh, row = kvh * D;
    const int simd = tile > 0;      /* tile < 0: the plain C loops (tests compare the two) */
    if (tile < 0) tile = -tile;
    int64_t nmax = 1;
    for (int64_t t = 0; t < T; ++t) {
        if (slot[t] < 0 || slot[t] >= S || pos[t] < 0 || pos[t] >= L) return -2;
        if (pos[t] + 1 > nmax) nmax = pos[t] + 1;
    }
    /* the work items: (group of up to `tile` consecutive tokens of one slot, K/V head);
       each writes its own output rows, so threads split them with nothing shared */
    int64_t *grp = (int64_t *)malloc(sizeof(int64_t) * 3 * (T > 0 ? T : 1));
    if (!grp) return -1;
    int64_t ng = 0;
    for (int64_t t0 = 0; t0 < T;) {
        int64_t t1 = t0 + 1;
        while (t1 < T && t1 - t0 < tile && slot[t1] == slot[t0]) ++t1;
        int64_t n = 0;
        for (int64_t i = t0; i < t1; ++i) if (pos[i] + 1 > n) n = pos[i] + 1;
        grp[3 * ng] = t0; grp[3 * ng + 1] = t1; grp[3 * ng + 2] = n;
        ++ng;
        t0 = t1;
    }
    const int64_t items = ng * kvh;
    int nt = 1;
#ifdef _OPENMP
    /* several threads (attention_threads) where the call reads at least 2^15 keys' worth */
    if (attn_threads > 1 && items >= 2 && T * nmax * g >= (1 << 15))
        nt = attn_threads < items ? attn_threads : (int)items;
#endif
    const int64_t per = tile * g * nmax;
    float *sc = (float *)malloc(sizeof(float) * per * nt);
    float *inv = (float *)malloc(sizeof(float) * tile * g * nt);
    if (!sc || !inv) { free(sc); free(inv); free(grp); return -1; }
#ifdef _OPENMP
    #pragma omp parallel for num_threads(nt) schedule(dynamic) if (nt > 1)
#endif
    for (int64_t it = 0; it < items; ++it) {
#ifdef _OPENMP
        const int tid = nt > 1 ? omp_get_thread_num() : 0;
#else
        const int tid = 0;
#endif
        float *sct = sc + per * tid, *invt = inv + tile * g * tid;
        const int64_t gi = it / kvh, k = it % kvh;
        const int64_t t0 = grp[3 * gi], r = grp[3 * gi + 1] - t0, n = grp[3 * gi + 2];
        const int64_t s = slot[t0];
        const float *kb = ck + s * L * row + k * D, *vb = cv + s * L * row + k * D;
        const float *qs = q + t0 * qt + k * g * qh;
        float *os = out + (t0 * h + k * g) * D;
#if SPECLOAD_ATTN_SIMD
        if (D == 64 && simd)
            run_simd_d64(qs, qt, qh, kb, vb, row, pos + t0, os, h * D, r, g, n, scale, sct, invt);
        else if (D == 128 && simd)
            run_simd_d128(qs, qt, qh, kb, vb, row, pos + t0, os, h * D, r, g, n, scale, sct,
                          invt);
        else
#endif
        if (D == 64)
            run_d64(qs, qt, qh, kb, vb, row, pos + t0, os, h * D, r, g, n, scale, sct, invt);
        else if (D == 128)
            run_d128(qs, qt, qh, kb, vb, row, pos + t0, os, h * D, r, g, n, scale, sct, invt);
        else
            run_generic(qs, qt, qh, kb, vb, row, pos + t0, os, h * D, r, g, D, n, scale,
                        sct, invt);
    }
    free(sc);
    free(inv);
    free(grp);
    return 0;
}
