/* The decoder stack of a flat batch in one call, the DFlash family's drafter pieces
   (context K/V, DSpark's Markov walk). Design: actors/engine/layer_kernel.py. One
   translation unit with the two kernels it calls (the includes below; kernel_build
   inlines them, so the cache key covers them), compiled as part of ops.cpp (the typed
   operators: kernel_build.load_ops, kernel_build.FLAGS); valid C and C++. */
#include "flat_attention.c"
#include "linear_bf16.c"
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef struct {
    const float *w_in, *w_post, *qkv_b, *qk_w;
    const uint16_t *qkv, *o, *gate_up, *down;
    float *ck, *cv;
    /* DFlash 2's dynamic convolutions on the normalised inputs of attention (ca_) and of
       the MLP (cm_), or NULL: down [H, conv_r] float, up packed [2H / 64][conv_r][64],
       bias [2H]; conv_block: the block length (no tap reads across a block start) */
    const float *ca_down, *ca_b, *cm_down, *cm_b;
    const uint16_t *ca_up, *cm_up;
    int64_t conv_r, conv_block;
} layer_w;

/* DFlash 2's two-tap dynamic depthwise convolution ("Keep Drafting Parallel"), in place on
   a [T, H] (T a multiple of the block, blocks end to end): taps [k0 | k1] = up(silu(a_t
   down)) + b, a_t <- k0 * a_t + k1 * a_(t-1), a_(-1) = 0 at every block start
   (``actors.drafters.model.DynamicConv2``). Returns -1 out of memory. */
static int dyn_conv(float *a, int64_t T, int64_t H, const float *down, const uint16_t *up,
                    const float *b, int64_t r, int64_t block) {
    float *buf = (float *)malloc(sizeof(float) * (T * r + 2 * T * H));
    if (!buf) return -1;
    float *d = buf, *taps = buf + T * r;
    for (int64_t t = 0; t < T; ++t) {
        const float *x = a + t * H;
        float *dt = d + t * r;
        for (int64_t j = 0; j < r; ++j) dt[j] = 0.f;
        for (int64_t k = 0; k < H; ++k) {
            const float xv = x[k];
            const float *wr = down + k * r;
            for (int64_t j = 0; j < r; ++j) dt[j] += xv * wr[j];
        }
        for (int64_t j = 0; j < r; ++j) dt[j] = dt[j] / (1.f + expf(-dt[j]));
    }
    linear_bf16_f32(d, r, up, taps, T, r, 2 * H);
    for (int64_t t = T - 1; t >= 0; --t) {     /* backwards: a_(t-1) still the input */
        float *x = a + t * H;
        const float *k0 = taps + t * 2 * H, *k1 = k0 + H;
        const int first = (t % block) == 0;
        for (int64_t i = 0; i < H; ++i)
            x[i] = (k0[i] + b[i]) * x[i] + (first ? 0.f : (k1[i] + b[H + i]) * x[i - H]);
    }
    free(buf);
    return 0;
}

static void rms_rows(const float *x, const float *w, float *y, int64_t T, int64_t n,
                     float eps) {
    for (int64_t t = 0; t < T; ++t) {
        const float *xr = x + t * n;
        float *yr = y + t * n;
        float s = 0.f;
        for (int64_t i = 0; i < n; ++i) s += xr[i] * xr[i];
        const float r = 1.f / sqrtf(s * (1.f / (float)n) + eps);
        for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * r * w[i];
    }
}

/* x [T, H] (in place: the residual stream through nl layers); cs, sn [T, D] the rotary
   cos and signed sin of each token's position; slot, pos [T]; caches [S, L, kvh, D] per
   layer (in ws); aux [T, A * H] or NULL: after each layer l whose bit is set in aux_mask,
   x is copied into the next H columns (the DFlash family's target hidden states).
   span [T] or NULL: token t attends positions 0..span[t] of its slot instead of
   0..pos[t] (a DFlash block: every block token reads the context before the anchor and
   the whole block, its K/V all written before any attention). Returns 0; -1 when scratch
   could not be allocated; -2 when a slot, position or span is out of range (nothing
   computed). */
static int stack_rows(const layer_w *ws, int64_t nl, float *x, int64_t T,
                      const float *cs, const float *sn, const int64_t *slot,
                      const int64_t *pos, int64_t S, int64_t L, int64_t H, int64_t I,
                      int64_t h, int64_t kvh, int64_t D, float eps, float qk_eps,
                      float scale, float *aux, int64_t aux_mask, int64_t naux,
                      const int64_t *span, const int64_t *keep, int64_t nkeep);

int decoder_stack_f32(const layer_w *ws, int64_t nl, float *x, int64_t T,
                      const float *cs, const float *sn, const int64_t *slot,
                      const int64_t *pos, int64_t S, int64_t L, int64_t H, int64_t I,
                      int64_t h, int64_t kvh, int64_t D, float eps, float qk_eps,
                      float scale, float *aux, int64_t aux_mask, int64_t naux,
                      const int64_t *span) {
    return stack_rows(ws, nl, x, T, cs, sn, slot, pos, S, L, H, I, h, kvh, D, eps, qk_eps,
                      scale, aux, aux_mask, naux, span, NULL, 0);
}

/* decoder_stack_f32 where only the rows keep [nkeep] (increasing) of the last layer's
   output are wanted (a block's draft positions, a catch-up's last tokens): after the last
   layer's attention (every token's K/V are written) only they go through the output
   projection and the MLP, and x's first nkeep rows hold them on return (no aux then). */
static int stack_rows(const layer_w *ws, int64_t nl, float *x, int64_t T,
                      const float *cs, const float *sn, const int64_t *slot,
                      const int64_t *pos, int64_t S, int64_t L, int64_t H, int64_t I,
                      int64_t h, int64_t kvh, int64_t D, float eps, float qk_eps,
                      float scale, float *aux, int64_t aux_mask, int64_t naux,
                      const int64_t *span, const int64_t *keep, int64_t nkeep) {
    if (keep) {
        if (aux || nkeep < 1 || nkeep > T) return -2;
        for (int64_t j = 0; j < nkeep; ++j)
            if (keep[j] < j || keep[j] >= T || (j && keep[j] <= keep[j - 1])) return -2;
    }
    for (int64_t t = 0; t < T; ++t)
        if (slot[t] < 0 || slot[t] >= S || pos[t] < 0 || pos[t] >= L) return -2;
    if (span)
        for (int64_t t = 0; t < T; ++t) if (span[t] < 0 || span[t] >= L) return -2;
    const int64_t NQ = (h + 2 * kvh) * D, row = kvh * D, half = D / 2;
    float *buf = (float *)malloc(sizeof(float) * (T * H + T * NQ + T * h * D + 3 * T * I + D));
    if (!buf) return -1;
    float *a = buf, *qkv = a + T * H, *att = qkv + T * NQ, *gu = att + T * h * D;
    float *act = gu + 2 * T * I, *tmp = act + T * I;
    int64_t ja = 0;
    for (int64_t l = 0; l < nl; ++l) {
        const layer_w *w = ws + l;
        rms_rows(x, w->w_in, a, T, H, eps);
        if (w->ca_up && dyn_conv(a, T, H, w->ca_down, w->ca_up, w->ca_b, w->conv_r,
                                 w->conv_block)) { free(buf); return -1; }
        linear_bf16_f32(a, H, w->qkv, qkv, T, H, NQ);
        for (int64_t t = 0; t < T; ++t) {
            float *r = qkv + t * NQ;
            if (w->qkv_b) for (int64_t i = 0; i < NQ; ++i) r[i] += w->qkv_b[i];
            const float *c = cs + t * D, *s = sn + t * D;
            for (int64_t hd = 0; hd < h + kvh; ++hd) {
                float *p = r + hd * D;
                if (w->qk_w) rms_rows(p, w->qk_w + hd * D, p, 1, D, qk_eps);
                for (int64_t i = 0; i < D; ++i)
                    tmp[i] = p[i] * c[i] + p[i < half ? i + half : i - half] * s[i];
                memcpy(p, tmp, sizeof(float) * D);
            }
            float *kd = w->ck + (slot[t] * L + pos[t]) * row;
            float *vd = w->cv + (slot[t] * L + pos[t]) * row;
            memcpy(kd, r + h * D, sizeof(float) * row);
            memcpy(vd, r + (h + kvh) * D, sizeof(float) * row);
        }
        int rc = flat_attention_f32(qkv, NQ, D, w->ck, w->cv, slot, span ? span : pos, att, T,
                                    h, kvh, D, S, L, scale, 8);
        if (rc) { free(buf); return rc; }
        /* (a layer with a dynamic convolution before its MLP needs every row's normed
           input there: its taps read the previous row, so it compacts after it, below) */
        if (keep && l == nl - 1 && !w->cm_up) {  /* ascending, keep[j] >= j: a forward
                                                    copy is safe */
            for (int64_t j = 0; j < nkeep; ++j) if (keep[j] != j) {
                memcpy(att + j * h * D, att + keep[j] * h * D, sizeof(float) * h * D);
                memcpy(x + j * H, x + keep[j] * H, sizeof(float) * H);
            }
            T = nkeep;
        }
        linear_bf16_f32(att, h * D, w->o, a, T, h * D, H);
        for (int64_t i = 0; i < T * H; ++i) x[i] += a[i];
        rms_rows(x, w->w_post, a, T, H, eps);
        if (w->cm_up && dyn_conv(a, T, H, w->cm_down, w->cm_up, w->cm_b, w->conv_r,
                                 w->conv_block)) { free(buf); return -1; }
        if (keep && l == nl - 1 && w->cm_up) {
            for (int64_t j = 0; j < nkeep; ++j) if (keep[j] != j) {
                memcpy(a + j * H, a + keep[j] * H, sizeof(float) * H);
                memcpy(x + j * H, x + keep[j] * H, sizeof(float) * H);
            }
            T = nkeep;
        }
        linear_bf16_f32(a, H, w->gate_up, gu, T, H, 2 * I);
        for (int64_t t = 0; t < T; ++t) {
            const float *g = gu + t * 2 * I, *u = g + I;
            float *o = act + t * I;
            for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        }
        linear_bf16_f32(act, I, w->down, a, T, I, H);
        for (int64_t i = 0; i < T * H; ++i) x[i] += a[i];
        if (aux && l < 63 && (aux_mask >> l & 1)) {
            for (int64_t t = 0; t < T; ++t)
                memcpy(aux + t * naux * H + ja * H, x + t * H, sizeof(float) * H);
            ++ja;
        }
    }
    free(buf);
    return 0;
}

/* the first index of the largest of x[0..n-1] (torch's argmax on ties) */
static int64_t argmax_row(const float *x, int64_t n) {
    float m = x[0];
    int64_t v = 0;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 mv = _mm512_loadu_ps(x);
        for (v = 16; v + 16 <= n; v += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + v));
        m = _mm512_reduce_max_ps(mv);
    }
#endif
    for (; v < n; ++v) m = x[v] > m ? x[v] : m;
    for (v = 0; v < n; ++v) if (x[v] == m) return v;
    return 0;       /* all NaN: torch would say the first NaN */
}

/* n greedy decoding steps of B rows in one call (a draft model's drafts): each step the
   rows' input tokens tok [B] (embedding rows of emb [V, H]) go through the stack at
   positions pos [B] of slots slot [B], then the final RMSNorm (norm_w, norm_eps) and the
   LM head (lm: packed [V / 64][H][64]) give logits [B, V], whose first maximum is the
   next input (argmax, ties to the lowest id, as torch's). cos_t, sin_t [P, D]: the rotary
   table (signed sin). out [n, B]: the picked tokens; tok and pos are advanced in place.
   Returns 0; -1 out of memory; -2 a slot, position (or P) out of range. */
int greedy_steps_f32(const layer_w *ws, int64_t nl, const float *emb, const float *norm_w,
                     float norm_eps, const uint16_t *lm, int64_t V, const float *cos_t,
                     const float *sin_t, int64_t P, int64_t *tok, const int64_t *slot,
                     int64_t *pos, int64_t B, int64_t n, int64_t *out, int64_t S, int64_t L,
                     int64_t H, int64_t I, int64_t h, int64_t kvh, int64_t D, float eps,
                     float qk_eps, float scale) {
    for (int64_t b = 0; b < B; ++b)
        if (pos[b] < 0 || pos[b] + n > P || pos[b] + n > L || tok[b] < 0 || tok[b] >= V)
            return -2;
    float *buf = (float *)malloc(sizeof(float) * (2 * B * H + 2 * B * D + B * V));
    if (!buf) return -1;
    float *x = buf, *a = x + B * H, *cs = a + B * H, *sn = cs + B * D, *lg = sn + B * D;
    int rc = 0;
    for (int64_t step = 0; step < n && !rc; ++step) {
        for (int64_t b = 0; b < B; ++b) {
            memcpy(x + b * H, emb + tok[b] * H, sizeof(float) * H);
            memcpy(cs + b * D, cos_t + pos[b] * D, sizeof(float) * D);
            memcpy(sn + b * D, sin_t + pos[b] * D, sizeof(float) * D);
        }
        rc = decoder_stack_f32(ws, nl, x, B, cs, sn, slot, pos, S, L, H, I, h, kvh, D, eps,
                               qk_eps, scale, NULL, 0, 0, NULL);
        if (rc) break;
        rms_rows(x, norm_w, a, B, H, norm_eps);
        linear_bf16_f32(a, H, lm, lg, B, H, V);
        for (int64_t b = 0; b < B; ++b) {
            const int64_t best = argmax_row(lg + b * V, V);
            out[step * B + b] = best;
            tok[b] = best;
            pos[b] += 1;
        }
    }
    free(buf);
    return rc;
}

/* One step of DSpark's Markov walk: z = silu(pe_prev + zi) [r], row = base_row +
   proj_t^T z [V] (128 vocabulary entries at a time in 8 accumulators, each coefficient row
   of proj_t [r, V] read in order: no reduction tree; row may be base_row, in place).
   Returns the argmax of row (ties to the lowest id). */
static int64_t markov_step(const float *pe_prev, const float *zi, const float *base_row,
                           const float *proj_t, int64_t r, int64_t V, float *z, float *row) {
    for (int64_t j = 0; j < r; ++j) {
        const float v = pe_prev[j] + zi[j];
        z[j] = v / (1.f + expf(-v));
    }
    int64_t v0 = 0;
#if SPECLOAD_ATTN_SIMD
    for (; v0 + 128 <= V; v0 += 128) {
        __m512 acc[8];
        for (int k = 0; k < 8; ++k) acc[k] = _mm512_loadu_ps(base_row + v0 + 16 * k);
        for (int64_t j = 0; j < r; ++j) {
            const __m512 zj = _mm512_set1_ps(z[j]);
            const float *pj = proj_t + j * V + v0;
            for (int k = 0; k < 8; ++k)
                acc[k] = _mm512_fmadd_ps(zj, _mm512_loadu_ps(pj + 16 * k), acc[k]);
        }
        for (int k = 0; k < 8; ++k) _mm512_storeu_ps(row + v0 + 16 * k, acc[k]);
    }
#endif
    for (int64_t v = v0; v < V; ++v) row[v] = base_row[v];
    for (int64_t j = 0; j < r; ++j) {
        const float zj = z[j];
        const float *pj = proj_t + j * V;
        for (int64_t v = v0; v < V; ++v) row[v] += zj * pj[v];
    }
    return argmax_row(row, V);
}

/* DSpark's left-to-right Markov walk (arXiv 2607.05147, Sec. 3.2) of B rows over n block
   positions: z_i = silu(pe[prev] + zin_i), logits_i = base_i + proj z_i, prev = argmax
   logits_i (ties to the lowest id, as torch's argmax), prev = anchor at i = 0.
   base [B, n, V], zin [B, n, r], pe [V, r], proj_t [r, V] ((W_lm U)^T, row j the
   vocabulary's j-th coefficients), anchor [B]; out: logits [n, B, V], zs [n, B, r],
   toks [n, B] (position-major, as the torch walk's buffers). Returns 0; -2 an anchor
   outside 0..V-1. */
int markov_walk_f32(const float *base, const float *zin, const float *pe, const float *proj_t,
                    const int64_t *anchor, int64_t B, int64_t n, int64_t V, int64_t r,
                    float *logits, float *zs, int64_t *toks) {
    for (int64_t b = 0; b < B; ++b) if (anchor[b] < 0 || anchor[b] >= V) return -2;
    for (int64_t b = 0; b < B; ++b) {
        int64_t prev = anchor[b];
        for (int64_t i = 0; i < n; ++i)
            toks[i * B + b] = prev = markov_step(pe + prev * r, zin + (b * n + i) * r,
                                                 base + (b * n + i) * V, proj_t, r, V,
                                                 zs + (i * B + b) * r,
                                                 logits + (i * B + b) * V);
    }
    return 0;
}

/* A DFlash-family drafter's context K/V (arXiv 2602.06036, Sec. 3.1) of n committed
   tokens of one request, written to its cache slot: the target's hidden states aux
   [n, A] (A = the aux layers' widths side by side) are fused, c = RMSNorm(aux @ fc)
   (fc packed [H / 64][A][64], hn_w [H]), and every draft layer l writes
   k = rope(RMSNorm_head(c @ Wk_l)), v = c @ Wv_l at positions start..start + n - 1 of
   slot `slot` (Wk|Wv: the k|v columns of the layer's packed q|k|v weight). cs, sn [n, D]:
   the positions' rotary rows (signed sin). Returns 0; -1 out of memory; -2 slot or
   positions out of range (nothing written). */
int context_kv_f32(const layer_w *ws, int64_t nl, const float *aux, int64_t n, int64_t A,
                   const uint16_t *fc, const float *hn_w, float eps, const float *cs,
                   const float *sn, int64_t slot, int64_t start, int64_t S, int64_t L,
                   int64_t H, int64_t h, int64_t kvh, int64_t D, float qk_eps) {
    if (slot < 0 || slot >= S || start < 0 || start + n > L) return -2;
    const int64_t row = kvh * D, half = D / 2;
    float *buf = (float *)malloc(sizeof(float) * (2 * n * H + 2 * n * row + D));
    if (!buf) return -1;
    float *c = buf, *a = c + n * H, *kv = a + n * H, *tmp = kv + 2 * n * row;
    linear_bf16_f32(aux, A, fc, c, n, A, H);
    rms_rows(c, hn_w, a, n, H, eps);
    for (int64_t l = 0; l < nl; ++l) {
        const layer_w *w = ws + l;
        /* the k|v columns start at column h * D: packed block h * D / 64 of H rows */
        linear_bf16_f32(a, H, w->qkv + h * D * H, kv, n, H, 2 * row);
        for (int64_t t = 0; t < n; ++t) {
            float *r = kv + t * 2 * row;
            const float *cc = cs + t * D, *ss = sn + t * D;
            for (int64_t hd = 0; hd < kvh; ++hd) {
                float *p = r + hd * D;
                if (w->qk_w) rms_rows(p, w->qk_w + (h + hd) * D, p, 1, D, qk_eps);
                for (int64_t i = 0; i < D; ++i)
                    tmp[i] = p[i] * cc[i] + p[i < half ? i + half : i - half] * ss[i];
                memcpy(p, tmp, sizeof(float) * D);
            }
            memcpy(w->ck + (slot * L + start + t) * row, r, sizeof(float) * row);
            memcpy(w->cv + (slot * L + start + t) * row, r + row, sizeof(float) * row);
        }
    }
    free(buf);
    return 0;
}

/* the K largest of x[0..n-1], descending (ties to the lower index, as the first maximum):
   indices idx [K], values val [K] (K <= n); one pass with a sorted buffer, an element
   below the current K-th costs one compare */
static void topk_row(const float *x, int64_t n, int64_t K, int64_t *idx, float *val) {
    int64_t m = 0;
    for (int64_t v = 0; v < n; ++v) {
        const float xv = x[v];
        if (m == K && !(xv > val[K - 1])) continue;
        int64_t j = m < K ? m++ : K - 1;
        while (j > 0 && xv > val[j - 1]) { val[j] = val[j - 1]; idx[j] = idx[j - 1]; --j; }
        val[j] = xv;
        idx[j] = v;
    }
}

/* The block drafters' decoding heads a ``block_draft_f32`` call may run after the LM head
   (NULL: none, the caller decodes): DFlash 2's path selector (sel_wq [r, H] the query
   projection, sel_table [V, 3r] the cand | right | left table, sel_scale; needs K > 0)
   or DSpark's Markov head (mk_pe [V, r] the previous-token table, mk_hid_w [r, H] or NULL
   and mk_hid_b [r] the hidden-state term, mk_proj_t [r, V] (W_lm U)^T; the logits become
   the corrected ones and mk_z [B, n, r] gets the features). tokens [B, n]: the path. */
typedef struct {
    const float *sel_wq, *sel_table;
    float sel_scale;
    int64_t sel_r;
    const float *mk_pe, *mk_hid_w, *mk_hid_b, *mk_proj_t;
    int64_t mk_r;
    float *mk_z;
    int64_t *tokens;
} draft_heads;

int selector_walk_f32(const float *hd, const float *logv, const int64_t *cand,
                      const int64_t *anchor, const float *table, const float *wq, float scale,
                      int64_t B, int64_t n, int64_t K, int64_t H, int64_t r, int64_t V,
                      int64_t *out);

/* DSpark's Markov head over the block's n draft positions of B rows, in place on logits
   [B, n, V] (base -> corrected): zin = h W_hid^T + b, then the walk of ``markov_walk_f32``
   (z [B, n, r] written to zs in row-major order). Returns 0; -1 out of memory. */
static int markov_rows(const float *hid, float *logits, const int64_t *anchor, int64_t B,
                       int64_t n, int64_t H, int64_t V, const draft_heads *hd,
                       int64_t *toks) {
    const int64_t r = hd->mk_r;
    float *zin = (float *)malloc(sizeof(float) * B * n * r);
    if (!zin) return -1;
    for (int64_t t = 0; t < B * n; ++t) {
        const float *x = hid + t * H;
        for (int64_t j = 0; j < r; ++j) {
            float acc = hd->mk_hid_b ? hd->mk_hid_b[j] : 0.f;
            if (hd->mk_hid_w) {
                const float *w = hd->mk_hid_w + j * H;
                for (int64_t k = 0; k < H; ++k) acc += w[k] * x[k];
            }
            zin[t * r + j] = acc;
        }
    }
    for (int64_t b = 0; b < B; ++b) {
        int64_t prev = anchor[b];
        for (int64_t i = 0; i < n; ++i) {
            const int64_t t = b * n + i;
            toks[t] = prev = markov_step(hd->mk_pe + prev * r, zin + t * r, logits + t * V,
                                         hd->mk_proj_t, r, V, hd->mk_z + t * r, logits + t * V);
        }
    }
    free(zin);
    return 0;
}

/* A DFlash-family drafter's whole block forward in one call (DFlash, arXiv 2602.06036,
   Sec. 3.1-3.3): row b's block [anchor[b], mask x (bs - 1)] (embedding rows of emb [V, H],
   mask_emb [H]) at positions apos[b] .. apos[b] + bs - 1 of slot aslot[b] goes through the
   drafter's layers (every block token reads 0 .. apos[b] + bs - 1: its context and the
   whole block, ``decoder_stack_f32``'s span), then the final RMSNorm (norm_w, norm_eps)
   of the bs - 1 draft positions -> hid [B, bs - 1, H], the shared LM head (lm packed
   [V / 64][H][64]) -> logits [B, bs - 1, V], their first maxima top1 [B, bs - 1] and,
   when K > 0, their K largest, descending: topk_i, topk_v [B, bs - 1, K]. cos_t, sin_t
   [P, D]: the drafter's rotary table (signed sin). Returns 0; -1 out of memory; -2 an
   anchor, slot or position out of range (nothing computed). */
int block_draft_f32(const layer_w *ws, int64_t nl, const float *emb, const float *mask_emb,
                    const int64_t *anchor, const int64_t *apos, const int64_t *aslot,
                    int64_t B, int64_t bs, const float *cos_t, const float *sin_t, int64_t P,
                    const float *norm_w, float norm_eps, const uint16_t *lm, int64_t V,
                    float *hid, float *logits, int64_t *top1, int64_t K, int64_t *topk_i,
                    float *topk_v, int64_t S, int64_t L, int64_t H, int64_t I, int64_t h,
                    int64_t kvh, int64_t D, float eps, float qk_eps, float scale,
                    const draft_heads *heads) {
    if (bs < 2 || K < 0 || K > V) return -2;
    if (heads && heads->sel_wq && K < 1) return -2;
    for (int64_t b = 0; b < B; ++b)
        if (anchor[b] < 0 || anchor[b] >= V || apos[b] < 0 || apos[b] + bs > P
            || apos[b] + bs > L || aslot[b] < 0 || aslot[b] >= S) return -2;
    const int64_t T = B * bs, n = bs - 1;
    float *buf = (float *)malloc(sizeof(float) * (T * H + 2 * T * D));
    int64_t *ib = (int64_t *)malloc(sizeof(int64_t) * 4 * T);
    if (!buf || !ib) { free(buf); free(ib); return -1; }
    float *x = buf, *cs = x + T * H, *sn = cs + T * D;
    int64_t *sl = ib, *ps = sl + T, *sp = ps + T, *kp = sp + T;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < bs; ++i) {
            const int64_t t = b * bs + i, p = apos[b] + i;
            memcpy(x + t * H, i ? mask_emb : emb + anchor[b] * H, sizeof(float) * H);
            memcpy(cs + t * D, cos_t + p * D, sizeof(float) * D);
            memcpy(sn + t * D, sin_t + p * D, sizeof(float) * D);
            sl[t] = aslot[b];
            ps[t] = p;
            sp[t] = apos[b] + bs - 1;
            if (i) kp[b * n + i - 1] = t;    /* the draft positions: the anchor's output
                                                is not needed past its K/V */
        }
    int rc = stack_rows(ws, nl, x, T, cs, sn, sl, ps, S, L, H, I, h, kvh, D, eps, qk_eps,
                        scale, NULL, 0, 0, sp, kp, B * n);
    if (!rc) {
        rms_rows(x, norm_w, hid, B * n, H, norm_eps);
        linear_bf16_f32(hid, H, lm, logits, B * n, H, V);
        for (int64_t r = 0; r < B * n; ++r) {
            top1[r] = argmax_row(logits + r * V, V);
            if (K) topk_row(logits + r * V, V, K, topk_i + r * K, topk_v + r * K);
        }
        if (heads && heads->sel_wq)
            rc = selector_walk_f32(hid, topk_v, topk_i, anchor, heads->sel_table,
                                   heads->sel_wq, heads->sel_scale, B, n, K, H,
                                   heads->sel_r, V, heads->tokens);
        else if (heads && heads->mk_pe)
            rc = markov_rows(hid, logits, anchor, B, n, H, V, heads, heads->tokens);
    }
    free(buf);
    free(ib);
    return rc;
}

/* A draft model's whole proposal for B greedy rows in one call (speculative decoding,
   Leviathan et al. 2023, Sec. 2): its catch-up, the T = sum of the rows' pending tokens
   ftok [T] (slots fslot [T], positions fpos [T], rows laid end to end; last [B] the flat
   index of each row's last pending token) through the stack, each row's first draft the
   argmax of its last token's logits, then n - 1 greedy steps (``greedy_steps_f32``).
   out [n, B]. Returns 0; -1 out of memory; -2 a token, slot or position out of range. */
int greedy_draft_f32(const layer_w *ws, int64_t nl, const float *emb, const float *norm_w,
                     float norm_eps, const uint16_t *lm, int64_t V, const float *cos_t,
                     const float *sin_t, int64_t P, const int64_t *ftok, const int64_t *fslot,
                     const int64_t *fpos, int64_t T, const int64_t *last, int64_t B,
                     int64_t n, int64_t *out, int64_t S, int64_t L, int64_t H, int64_t I,
                     int64_t h, int64_t kvh, int64_t D, float eps, float qk_eps, float scale) {
    if (n < 1) return -2;
    for (int64_t t = 0; t < T; ++t)
        if (ftok[t] < 0 || ftok[t] >= V || fpos[t] < 0 || fpos[t] >= P) return -2;
    for (int64_t b = 0; b < B; ++b)
        if (last[b] < b || last[b] >= T || (b && last[b] <= last[b - 1])) return -2;
    float *buf = (float *)malloc(sizeof(float) * (T * H + 2 * T * D + B * H + B * V));
    int64_t *ib = (int64_t *)malloc(sizeof(int64_t) * 3 * B);
    if (!buf || !ib) { free(buf); free(ib); return -1; }
    float *x = buf, *cs = x + T * H, *sn = cs + T * D, *a = sn + T * D, *lg = a + B * H;
    int64_t *tok = ib, *pos = tok + B, *slot = pos + B;
    for (int64_t t = 0; t < T; ++t) {
        memcpy(x + t * H, emb + ftok[t] * H, sizeof(float) * H);
        memcpy(cs + t * D, cos_t + fpos[t] * D, sizeof(float) * D);
        memcpy(sn + t * D, sin_t + fpos[t] * D, sizeof(float) * D);
    }
    int rc = stack_rows(ws, nl, x, T, cs, sn, fslot, fpos, S, L, H, I, h, kvh, D, eps,
                        qk_eps, scale, NULL, 0, 0, NULL, last, B);
    if (!rc) {
        rms_rows(x, norm_w, a, B, H, norm_eps);
        linear_bf16_f32(a, H, lm, lg, B, H, V);
        for (int64_t b = 0; b < B; ++b) {
            out[b] = tok[b] = argmax_row(lg + b * V, V);
            pos[b] = fpos[last[b]] + 1;
            slot[b] = fslot[last[b]];
        }
        if (n > 1)
            rc = greedy_steps_f32(ws, nl, emb, norm_w, norm_eps, lm, V, cos_t, sin_t, P, tok,
                                  slot, pos, B, n - 1, out + B, S, L, H, I, h, kvh, D, eps,
                                  qk_eps, scale);
    }
    free(buf);
    free(ib);
    return rc;
}

/* DFlash 2's path selector walk ("Keep Drafting Parallel"; ``actors.drafters.heads.
   PathSelector.walk``): score(i, c | prev) = a * logp_i(c) + <Wq h_i, Wc e_c>
   + <Wl e_prev, Wr e_c> over the K candidates cand [B, n, K] of each position (their
   log-probs up to a per-position constant: logv [B, n, K], the top-k logits), greedy from
   the anchor [B]: the first maximum at each step (numpy's argmax). hd [B, n, H] the
   positions' hidden states, wq [r, H] (Wq), table [V, 3r] the cand | right | left
   projections of every token's embedding (``BlockDrafter.vocab_table``), a = scale.
   out [B, n]: the chosen tokens. Returns 0; -1 out of memory; -2 a token out of range. */
int selector_walk_f32(const float *hd, const float *logv, const int64_t *cand,
                      const int64_t *anchor, const float *table, const float *wq, float scale,
                      int64_t B, int64_t n, int64_t K, int64_t H, int64_t r, int64_t V,
                      int64_t *out) {
    for (int64_t b = 0; b < B; ++b) if (anchor[b] < 0 || anchor[b] >= V) return -2;
    for (int64_t i = 0; i < B * n * K; ++i) if (cand[i] < 0 || cand[i] >= V) return -2;
    float *q = (float *)malloc(sizeof(float) * (r + K));
    if (!q) return -1;
    float *u = q + r;
    const int64_t w3 = 3 * r;
    for (int64_t b = 0; b < B; ++b) {
        const float *left = table + anchor[b] * w3 + 2 * r;     /* Wl e_prev */
        for (int64_t i = 0; i < n; ++i) {
            const float *h = hd + (b * n + i) * H;
            for (int64_t j = 0; j < r; ++j) {
                const float *wr = wq + j * H;
                float acc = 0.f;
                for (int64_t k = 0; k < H; ++k) acc += wr[k] * h[k];
                q[j] = acc;
            }
            const int64_t *cs = cand + (b * n + i) * K;
            const float *lv = logv + (b * n + i) * K;
            int64_t best = 0;
            float bv = 0.f;
            for (int64_t c = 0; c < K; ++c) {
                const float *e = table + cs[c] * w3;
                float uc = 0.f, pc = 0.f;
                for (int64_t j = 0; j < r; ++j) { uc += e[j] * q[j]; pc += left[j] * e[r + j]; }
                const float sc = scale * (lv[c] - lv[0]) + uc + pc;
                if (c == 0 || sc > bv) { bv = sc; best = c; }
            }
            out[b * n + i] = cs[best];
            left = table + cs[best] * w3 + 2 * r;
        }
    }
    free(q);
    return 0;
}
