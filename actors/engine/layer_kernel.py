"""The decoder stack of a few-token flat batch in one C call (``run_stack``).

A decode step at batch 1 on a CPU spent more time dispatching ops than computing: with
the bfloat16 weight kernel (``linear_kernel``) the tiny target's 25 matrix products of a
step took about 0.9 ms of a 3.1 ms step, the rest was some 40 PyTorch ops a layer
(norms, q/k norms, rotary, cache writes, attention, SiLU, residuals), each a few
microseconds of Python and dispatcher (measured here with cProfile, one thread). A CPU
inference engine runs a layer as one native call (llama.cpp's graph, vLLM CPU's fused
IPEX ops); this module does the same for the flat forward (``ModelRunner.run_flat``) of
at most ``max_tokens()`` tokens (16; 1024 with the AVX-512 weight kernel): every layer of
the stack, in C, in one ctypes call.

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

Built from the two kernels' sources plus this glue by ``kernel_build`` (one library, the
attention kernel's flags); ``load()`` is None where it cannot be built or
``SPECLOAD_LAYER_KERNEL=0``, and the runner keeps the op-by-op forward.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from actors.engine import attention_kernel, linear_kernel
from actors.engine.kernel_build import load_kernel, load_kernel_outcome, record

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

GLUE = r"""
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
int decoder_stack_f32(const layer_w *ws, int64_t nl, float *x, int64_t T,
                      const float *cs, const float *sn, const int64_t *slot,
                      const int64_t *pos, int64_t S, int64_t L, int64_t H, int64_t I,
                      int64_t h, int64_t kvh, int64_t D, float eps, float qk_eps,
                      float scale, float *aux, int64_t aux_mask, int64_t naux,
                      const int64_t *span) {
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
        linear_bf16_f32(att, h * D, w->o, a, T, h * D, H);
        for (int64_t i = 0; i < T * H; ++i) x[i] += a[i];
        rms_rows(x, w->w_post, a, T, H, eps);
        if (w->cm_up && dyn_conv(a, T, H, w->cm_down, w->cm_up, w->cm_b, w->conv_r,
                                 w->conv_block)) { free(buf); return -1; }
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
            const float *r = lg + b * V;
            int64_t best = 0;
            for (int64_t v = 1; v < V; ++v) if (r[v] > r[best]) best = v;
            out[step * B + b] = best;
            tok[b] = best;
            pos[b] += 1;
        }
    }
    free(buf);
    return rc;
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

/* DSpark's left-to-right Markov walk (arXiv 2607.05147, Sec. 3.2) of B rows over n block
   positions: z_i = silu(pe[prev] + zin_i), logits_i = base_i + proj z_i, prev = argmax
   logits_i (ties to the lowest id, as torch's argmax), prev = anchor at i = 0.
   base [B, n, V], zin [B, n, r], pe [V, r], proj [V, r] (W_lm U), anchor [B];
   out: logits [n, B, V], zs [n, B, r], toks [n, B] (position-major, as the torch walk's
   buffers). Returns 0; -2 an anchor outside 0..V-1. */
int markov_walk_f32(const float *base, const float *zin, const float *pe, const float *proj,
                    const int64_t *anchor, int64_t B, int64_t n, int64_t V, int64_t r,
                    float *logits, float *zs, int64_t *toks) {
    for (int64_t b = 0; b < B; ++b) if (anchor[b] < 0 || anchor[b] >= V) return -2;
    for (int64_t b = 0; b < B; ++b) {
        int64_t prev = anchor[b];
        for (int64_t i = 0; i < n; ++i) {
            float *z = zs + (i * B + b) * r;
            const float *pr = pe + prev * r, *zi = zin + (b * n + i) * r;
            for (int64_t j = 0; j < r; ++j) {
                const float v = pr[j] + zi[j];
                z[j] = v / (1.f + expf(-v));
            }
            float *row = logits + (i * B + b) * V;
            const float *br = base + (b * n + i) * V;
            /* logits_v = base_v + <z, proj_v>: 16 vocabulary rows at a time, their dot
               products reduced together (reduce16); proj streams once, in order */
            int64_t v0 = 0;
#if SPECLOAD_ATTN_SIMD
            if (r % 16 == 0 && r <= 128) {
                __m512 zv[8];
                const int nv = (int)(r / 16);
                for (int x = 0; x < nv; ++x) zv[x] = _mm512_loadu_ps(z + 16 * x);
                for (; v0 + 16 <= V; v0 += 16) {
                    __m512 acc[16];
                    for (int kk = 0; kk < 16; ++kk) {
                        const float *pr = proj + (v0 + kk) * r;
                        __m512 a = _mm512_mul_ps(zv[0], _mm512_loadu_ps(pr));
                        for (int x = 1; x < nv; ++x)
                            a = _mm512_fmadd_ps(zv[x], _mm512_loadu_ps(pr + 16 * x), a);
                        acc[kk] = a;
                    }
                    _mm512_storeu_ps(row + v0, _mm512_add_ps(_mm512_loadu_ps(br + v0),
                                                             reduce16(acc)));
                }
            }
#endif
            for (int64_t v = v0; v < V; ++v) {
                float acc = 0.f;
                for (int64_t j = 0; j < r; ++j) acc += z[j] * proj[v * r + j];
                row[v] = br[v] + acc;
            }
            toks[i * B + b] = prev = argmax_row(row, V);
        }
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
"""


class LayerW(ctypes.Structure):
    """One layer's weights and K/V cache, as the C code's ``layer_w``."""

    _fields_ = [(n, ctypes.c_void_p) for n in
                ("w_in", "w_post", "qkv_b", "qk_w", "qkv", "o", "gate_up", "down", "ck", "cv",
                 "ca_down", "ca_b", "cm_down", "cm_b", "ca_up", "cm_up")] + \
        [("conv_r", ctypes.c_int64), ("conv_block", ctypes.c_int64)]


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled stack library (both kernels' code and the glue), or None (a warning
    logged) when it cannot be built, or ``SPECLOAD_LAYER_KERNEL=0`` or
    ``SPECLOAD_LINEAR_KERNEL=0``."""
    if os.environ.get("SPECLOAD_LAYER_KERNEL", "1") == "0" or linear_kernel.load() is None:
        record("decoder_stack", status="disabled", reason="SPECLOAD_LAYER_KERNEL=0"
               if os.environ.get("SPECLOAD_LAYER_KERNEL", "1") == "0" else "no linear_bf16 kernel",
               fallback="layers run op by op")
        return None
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib = load_kernel("decoder_stack", attention_kernel.SOURCE + linear_kernel.SOURCE + GLUE,
                      attention_kernel.FLAGS, "decoder_stack_f32",
                      [P, I, P, I, P, P, P, P] + [I] * 7 + [F, F, F, P, I, I, P],
                      "layers run op by op", attention_kernel.VARIANTS)
    if lib is not None:
        lib.greedy_steps_f32.argtypes = [P, I, P, P, F, P, I, P, P, I, P, P, P, I, I, P] + \
            [I] * 7 + [F, F, F]
        lib.greedy_steps_f32.restype = ctypes.c_int
        lib.context_kv_f32.argtypes = [P, I, P, I, I, P, P, F, P, P] + [I] * 8 + [F]
        lib.context_kv_f32.restype = ctypes.c_int
        lib.markov_walk_f32.argtypes = [P] * 5 + [I] * 4 + [P] * 3
        lib.markov_walk_f32.restype = ctypes.c_int
        record("decoder_stack", **load_kernel_outcome("decoder_stack"), max_tokens=max_tokens())
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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
        self.keep = layers
        rows = [LayerW(**{k: (v if isinstance(v, int) else _ptr(v)) for k, v in ts.items()})
                for ts in layers]
        self.layers = (LayerW * len(rows))(*rows)
        self.n = len(rows)
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
    lm = getattr(model, "lm_packed", None)
    if lm is None or n < 1 or not tokens:
        return None
    emb = model.model.embed_tokens.weight
    if emb.dtype != torch.float32 or not emb.is_contiguous():
        return None
    model.rotary(torch.zeros(1, 1, dtype=torch.long), torch.float32, signed=True, max_pos=0)
    _, cos_t, _, sin_t = model.rope_table
    if not (cos_t.is_contiguous() and sin_t.is_contiguous()) or cos_t.dtype != torch.float32:
        return None
    B = len(tokens)
    tok = torch.tensor(tokens, dtype=torch.long)
    pos = torch.tensor(positions, dtype=torch.long)
    slot = torch.tensor(slots, dtype=torch.long)
    out = torch.empty((n, B), dtype=torch.long)
    H, I, h, kvh, D = stack.dims
    rc = lib.greedy_steps_f32(ctypes.addressof(stack.layers), stack.n, emb.data_ptr(),
                              model.model.norm.weight.data_ptr(), float(model.model.norm.eps),
                              lm.data_ptr(), lm.shape[0] * lm.shape[2], cos_t.data_ptr(),
                              sin_t.data_ptr(), cos_t.shape[0], tok.data_ptr(), slot.data_ptr(),
                              pos.data_ptr(), B, n, out.data_ptr(), stack.S, stack.L, H, I, h,
                              kvh, D, stack.eps, stack.qk_eps, stack.scale)
    if rc == -2:
        return None
    if rc:
        raise RuntimeError("greedy steps: out of memory for the scratch")
    return out.T.tolist()


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
    T = x.shape[0]
    H, I, h, kvh, D = stack.dims
    aux, mask = None, 0
    if aux_layers:
        if any(not 0 <= i < min(stack.n, 63) for i in aux_layers):
            raise ValueError(f"decoder stack: aux layers {aux_layers} outside 0..{stack.n - 1}")
        mask = sum(1 << i for i in set(aux_layers))
        aux = torch.empty((T, bin(mask).count("1") * H), dtype=torch.float32)
    rc = lib.decoder_stack_f32(ctypes.addressof(stack.layers), stack.n, x.data_ptr(), T,
                               cos.data_ptr(), sin_signed.data_ptr(), slot.data_ptr(),
                               pos.data_ptr(), stack.S, stack.L, H, I, h, kvh, D, stack.eps,
                               stack.qk_eps, stack.scale,
                               None if aux is None else aux.data_ptr(), mask,
                               bin(mask).count("1"), _ptr(span))
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
    H, _, h, kvh, D = stack.dims
    n, A = aux.shape
    rc = lib.context_kv_f32(ctypes.addressof(stack.layers), stack.n, aux.data_ptr(), n, A,
                            fc_packed.data_ptr(), norm_w.data_ptr(), float(eps), cos.data_ptr(),
                            sin_signed.data_ptr(), slot, start, stack.S, stack.L, H, h, kvh, D,
                            stack.qk_eps)
    if rc == -2:
        raise ValueError(f"context K/V: slot {slot} outside 0..{stack.S - 1} or positions "
                         f"{start}..{start + n - 1} outside 0..{stack.L - 1}")
    if rc:
        raise RuntimeError("context K/V: out of memory for its scratch")


def markov_walk(base: torch.Tensor, zin: torch.Tensor, pe: torch.Tensor, proj: torch.Tensor,
                anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """DSpark's Markov walk in one C call (``markov_walk_f32``; ``actors.drafters.decode.
    markov_walk``'s step-by-step form): base [B, n, V], zin [B, n, r], pe [V, r], proj
    [V, r] (W_lm U) float32 CPU tensors, anchors [B] int64. Returns (tokens [B, n], z [B, n, r],
    logits [B, n, V]), the last two transposed views of position-major buffers, or None
    where the call does not apply (no library, another dtype or device). Raises ValueError
    on an anchor outside the vocabulary."""
    lib = load()
    ts = (base, zin, pe, proj)
    if lib is None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in ts):
        return None
    base, zin, pe, proj = (t.contiguous() for t in ts)
    B, n, V = base.shape
    r = zin.shape[-1]
    anchors = anchors.to(torch.int64).contiguous()
    logits = torch.empty((n, B, V), dtype=torch.float32)
    zs = torch.empty((n, B, r), dtype=torch.float32)
    toks = torch.empty((n, B), dtype=torch.int64)
    rc = lib.markov_walk_f32(base.data_ptr(), zin.data_ptr(), pe.data_ptr(), proj.data_ptr(),
                             anchors.data_ptr(), B, n, V, r, logits.data_ptr(), zs.data_ptr(),
                             toks.data_ptr())
    if rc:
        raise ValueError(f"markov walk: an anchor outside 0..{V - 1}")
    return toks.T, zs.transpose(0, 1), logits.transpose(0, 1)
