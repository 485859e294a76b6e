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

typedef struct {
    const float *w_in, *w_post, *qkv_b, *qk_w;
    const uint16_t *qkv, *o, *gate_up, *down;
    float *ck, *cv;
} layer_w;

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
   Returns 0; -1 when scratch could not be allocated; -2 when a slot or
   position is out of range (nothing computed). */
int decoder_stack_f32(const layer_w *ws, int64_t nl, float *x, int64_t T,
                      const float *cs, const float *sn, const int64_t *slot,
                      const int64_t *pos, int64_t S, int64_t L, int64_t H, int64_t I,
                      int64_t h, int64_t kvh, int64_t D, float eps, float qk_eps,
                      float scale, float *aux, int64_t aux_mask, int64_t naux) {
    for (int64_t t = 0; t < T; ++t)
        if (slot[t] < 0 || slot[t] >= S || pos[t] < 0 || pos[t] >= L) return -2;
    const int64_t NQ = (h + 2 * kvh) * D, row = kvh * D, half = D / 2;
    float *buf = (float *)malloc(sizeof(float) * (T * H + T * NQ + T * h * D + 3 * T * I + D));
    if (!buf) return -1;
    float *a = buf, *qkv = a + T * H, *att = qkv + T * NQ, *gu = att + T * h * D;
    float *act = gu + 2 * T * I, *tmp = act + T * I;
    int64_t ja = 0;
    for (int64_t l = 0; l < nl; ++l) {
        const layer_w *w = ws + l;
        rms_rows(x, w->w_in, a, T, H, eps);
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
        int rc = flat_attention_f32(qkv, NQ, D, w->ck, w->cv, slot, pos, att, T, h, kvh, D,
                                    S, L, scale, 8);
        if (rc) { free(buf); return rc; }
        linear_bf16_f32(att, h * D, w->o, a, T, h * D, H);
        for (int64_t i = 0; i < T * H; ++i) x[i] += a[i];
        rms_rows(x, w->w_post, a, T, H, eps);
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
                               qk_eps, scale, NULL, 0, 0);
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
"""


class LayerW(ctypes.Structure):
    """One layer's weights and K/V cache, as the C code's ``layer_w``."""

    _fields_ = [(n, ctypes.c_void_p) for n in
                ("w_in", "w_post", "qkv_b", "qk_w", "qkv", "o", "gate_up", "down", "ck", "cv")]


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
                      [P, I, P, I, P, P, P, P] + [I] * 7 + [F, F, F, P, I, I],
                      "layers run op by op", attention_kernel.VARIANTS)
    if lib is not None:
        lib.greedy_steps_f32.argtypes = [P, I, P, P, F, P, I, P, P, I, P, P, P, I, I, P] + \
            [I] * 7 + [F, F, F]
        lib.greedy_steps_f32.restype = ctypes.c_int
        record("decoder_stack", **load_kernel_outcome("decoder_stack"), max_tokens=max_tokens())
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Stack:
    """A model's layers as the stack call takes them, for one KV cache: a ``LayerW`` per
    layer (pointers into tensors this object keeps alive). Build with ``Stack.of``."""

    def __init__(self, model, cache):
        cfg = model.config
        self.keep, rows = [], []
        for i, layer in enumerate(model.model.layers):
            at, mlp = layer.self_attn, layer.mlp
            qk_w = at.qk_norm_weight.contiguous() if at.qk_norm else None
            ts = dict(w_in=layer.input_layernorm.weight.detach().contiguous(),
                      w_post=layer.post_attention_layernorm.weight.detach().contiguous(),
                      qkv_b=at.qkv_bias, qk_w=qk_w, qkv=at.qkv_packed, o=at.o_packed,
                      gate_up=mlp.gate_up_packed, down=mlp.down_packed, ck=cache.k[i], cv=cache.v[i])
            self.keep.append(ts)
            rows.append(LayerW(**{k: _ptr(v) for k, v in ts.items()}))
        self.layers = (LayerW * len(rows))(*rows)
        self.n = len(rows)
        self.S, self.L = cache.k[0].shape[0], cache.k[0].shape[1]
        self.dims = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                     cfg.num_key_value_heads, cfg.head_dim)
        self.eps = float(model.model.layers[0].input_layernorm.eps)
        a0 = model.model.layers[0].self_attn
        self.qk_eps = float(a0.q_norm.eps) if a0.qk_norm else 0.0
        self.scale = cfg.head_dim ** -0.5

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
              slot: torch.Tensor, pos: torch.Tensor, aux_layers: tuple[int, ...] = ()
              ) -> torch.Tensor | None:
    """Every layer of ``stack`` over a flat batch, in place: x [T, H] float32 contiguous
    (the embeddings; the last layer's output on return), cos, sin_signed [T, D] float32
    contiguous (``CausalLM.rotary``'s table rows, signed sin), slot, pos [T] int64
    contiguous: each token's K/V go to slot[t], position pos[t], and it attends positions
    0..pos[t] of that slot. Returns the outputs of ``aux_layers`` (layer indices) side by
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
                               bin(mask).count("1"))
    if rc == -2:
        raise ValueError(f"decoder stack: a slot outside 0..{stack.S - 1} or a position "
                         f"outside 0..{stack.L - 1}")
    if rc:
        raise RuntimeError("decoder stack: out of memory for its scratch")
    return aux
