/* specload's C kernels as typed torch operators (design: actors/engine/kernel_build.py).

   The kernels stay plain C (decoder_stack.c and the two it includes, flat_attention.c and
   linear_bf16.c; this file compiles them as C++, which they are written to allow). Each
   entry point gets an operator here with a schema of named, typed arguments
   (``TORCH_LIBRARY``): every tensor is checked for dtype, device, layout and size before
   a pointer is taken, and a bad one raises ValueError naming the argument (no call runs).
   Built by ``torch.utils.cpp_extension`` (``kernel_build.load_ops``) into the namespace
   SPECLOAD_NS (one per build: specload_k<hash of source, compiler, flags and CPU>).

   A model's layers go in as ``Tensor?[] layers`` (LAYER_FIELDS tensors a layer, in the
   order of ``layer_w``'s fields, None for an absent optional one) with ``int[] conv`` (per
   layer conv_r, conv_block) and ``int[] dims`` (H, I, h, kvh, D): the layer table is made
   and checked per call (a few ns a tensor). */
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "decoder_stack.c"

#ifndef SPECLOAD_NS
#define SPECLOAD_NS specload_kernels
#endif

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using TensorList = c10::List<OptTensor>;

constexpr int64_t LAYER_FIELDS = 16;

/* t must be a contiguous CPU tensor of dtype st with at least `numel` elements (-1: any) */
void need(const Tensor &t, at::ScalarType st, const char *what, int64_t numel = -1) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == st && t.is_contiguous(),
                      what, ": wants a contiguous ", c10::toString(st), " CPU tensor, got ",
                      t.scalar_type(), " ", t.sizes(), " on ", t.device(),
                      t.is_contiguous() ? "" : " (not contiguous)");
    TORCH_CHECK_VALUE(numel < 0 || t.numel() >= numel, what, ": wants ", numel,
                      " elements, got ", t.sizes());
}

template <typename T> T *ptr(const Tensor &t) { return static_cast<T *>(t.data_ptr()); }

float *f32(const Tensor &t, const char *what, int64_t numel = -1) {
    need(t, at::kFloat, what, numel);
    return ptr<float>(t);
}
int64_t *i64(const Tensor &t, const char *what, int64_t numel = -1) {
    need(t, at::kLong, what, numel);
    return ptr<int64_t>(t);
}
uint16_t *bf16(const Tensor &t, const char *what, int64_t numel = -1) {
    need(t, at::kBFloat16, what, numel);
    return ptr<uint16_t>(t);
}
float *f32opt(const OptTensor &t, const char *what, int64_t numel = -1) {
    return t.has_value() ? f32(*t, what, numel) : nullptr;
}
int64_t *i64opt(const OptTensor &t, const char *what, int64_t numel = -1) {
    return t.has_value() ? i64(*t, what, numel) : nullptr;
}

struct Dims {
    int64_t H, I, h, kvh, D, S, L;
};

/* The layer table of one stack (layer_w per layer) from its tensors, each checked against
   the dims: w_in, w_post [H]; qkv_b [(h + 2 kvh) D] or None; qk_w [(h + kvh) D] or None;
   qkv, o, gate_up, down packed bfloat16 (linear_kernel.pack of [H, (h + 2 kvh) D],
   [h D, H], [H, 2 I], [I, H]); ck, cv [S, L, kvh, D] float32; DFlash 2's convolutions
   (ca_ / cm_: down [H, r], b [2 H], up packed [2 H / 64, r, 64]) or None. */
std::vector<layer_w> layer_table(const TensorList &ts, at::IntArrayRef conv,
                                 at::IntArrayRef dims, Dims &d) {
    TORCH_CHECK_VALUE(dims.size() == 5, "dims: wants (H, I, h, kvh, D), got ", dims);
    const int64_t nl = (int64_t)ts.size() / LAYER_FIELDS;
    TORCH_CHECK_VALUE(nl > 0 && (int64_t)ts.size() == nl * LAYER_FIELDS,
                      "layers: wants ", LAYER_FIELDS, " tensors a layer, got ", ts.size());
    TORCH_CHECK_VALUE((int64_t)conv.size() == 2 * nl, "conv: wants 2 values a layer, got ",
                      conv.size(), " for ", nl, " layers");
    d = Dims{dims[0], dims[1], dims[2], dims[3], dims[4], 0, 0};
    std::vector<layer_w> ws((size_t)nl);
    const int64_t NQ = (d.h + 2 * d.kvh) * d.D;
    for (int64_t l = 0; l < nl; ++l) {
        auto at = [&](int64_t f) -> OptTensor { return ts.get((size_t)(l * LAYER_FIELDS + f)); };
        auto req = [&](int64_t f, const char *what) -> Tensor {
            OptTensor t = at(f);
            TORCH_CHECK_VALUE(t.has_value(), "layers[", l, "].", what, ": missing");
            return *t;
        };
        layer_w &w = ws[(size_t)l];
        w.w_in = f32(req(0, "w_in"), "w_in", d.H);
        w.w_post = f32(req(1, "w_post"), "w_post", d.H);
        w.qkv_b = f32opt(at(2), "qkv_b", NQ);
        w.qk_w = f32opt(at(3), "qk_w", (d.h + d.kvh) * d.D);
        w.qkv = bf16(req(4, "qkv"), "qkv", d.H * NQ);
        w.o = bf16(req(5, "o"), "o", d.h * d.D * d.H);
        w.gate_up = bf16(req(6, "gate_up"), "gate_up", 2 * d.I * d.H);
        w.down = bf16(req(7, "down"), "down", d.I * d.H);
        Tensor ck = req(8, "ck"), cv = req(9, "cv");
        w.ck = f32(ck, "ck");
        w.cv = f32(cv, "cv");
        TORCH_CHECK_VALUE(ck.dim() == 4 && ck.size(2) == d.kvh && ck.size(3) == d.D &&
                          cv.sizes() == ck.sizes(), "layers[", l, "]: caches ", ck.sizes(),
                          " and ", cv.sizes(), " for kvh ", d.kvh, ", D ", d.D);
        if (l == 0) {
            d.S = ck.size(0);
            d.L = ck.size(1);
        }
        TORCH_CHECK_VALUE(ck.size(0) == d.S && ck.size(1) == d.L, "layers[", l,
                          "]: caches ", ck.sizes(), " unlike layer 0's");
        w.conv_r = conv[(size_t)(2 * l)];
        w.conv_block = conv[(size_t)(2 * l + 1)];
        const int64_t r = w.conv_r;
        w.ca_down = f32opt(at(10), "ca_down", d.H * r);
        w.ca_b = f32opt(at(11), "ca_b", 2 * d.H);
        w.cm_down = f32opt(at(12), "cm_down", d.H * r);
        w.cm_b = f32opt(at(13), "cm_b", 2 * d.H);
        OptTensor ca_up = at(14), cm_up = at(15);
        w.ca_up = ca_up.has_value() ? bf16(*ca_up, "ca_up", 2 * d.H * r) : nullptr;
        w.cm_up = cm_up.has_value() ? bf16(*cm_up, "cm_up", 2 * d.H * r) : nullptr;
    }
    return ws;
}

/* D^-0.5 as the Python side computes it (``D ** -0.5`` in double, then float) */
float scale_of(const Dims &d) { return (float)std::pow((double)d.D, -0.5); }

int64_t linear_bf16(const Tensor &x, const Tensor &packed, Tensor &y) {
    TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                      (x.size(0) <= 1 || x.stride(1) == 1), "x: wants a float32 CPU [M, K] "
                      "with contiguous columns, got ", x.scalar_type(), " ", x.sizes());
    TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == 64,
                      "packed: wants [N / 64, K = ", x.size(1), ", 64], got ", packed.sizes());
    const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 64;
    const uint16_t *w = bf16(packed, "packed");
    float *out = f32(y, "y", M * N);
    return linear_bf16_f32(ptr<float>(x), x.stride(0), w, out, M, K, N);
}

int64_t flat_attention(const Tensor &q, const Tensor &ck, const Tensor &cv, const Tensor &slot,
                       const Tensor &pos, Tensor &out, double scale, int64_t tile) {
    TORCH_CHECK_VALUE(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu() &&
                      q.stride(2) == 1, "q: wants a float32 CPU [T, h, D] with contiguous "
                      "heads, got ", q.scalar_type(), " ", q.sizes());
    const int64_t T = q.size(0), h = q.size(1), D = q.size(2);
    TORCH_CHECK_VALUE(ck.dim() == 4 && ck.size(3) == D && cv.sizes() == ck.sizes() &&
                      h % ck.size(2) == 0, "ck, cv: wants [S, L, kvh, D = ", D, "], kvh a "
                      "divisor of h = ", h, ", got ", ck.sizes(), " and ", cv.sizes());
    const float *k = f32(ck, "ck"), *v = f32(cv, "cv");
    const int64_t *sl = i64(slot, "slot", T), *ps = i64(pos, "pos", T);
    return flat_attention_f32(ptr<float>(q), q.stride(0), q.stride(1), k, v, sl, ps,
                              f32(out, "out", T * h * D), T, h, ck.size(2), D, ck.size(0),
                              ck.size(1), (float)scale, tile);
}

int64_t decoder_stack(const TensorList &layers, at::IntArrayRef conv, at::IntArrayRef dims,
                      Tensor &x, const Tensor &cos, const Tensor &sin, const Tensor &slot,
                      const Tensor &pos, double eps, double qk_eps,
                      const OptTensor &aux, int64_t aux_mask, int64_t naux,
                      const OptTensor &span) {
    Dims d;
    auto ws = layer_table(layers, conv, dims, d);
    const int64_t T = x.dim() == 2 ? x.size(0) : -1;
    TORCH_CHECK_VALUE(T >= 0 && x.size(1) == d.H, "x: wants [T, H = ", d.H, "], got ",
                      x.sizes());
    return decoder_stack_f32(ws.data(), (int64_t)ws.size(), f32(x, "x"), T,
                             f32(cos, "cos", T * d.D), f32(sin, "sin", T * d.D),
                             i64(slot, "slot", T), i64(pos, "pos", T), d.S, d.L, d.H, d.I, d.h,
                             d.kvh, d.D, (float)eps, (float)qk_eps, scale_of(d),
                             f32opt(aux, "aux", T * naux * d.H), aux_mask, naux,
                             i64opt(span, "span", T));
}

/* the target-side tables of a greedy call: embedding [V, H], final norm [H], packed LM head
   [V / 64, H, 64], rotary tables [P, D] */
struct Greedy {
    const float *emb, *norm_w, *cos_t, *sin_t;
    const uint16_t *lm;
    int64_t V, P;
};

Greedy greedy_tables(const Dims &d, const Tensor &emb, const Tensor &norm_w, const Tensor &lm,
                     const Tensor &cos_t, const Tensor &sin_t) {
    TORCH_CHECK_VALUE(lm.dim() == 3 && lm.size(1) == d.H && lm.size(2) == 64,
                      "lm: wants [V / 64, H = ", d.H, ", 64], got ", lm.sizes());
    TORCH_CHECK_VALUE(cos_t.dim() == 2 && cos_t.size(1) == d.D && sin_t.sizes() == cos_t.sizes(),
                      "cos_t, sin_t: wants [P, D = ", d.D, "], got ", cos_t.sizes(), " and ",
                      sin_t.sizes());
    const int64_t V = lm.size(0) * 64;
    return Greedy{f32(emb, "emb", V * d.H), f32(norm_w, "norm_w", d.H), f32(cos_t, "cos_t"),
                  f32(sin_t, "sin_t"), bf16(lm, "lm"), V, cos_t.size(0)};
}

int64_t greedy_steps(const TensorList &layers, at::IntArrayRef conv, at::IntArrayRef dims,
                     const Tensor &emb, const Tensor &norm_w, double norm_eps, const Tensor &lm,
                     const Tensor &cos_t, const Tensor &sin_t, Tensor &tok, const Tensor &slot,
                     Tensor &pos, Tensor &out, double eps, double qk_eps) {
    Dims d;
    auto ws = layer_table(layers, conv, dims, d);
    Greedy g = greedy_tables(d, emb, norm_w, lm, cos_t, sin_t);
    const int64_t B = tok.numel();
    TORCH_CHECK_VALUE(out.dim() == 2 && out.size(1) == B, "out: wants [n, B = ", B, "], got ",
                      out.sizes());
    return greedy_steps_f32(ws.data(), (int64_t)ws.size(), g.emb, g.norm_w, (float)norm_eps,
                            g.lm, g.V, g.cos_t, g.sin_t, g.P, i64(tok, "tok"),
                            i64(slot, "slot", B), i64(pos, "pos", B), B, out.size(0),
                            i64(out, "out"), d.S, d.L, d.H, d.I, d.h, d.kvh, d.D, (float)eps,
                            (float)qk_eps, scale_of(d));
}

int64_t greedy_draft(const TensorList &layers, at::IntArrayRef conv, at::IntArrayRef dims,
                     const Tensor &emb, const Tensor &norm_w, double norm_eps, const Tensor &lm,
                     const Tensor &cos_t, const Tensor &sin_t, const Tensor &ftok,
                     const Tensor &fslot, const Tensor &fpos, const Tensor &last, Tensor &out,
                     double eps, double qk_eps) {
    Dims d;
    auto ws = layer_table(layers, conv, dims, d);
    Greedy g = greedy_tables(d, emb, norm_w, lm, cos_t, sin_t);
    const int64_t T = ftok.numel(), B = last.numel();
    TORCH_CHECK_VALUE(out.dim() == 2 && out.size(1) == B, "out: wants [n, B = ", B, "], got ",
                      out.sizes());
    return greedy_draft_f32(ws.data(), (int64_t)ws.size(), g.emb, g.norm_w, (float)norm_eps,
                            g.lm, g.V, g.cos_t, g.sin_t, g.P, i64(ftok, "ftok"),
                            i64(fslot, "fslot", T), i64(fpos, "fpos", T), T, i64(last, "last"),
                            B, out.size(0), i64(out, "out"), d.S, d.L, d.H, d.I, d.h, d.kvh,
                            d.D, (float)eps, (float)qk_eps, scale_of(d));
}

int64_t context_kv(const TensorList &layers, at::IntArrayRef conv, at::IntArrayRef dims,
                   const Tensor &aux, const Tensor &fc, const Tensor &hn_w, double eps,
                   const Tensor &cos, const Tensor &sin, int64_t slot, int64_t start,
                   double qk_eps) {
    Dims d;
    auto ws = layer_table(layers, conv, dims, d);
    TORCH_CHECK_VALUE(aux.dim() == 2, "aux: wants [n, A], got ", aux.sizes());
    const int64_t n = aux.size(0), A = aux.size(1);
    TORCH_CHECK_VALUE(fc.dim() == 3 && fc.size(1) == A && fc.size(0) * 64 == d.H,
                      "fc: wants [H / 64 = ", d.H / 64, ", A = ", A, ", 64], got ", fc.sizes());
    return context_kv_f32(ws.data(), (int64_t)ws.size(), f32(aux, "aux"), n, A, bf16(fc, "fc"),
                          f32(hn_w, "hn_w", d.H), (float)eps, f32(cos, "cos", n * d.D),
                          f32(sin, "sin", n * d.D), slot, start, d.S, d.L, d.H, d.h, d.kvh,
                          d.D, (float)qk_eps);
}

int64_t markov_walk(const Tensor &base, const Tensor &zin, const Tensor &pe, const Tensor &proj_t,
                    const Tensor &anchors, Tensor &logits, Tensor &zs, Tensor &toks) {
    TORCH_CHECK_VALUE(base.dim() == 3 && zin.dim() == 3 && zin.size(0) == base.size(0) &&
                      zin.size(1) == base.size(1), "base, zin: wants [B, n, V] and [B, n, r], "
                      "got ", base.sizes(), " and ", zin.sizes());
    const int64_t B = base.size(0), n = base.size(1), V = base.size(2), r = zin.size(2);
    return markov_walk_f32(f32(base, "base"), f32(zin, "zin"), f32(pe, "pe", V * r),
                           f32(proj_t, "proj_t", r * V), i64(anchors, "anchors", B), B, n, V, r,
                           f32(logits, "logits", B * n * V), f32(zs, "zs", B * n * r),
                           i64(toks, "toks", B * n));
}

int64_t selector_walk(const Tensor &hd, const Tensor &logv, const Tensor &cand,
                      const Tensor &anchors, const Tensor &table, const Tensor &wq, double scale,
                      Tensor &out) {
    TORCH_CHECK_VALUE(cand.dim() == 3 && hd.dim() == 3 && hd.size(0) == cand.size(0) &&
                      hd.size(1) == cand.size(1) && logv.sizes() == cand.sizes(),
                      "hd, logv, cand: wants [B, n, H], [B, n, K], [B, n, K], got ", hd.sizes(),
                      ", ", logv.sizes(), ", ", cand.sizes());
    TORCH_CHECK_VALUE(wq.dim() == 2 && wq.size(1) == hd.size(2) && table.dim() == 2 &&
                      table.size(1) == 3 * wq.size(0), "wq, table: wants [r, H] and [V, 3 r], "
                      "got ", wq.sizes(), " and ", table.sizes());
    const int64_t B = cand.size(0), n = cand.size(1), K = cand.size(2);
    return selector_walk_f32(f32(hd, "hd"), f32(logv, "logv"), i64(cand, "cand"),
                             i64(anchors, "anchors", B), f32(table, "table"), f32(wq, "wq"),
                             (float)scale, B, n, K, hd.size(2), wq.size(0), table.size(0),
                             i64(out, "out", B * n));
}

int64_t block_draft(const TensorList &layers, at::IntArrayRef conv, at::IntArrayRef dims,
                    const Tensor &emb, const Tensor &mask_emb, const Tensor &anchors,
                    const Tensor &positions, const Tensor &slots, int64_t bs,
                    const Tensor &cos_t, const Tensor &sin_t, const Tensor &norm_w,
                    double norm_eps, const Tensor &lm, Tensor &hid, Tensor &logits, Tensor &top1,
                    int64_t top_k, const OptTensor &topk_i, const OptTensor &topk_v, double eps,
                    double qk_eps, const OptTensor &sel_wq, const OptTensor &sel_table,
                    double sel_scale, const OptTensor &mk_pe, const OptTensor &mk_hid_w,
                    const OptTensor &mk_hid_b, const OptTensor &mk_proj_t, const OptTensor &mk_z,
                    const OptTensor &tokens) {
    Dims d;
    auto ws = layer_table(layers, conv, dims, d);
    Greedy g = greedy_tables(d, emb, norm_w, lm, cos_t, sin_t);
    const int64_t B = anchors.numel(), n = bs - 1, V = g.V;
    TORCH_CHECK_VALUE(bs >= 2 && top_k >= 0 && top_k <= V, "bs ", bs, " (wants >= 2), top_k ",
                      top_k, " (wants 0..", V, ")");
    TORCH_CHECK_VALUE(top_k == 0 || (topk_i.has_value() && topk_v.has_value()),
                      "topk_i, topk_v: wanted with top_k ", top_k);
    draft_heads heads{};
    const bool sel = sel_wq.has_value(), mk = mk_pe.has_value();
    TORCH_CHECK_VALUE(!(sel && mk), "one decoding head a call: the selector or the Markov head");
    if (sel || mk) {
        TORCH_CHECK_VALUE(tokens.has_value(), "tokens: wanted with a decoding head");
        heads.tokens = i64(*tokens, "tokens", B * n);
    }
    if (sel) {
        TORCH_CHECK_VALUE(top_k > 0 && sel_table.has_value(),
                          "the selector wants top_k > 0 and sel_table");
        const int64_t r = sel_wq->size(0);
        heads.sel_wq = f32(*sel_wq, "sel_wq", r * d.H);
        heads.sel_table = f32(*sel_table, "sel_table", V * 3 * r);
        heads.sel_scale = (float)sel_scale;
        heads.sel_r = r;
    }
    if (mk) {
        TORCH_CHECK_VALUE(mk_pe->dim() == 2 && mk_hid_b.has_value() && mk_proj_t.has_value() &&
                          mk_z.has_value(), "the Markov head wants mk_pe [V, r], mk_hid_b, "
                          "mk_proj_t and mk_z");
        const int64_t r = mk_pe->size(1);
        heads.mk_pe = f32(*mk_pe, "mk_pe", V * r);
        heads.mk_hid_w = f32opt(mk_hid_w, "mk_hid_w", r * d.H);
        heads.mk_hid_b = f32(*mk_hid_b, "mk_hid_b", r);
        heads.mk_proj_t = f32(*mk_proj_t, "mk_proj_t", r * V);
        heads.mk_r = r;
        heads.mk_z = f32(*mk_z, "mk_z", B * n * r);
    }
    return block_draft_f32(ws.data(), (int64_t)ws.size(), g.emb, f32(mask_emb, "mask_emb", d.H),
                           i64(anchors, "anchors"), i64(positions, "positions", B),
                           i64(slots, "slots", B), B, bs, g.cos_t, g.sin_t, g.P, g.norm_w,
                           (float)norm_eps, g.lm, V, f32(hid, "hid", B * n * d.H),
                           f32(logits, "logits", B * n * V), i64(top1, "top1", B * n), top_k,
                           top_k ? i64(*topk_i, "topk_i", B * n * top_k) : nullptr,
                           top_k ? f32(*topk_v, "topk_v", B * n * top_k) : nullptr, d.S, d.L,
                           d.H, d.I, d.h, d.kvh, d.D, (float)eps, (float)qk_eps, scale_of(d),
                           (sel || mk) ? &heads : nullptr);
}

void set_threads(int64_t n) {
    linear_bf16_set_threads((int)n);
    flat_attention_set_threads((int)n);
}

/* what the build has: isa (512 AVX-512, 256 AVX2 + FMA, 0 plain C), the packed layout
   (1: AVX-512's interleaved halves), the attention's AVX-512 code, OpenMP, the threads set */
std::vector<int64_t> build_info() {
#ifdef _OPENMP
    const int64_t openmp = 1;
#else
    const int64_t openmp = 0;
#endif
    return {linear_bf16_isa(), linear_bf16_layout(), flat_attention_simd(), openmp,
            linear_bf16_threads()};
}

}  // namespace

/* (a second level, so that SPECLOAD_NS is expanded before TORCH_LIBRARY pastes it) */
#define SPECLOAD_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
SPECLOAD_LIBRARY(SPECLOAD_NS, m) {
    m.def("linear_bf16(Tensor x, Tensor packed, Tensor(a!) y) -> int", &linear_bf16);
    m.def("flat_attention(Tensor q, Tensor ck, Tensor cv, Tensor slot, Tensor pos, "
          "Tensor(a!) out, float scale, int tile) -> int", &flat_attention);
    m.def("decoder_stack(Tensor?[] layers, int[] conv, int[] dims, Tensor(a!) x, Tensor cos, "
          "Tensor sin, Tensor slot, Tensor pos, float eps, float qk_eps, Tensor(b!)? aux, "
          "int aux_mask, int naux, Tensor? span) -> int", &decoder_stack);
    m.def("greedy_steps(Tensor?[] layers, int[] conv, int[] dims, Tensor emb, Tensor norm_w, "
          "float norm_eps, Tensor lm, Tensor cos_t, Tensor sin_t, Tensor(a!) tok, Tensor slot, "
          "Tensor(b!) pos, Tensor(c!) out, float eps, float qk_eps) -> int", &greedy_steps);
    m.def("greedy_draft(Tensor?[] layers, int[] conv, int[] dims, Tensor emb, Tensor norm_w, "
          "float norm_eps, Tensor lm, Tensor cos_t, Tensor sin_t, Tensor ftok, Tensor fslot, "
          "Tensor fpos, Tensor last, Tensor(a!) out, float eps, float qk_eps) -> int",
          &greedy_draft);
    m.def("context_kv(Tensor?[] layers, int[] conv, int[] dims, Tensor aux, Tensor fc, "
          "Tensor hn_w, float eps, Tensor cos, Tensor sin, int slot, int start, "
          "float qk_eps) -> int", &context_kv);
    m.def("markov_walk(Tensor base, Tensor zin, Tensor pe, Tensor proj_t, Tensor anchors, "
          "Tensor(a!) logits, Tensor(b!) zs, Tensor(c!) toks) -> int", &markov_walk);
    m.def("selector_walk(Tensor hd, Tensor logv, Tensor cand, Tensor anchors, Tensor table, "
          "Tensor wq, float scale, Tensor(a!) out) -> int", &selector_walk);
    m.def("block_draft(Tensor?[] layers, int[] conv, int[] dims, Tensor emb, Tensor mask_emb, "
          "Tensor anchors, Tensor positions, Tensor slots, int bs, Tensor cos_t, Tensor sin_t, "
          "Tensor norm_w, float norm_eps, Tensor lm, Tensor(a!) hid, Tensor(b!) logits, "
          "Tensor(c!) top1, int top_k, Tensor(d!)? topk_i, Tensor(e!)? topk_v, float eps, "
          "float qk_eps, Tensor? sel_wq, Tensor? sel_table, float sel_scale, Tensor? mk_pe, "
          "Tensor? mk_hid_w, Tensor? mk_hid_b, Tensor? mk_proj_t, Tensor(f!)? mk_z, "
          "Tensor(g!)? tokens) -> int", &block_draft);
    m.def("set_threads(int n) -> ()", &set_threads);
    m.def("build_info() -> int[]", &build_info);
}
