"""A Llama / Qwen2 / Qwen3 causal LM with a slot-based KV cache, in plain PyTorch.

The engine runs its own implementation (rather than ``transformers``) so that a
batched forward takes ragged per-request positions and writes K/V straight
into a preallocated cache (``actors.engine.kv_cache``; gpt-fast's
``setup_caches`` idea), and so that a
verification forward can return target hidden states for the DFlash family.
Weights load from a local HF directory (``config.json`` + ``*.safetensors``)
with HF parameter names; ``tests/test_model.py`` checks logits against
``transformers`` on the same weights.

Supported ``model_type``: ``llama``, ``qwen2`` (q/k/v bias), ``qwen3``
(per-head q/k RMSNorm). Rotary embedding: default (``rope_scaling`` null).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine import attention_kernel  # noqa: F401  (registers specload::flat_attention)
from actors.engine import linear_kernel
from actors.engine.kv_cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """The subset of an HF ``config.json`` the engine needs (sizes in elements)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; expected one of "
                f"{SUPPORTED_MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a parsed HF ``config.json``; raises ValueError on unsupported options."""
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type is {mt!r}; specload's engine runs {SUPPORTED_MODEL_TYPES}")
        rs = d.get("rope_scaling")
        if rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {rs} is not supported (only the default rotary)")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=d.get("rope_theta", 10000.0),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", mt == "qwen2"),
            eos_token_id=eos, bos_token_id=d.get("bos_token_id"), extra=d)

    def to_hf_dict(self) -> dict:
        d = dict(self.extra)
        d.update(
            model_type=self.model_type, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias, eos_token_id=self.eos_token_id,
            bos_token_id=self.bos_token_id, hidden_act="silu", rope_scaling=None,
            architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                            "qwen3": "Qwen3ForCausalLM"}[self.model_type]])
        return d


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written out rather than F.rms_norm: on the CPU that op decomposes into
        # more kernels than this (measured 2.4x slower per call at batch 1).
        if x.dtype == torch.float32:  # sum * (1/d) skips mean()'s extra copy on the CPU
            return rms_unweighted(x, self.eps) * self.weight
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for rotary embedding (Su et al. 2021, HF ``rotate_half`` layout).

    positions: [B, Q] int64 -> cos, sin: [B, 1, Q, head_dim].
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, Q, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def transposed(w: torch.Tensor) -> torch.Tensor:
    """An ``nn.Linear`` weight [out, in] as a contiguous [in, out] copy (``linear_t``'s layout)."""
    return w.t().contiguous()


def linear_t(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None = None,
             packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, wt.T, b)`` from a weight stored transposed: x [..., in], wt [in, out]
    contiguous, b [out] or None, packed: the same weight as ``linear_kernel.pack`` made it
    (bfloat16 values only) or None -> [..., out].

    One ``mm``/``addmm`` on a 2-D view. On a CPU, MKL's GEMM with few rows (a decode
    step's batch) runs 1.3-2.2x faster from this layout than ``F.linear`` from [out, in]
    (measured here, one thread, M = 1 and 8 rows: [8, 256] x [256, 1536] 134 -> 65 us,
    the [256, 4096] LM head 689 -> 311 us). With ``packed``, batches of at most
    ``linear_kernel.max_rows()`` rows (8; 1024 with the AVX-512 code) run on the bf16-weight
    kernel (half the bytes read; the same float32 products and sums, in another order); a
    compiled graph calls it as the
    ``specload::linear_bf16`` op, which picks kernel or ``mm`` by the rows it gets.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if packed is not None and x2.dtype == torch.float32 and torch.compiler.is_compiling():
        y = torch.ops.specload.linear_bf16(x2, wt, packed)     # rows chosen inside the op
        if b is not None:
            y = y + b
    elif packed is not None and x2.shape[0] <= linear_kernel.max_rows() and x2.dtype == torch.float32:
        y = linear_kernel.linear_packed(x2, packed)            # direct: no dispatcher cost
        if b is not None:
            y += b
    else:
        y = torch.mm(x2, wt) if b is None else torch.addmm(b, x2, wt)
    return y.view(*x.shape[:-1], wt.shape[1])


@functools.lru_cache(maxsize=64)
def _norm_scalars(d: int, eps: float, dtype: torch.dtype, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """1/d and eps as 0-dim tensors of ``dtype`` (what an in-place op casts a Python
    float to, so results are bit-identical); see ``rms_unweighted``. Made outside
    inference mode, so training may use them too."""
    with torch.inference_mode(False):
        return (torch.tensor(1.0 / d, dtype=dtype, device=device),
                torch.tensor(eps, dtype=dtype, device=device))


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight (fp32 inputs): the engine folds the weight into
    the next projection, so a norm costs one kernel less per call. The scale and
    eps are cached 0-dim tensors: an in-place op with a Python float wraps and
    casts it on every call (one extra ``_to_copy`` each, 15 -> 10 us per norm on
    a CPU, ~20 norms per decode step)."""
    if torch.compiler.is_compiling():   # (inductor fuses it: no per-call cast to save,
        # and no lru_cache for Dynamo to trace through with a warning)
        return x * (x.pow(2).sum(-1, keepdim=True) * (1.0 / x.shape[-1]) + eps).rsqrt()
    inv_d, eps_t = _norm_scalars(x.shape[-1], eps, x.dtype, x.device)
    ms = x.pow(2).sum(-1, keepdim=True).mul_(inv_d).add_(eps_t)
    return x * ms.rsqrt_()


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in three kernels instead of seven: ``rotate_half(x) * sin``
    equals ``roll(x, D/2) * [-sin_1, sin_2]`` (the halves swapped, the first one's
    sign folded into the table). x: [..., D]; cos, sin_signed broadcastable."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, Q, D]; cos/sin: [B, 1, Q, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


@dataclass
class BatchMeta:
    """Where a padded batch sits in the cache.

    slots: [B] int64 cache slot per row; starts: [B] int64 tokens already
    cached per row (the first new token's position); kv_len: max over rows of
    ``starts + Q`` (how much of the cache attention reads).
    """

    slots: torch.Tensor
    starts: torch.Tensor
    kv_len: int
    # filled once per forward by CausalLM.forward (not by callers):
    write_rows: torch.Tensor | None = None   # [B, Q] slot of each new token
    write_pos: torch.Tensor | None = None    # [B, Q] cache position of each new token
    single: tuple[int, int] | None = None    # (slot, start) when B == 1: views, no gathers
    # set by callers that know it on the host (ModelRunner): rows use the consecutive
    # slots lo..hi-1 in order, so attention reads a view of the cache, not a gather
    slot_range: tuple[int, int] | None = None
    # packed (varlen) batch: input_ids is [1, T], every row's tokens one after the
    # other, no padding; segments[i] = (slot, start, offset in T, length). Set with
    # positions [1, T] and seg_masks (per segment: None = causal from 0 or one token,
    # else a bool [1, 1, length, start + length] mask); write_rows / write_pos are [T].
    # padded batch: rows whose context is far longer than the others' (row index, slot,
    # context length) attend alone; the others read only kv_short positions (ModelRunner)
    long_rows: list[tuple[int, int, int]] | None = None
    kv_short: int | None = None
    segments: list[tuple[int, int, int, int]] | None = None
    positions: torch.Tensor | None = None
    seg_masks: list | None = None
    # flat batch (``ModelRunner.run_flat``, the compiled forward): input_ids [1, T], every
    # row's tokens one after the other; positions [1, T]; write_rows / write_pos [T] (the
    # slot and position of each token, set by the caller); kv_len = the longest context.
    # Each token attends its own slot up to its own position (``Attention._flat_attention``),
    # in groups: flat_groups = ((token indices [Tg], context read), ...), the tokens with
    # short contexts apart from the long ones; flat_back [T]: where each token's output
    # sits in the groups' outputs one after the other.
    flat: bool = False
    flat_groups: tuple | None = None
    flat_back: torch.Tensor | None = None
    # flat batch on a CPU with float32 K/V: attention by the C kernel
    # (``actors.engine.attention_kernel``, the ``specload::flat_attention`` op), which reads
    # each token's own positions only (no groups)
    flat_kernel: bool = False


class Attention(nn.Module):
    FOLD_MAX_Q = 16     # rows of this many new tokens or fewer attend GQA-folded

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.h, self.kvh, self.d = h, kvh, d
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=b)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def fuse(self, norm_weight: torch.Tensor | None = None, packed: bool = False) -> None:
        """Inference only: one GEMM for q, k and v (fewer kernel launches per step).

        norm_weight: [H] the input RMSNorm's weight, folded into the fused
        weight's columns ((x * w) @ W^T == x @ (W * w)^T), so the caller runs
        the norm without it. The q/k norms become one norm over both with a
        per-head weight [h + kvh, D]. packed: also keep bfloat16-packed copies of
        the qkv and o weights for ``linear_t``'s few-row kernel (where ``pack`` takes them).
        """
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        self._qkv_w = transposed(w if norm_weight is None else w * norm_weight[None, :])  # [H, out]
        # o_proj transposed too on a CPU (linear_t's faster layout; a GPU keeps F.linear)
        self._o_wt = transposed(self.o_proj.weight) if w.device.type == "cpu" else None
        self.qkv_packed = linear_kernel.pack(self._qkv_w) if packed else None
        self.o_packed = linear_kernel.pack(self._o_wt) if packed and self._o_wt is not None else None
        self.qkv_bias = (torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
                         if self.q_proj.bias is not None else None)
        self._fused_norm = norm_weight is not None
        if self.qk_norm:
            self.qk_norm_weight = torch.cat([self.q_norm.weight.expand(self.h, self.d),
                                             self.k_norm.weight.expand(self.kvh, self.d)])

    def forward(self, x, cos, sin, mask, cache_kv=None, meta: BatchMeta | None = None):
        """x: [B, Q, H]; mask: bool [B, 1, Q, K] (True = attend) or None for causal."""
        B, Q, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if cache_kv is not None and (meta.segments is not None or meta.flat):
            out = (self._flat_attention if meta.flat else self._packed_attention)(
                q, k, v, cache_kv, meta)
            return self._out_proj(out.transpose(1, 2).reshape(B, Q, self.h * self.d))
        full_mask = mask
        if cache_kv is not None:
            k, v, mask = self._padded_cache_kv(q, k, v, mask, cache_kv, meta)
        out = self._padded_attention(q, k, v, mask, cache_kv is not None)
        if cache_kv is not None and meta.long_rows:
            self._long_rows_attention(out, q, cache_kv, meta, full_mask)
        return self._out_proj(out.transpose(1, 2).reshape(B, Q, self.h * self.d))

    def _qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, h, Q, D], k [B, kvh, Q, D] (q/k-normed where the model has it, rotated)
        and v [B, kvh, Q, D] of x [B, Q, H]. Inference: one GEMM over the fused q|k|v
        weight, one q/k norm, rope in three kernels (cos, sin signed: ``CausalLM.rotary``'s
        table); training: the three projections."""
        B, Q, _ = x.shape
        h, kvh, d = self.h, self.kvh, self.d
        if not self.training and getattr(self, "_qkv_w", None) is not None:
            qkv = linear_t(x, self._qkv_w, self.qkv_bias, getattr(self, "qkv_packed", None))
            qkv = qkv.view(B, Q, h + 2 * kvh, d)
            qk, v = qkv[:, :, :h + kvh], qkv[:, :, h + kvh:]
            if self.qk_norm:
                qk = rms_unweighted(qk, self.q_norm.eps) * self.qk_norm_weight
            qk = apply_rope_signed(qk.transpose(1, 2), cos, sin)
        else:
            q = self.q_proj(x).view(B, Q, h, d)
            k = self.k_proj(x).view(B, Q, kvh, d)
            v = self.v_proj(x).view(B, Q, kvh, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            qk = apply_rope(torch.cat([q, k], dim=2).transpose(1, 2), cos, sin)  # one rope call
        return qk[:, :h], qk[:, h:], v.transpose(1, 2)

    def _out_proj(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of attention's [B, Q, h * D]: the fused transposed
        (or packed) weight at inference, ``o_proj`` in training."""
        o_wt = getattr(self, "_o_wt", None)
        return self.o_proj(out) if o_wt is None or self.training else linear_t(
            out, o_wt, packed=getattr(self, "o_packed", None))

    def _padded_cache_kv(self, q, k, v, mask, cache_kv, meta: BatchMeta):
        """A padded batch's cache step: write k, v [B, kvh, Q, D] at each row's positions
        and read back every row's context [B, kvh, K, D] (a slice view for one row or
        consecutive slots, else a gather), in q's dtype. K is the longest context but
        the rows that attend alone (``meta.long_rows``: up to ``meta.kv_short``), the
        mask cut to it. Returns (k, v, mask)."""
        Q = q.shape[2]
        ck, cv = cache_kv
        if meta.single is not None:  # batch 1: slice views instead of index gathers
            slot, st = meta.single
            ck[slot, st:st + Q] = k[0].transpose(0, 1)
            cv[slot, st:st + Q] = v[0].transpose(0, 1)
            k = ck[slot, :meta.kv_len].transpose(0, 1)[None]
            v = cv[slot, :meta.kv_len].transpose(0, 1)[None]
        else:
            ck[meta.write_rows, meta.write_pos] = k.transpose(1, 2).to(ck.dtype)
            cv[meta.write_rows, meta.write_pos] = v.transpose(1, 2).to(cv.dtype)
            # rows with a context far longer than the rest (meta.long_rows) attend
            # alone (``_long_rows_attention``); the batch reads only the others' longest
            kl = meta.kv_short or meta.kv_len
            if kl < meta.kv_len:
                mask = mask[..., :kl]
            if meta.slot_range is not None:  # consecutive slots: a view, no copy
                lo, hi = meta.slot_range
                k = ck[lo:hi, :kl].transpose(1, 2)
                v = cv[lo:hi, :kl].transpose(1, 2)
            else:
                k = ck[meta.slots, :kl].transpose(1, 2)
                v = cv[meta.slots, :kl].transpose(1, 2)
        if ck.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        return k, v, mask

    def _padded_attention(self, q, k, v, mask, cached: bool) -> torch.Tensor:
        """SDPA of a padded batch: q [B, h, Q, D] over k, v [B, kvh, K, D] -> [B, h, Q, D].
        mask None: causal from position 0 without a cache; with a cache it means "attend
        to everything" (one new token of one row). A cached batch of short rows folds the
        g query heads of a KV head into g x Q query rows of one head, so each K/V row is
        read once per KV head, not once per query head (0.28 -> 0.21 ms per layer at 16
        rows x 250 positions, one CPU thread); one row alone is faster unfolded."""
        B, _, Q, _ = q.shape
        g = self.h // self.kvh
        if cached and g > 1 and B > 1 and Q <= self.FOLD_MAX_Q:
            qf = q.reshape(B, self.kvh, g * Q, self.d)
            mf = mask if mask is None or Q == 1 else \
                mask[:, :, None].expand(B, 1, g, Q, mask.shape[-1]).reshape(B, 1, g * Q, -1)
            return F.scaled_dot_product_attention(qf, k, v, attn_mask=mf).view(B, self.h, Q, self.d)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and not cached,
            enable_gqa=self.h != self.kvh)

    def _long_rows_attention(self, out, q, cache_kv, meta: BatchMeta, full_mask) -> None:
        """The rows of ``meta.long_rows`` (row, slot, context) attend alone on their own
        cache view [1, kvh, n, D], with their full mask; written into out [B, h, Q, D]."""
        ck, cv = cache_kv
        Q, g = q.shape[2], self.h // self.kvh
        for b, slot, n in meta.long_rows:
            kb = ck[slot, :n].transpose(0, 1)[None].to(q.dtype)
            vb = cv[slot, :n].transpose(0, 1)[None].to(q.dtype)
            mb = full_mask[b:b + 1, :, :, :n]
            if g > 1 and Q <= self.FOLD_MAX_Q:
                mb = mb if Q == 1 else mb[:, :, None].expand(1, 1, g, Q, n).reshape(
                    1, 1, g * Q, n)
                ob = F.scaled_dot_product_attention(
                    q[b:b + 1].reshape(1, self.kvh, g * Q, self.d), kb, vb,
                    attn_mask=mb).view(1, self.h, Q, self.d)
            else:
                ob = F.scaled_dot_product_attention(q[b:b + 1], kb, vb, attn_mask=mb,
                                                    enable_gqa=self.h != self.kvh)
            out[b] = ob[0]

    def _flat_attention(self, q, k, v, cache_kv, meta: BatchMeta) -> torch.Tensor:
        """Attention of a flat batch (``BatchMeta.flat``): every token's K/V written to
        the cache, then token t attends positions ``0 .. write_pos[t]`` of its own slot
        ``write_rows[t]``, whatever row it belongs to (a decode, a verify row of any
        draft length, a short prompt chunk). q: [1, h, T, D]; k, v: [1, kvh, T, D] ->
        [1, h, T, D].

        Written as broadcast products and sums over the cache indexed by slot, which
        eager PyTorch would materialise as a [T, kv_len, kvh, D] gather: this is for
        the compiled forward (``ModelRunner.compile``), where inductor fuses the gather,
        the scores, the mask, the softmax and the weighted sum into loops that read each
        slot's K/V in place. One graph then covers every mix of row lengths (T and
        kv_len dynamic), where the padded forward needs one per row length and padding,
        and the packed one an SDPA call per row and layer (about 0.1 ms of overhead
        each on a CPU). Scores over the positions past a token's own are computed and
        masked (-inf): the cost is T x kv_len per layer, so the runner splits the tokens
        in two groups by context length (``ModelRunner.flat_groups``), each reading only
        to its own longest context. With ``meta.flat_kernel`` (a CPU, float32 K/V, the
        kernel built) the C kernel of ``actors.engine.attention_kernel`` does the
        attention instead: each token's own positions only, runs of same-slot tokens
        together (0.35 ms a layer in a 16-user ngram step, inductor's loops about 1.2)."""
        ck, cv = cache_kv
        T = q.shape[2]
        slot_t, pos_t = meta.write_rows, meta.write_pos
        ck[slot_t, pos_t] = k[0].transpose(0, 1).to(ck.dtype)
        cv[slot_t, pos_t] = v[0].transpose(0, 1).to(cv.dtype)
        qt = q[0].transpose(0, 1)                                            # [T, h, D]
        if meta.flat_kernel:
            out = torch.ops.specload.flat_attention(qt, ck, cv, slot_t, pos_t, self.d ** -0.5)
            return out.transpose(0, 1)[None]
        if meta.flat_groups is None:
            return self._flat_group(qt, ck, cv, slot_t, pos_t, meta.kv_len).transpose(0, 1)[None]
        outs = [self._flat_group(qt[idx], ck, cv, slot_t[idx], pos_t[idx], n)
                for idx, n in meta.flat_groups]
        return torch.cat(outs)[meta.flat_back].transpose(0, 1)[None]

    def _flat_group(self, q, ck, cv, slot_t, pos_t, n: int) -> torch.Tensor:
        """q: [T, h, D]; token t attends positions 0..pos_t[t] (< n) of slot slot_t[t]
        -> [T, h, D]."""
        T = q.shape[0]
        g, kvh, d = self.h // self.kvh, self.kvh, self.d
        qg = q.reshape(T, kvh, g, 1, d)
        kk = ck[slot_t, :n].permute(0, 2, 1, 3)[:, :, None].to(q.dtype)   # [T, kvh, 1, n, D]
        s = (qg * kk).sum(-1) * (d ** -0.5)                                  # [T, kvh, g, n]
        later = torch.arange(n, device=q.device)[None, :] > pos_t[:, None]   # [T, n]
        s = s.masked_fill(later[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        vv = cv[slot_t, :n].permute(0, 2, 1, 3)[:, :, None].to(q.dtype)   # [T, kvh, 1, n, D]
        out = (p[..., None] * vv).sum(-2)                                    # [T, kvh, g, D]
        return out.reshape(T, self.h, d)

    def _packed_attention(self, q, k, v, cache_kv, meta: BatchMeta) -> torch.Tensor:
        """Attention of a packed batch (``BatchMeta.segments``): one write of every
        new token's K/V, then each row attends its own slot (a view of the cache,
        no gather, no padding); a row that starts at 0 attends its own new K/V
        causally. q: [1, h, T, D]; k, v: [1, kvh, T, D] -> [1, h, T, D]."""
        ck, cv = cache_kv
        same = ck.dtype == q.dtype
        ck[meta.write_rows, meta.write_pos] = k[0].transpose(0, 1).to(ck.dtype)
        cv[meta.write_rows, meta.write_pos] = v[0].transpose(0, 1).to(cv.dtype)
        gqa = self.h != self.kvh
        outs = []
        for (slot, start, off, n), mask in zip(meta.segments, meta.seg_masks):
            qs = q[:, :, off:off + n]
            if start == 0 and same:
                outs.append(F.scaled_dot_product_attention(
                    qs, k[:, :, off:off + n], v[:, :, off:off + n], is_causal=n > 1,
                    enable_gqa=gqa))
                continue
            ks = ck[slot, :start + n].transpose(0, 1)[None]
            vs = cv[slot, :start + n].transpose(0, 1)[None]
            if not same:
                ks, vs = ks.to(q.dtype), vs.to(q.dtype)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                       enable_gqa=gqa))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def fuse(self, norm_weight: torch.Tensor | None = None, packed: bool = False) -> None:
        """Inference only: one GEMM for gate and up projections (``norm_weight``:
        [H] the preceding RMSNorm's weight, folded in as in ``Attention.fuse``; ``packed``:
        bfloat16-packed copies too, as there)."""
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self._gate_up_w = transposed(w if norm_weight is None else w * norm_weight[None, :])
        self._down_wt = transposed(self.down_proj.weight) if w.device.type == "cpu" else None
        self.gate_up_packed = linear_kernel.pack(self._gate_up_w) if packed else None
        self.down_packed = linear_kernel.pack(self._down_wt) if packed and self._down_wt is not None else None

    def forward(self, x):
        if not self.training and getattr(self, "_gate_up_w", None) is not None:
            gate, up = linear_t(x, self._gate_up_w,
                                packed=getattr(self, "gate_up_packed", None)).chunk(2, dim=-1)
            act = F.silu(gate) * up
            return self.down_proj(act) if self._down_wt is None else linear_t(
                act, self._down_wt, packed=getattr(self, "down_packed", None))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self, packed: bool = False) -> None:
        """Inference only: fused GEMMs, with both RMSNorm weights folded into them, or,
        with ``packed`` (bfloat16-valued weights, ``CausalLM.fuse``), kept apart so the
        fused weights stay bfloat16 values and get packed copies for the few-row kernel
        (a folded product of two bfloat16 values is not one)."""
        fold = self.input_layernorm.weight.dtype == torch.float32 and not packed
        self.self_attn.fuse(self.input_layernorm.weight if fold else None, packed=packed)
        self.mlp.fuse(self.post_attention_layernorm.weight if fold else None, packed=packed)
        self.norm_folded = fold

    def forward(self, x, cos, sin, mask, cache_kv=None, meta=None):
        if not self.training and getattr(self, "norm_folded", False) \
                and getattr(self.self_attn, "_qkv_w", None) is not None:
            eps = self.input_layernorm.eps
            x = x + self.self_attn(rms_unweighted(x, eps), cos, sin, mask, cache_kv, meta)
            return x + self.mlp(rms_unweighted(x, eps))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # nn.Embedding's own init, except on the meta device (from_pretrained): there its
        # normal_ goes through torch._refs and imports torch._dynamo (2.7 s of every engine
        # process's start-up, for values the checkpoint overwrites anyway)
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ForwardOutput:
    """logits: [B, Q', V] (Q' = Q, or len(logits_index) rows); hidden: final-norm
    hidden states [B, Q, H]; aux_hidden: concatenated outputs of ``aux_layers``
    [B, Q, len(aux_layers) * H] or None."""

    logits: torch.Tensor
    hidden: torch.Tensor
    aux_hidden: torch.Tensor | None = None


class CausalLM(nn.Module):
    """Decoder-only LM with HF parameter names (``model.*``, ``lm_head``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # bumped by every ``fuse``: a ``ModelRunner`` re-chooses its forward route (and
        # rebuilds its stack over the new packed copies) when it changed
        self.weights_version = 0

    # -- loading / saving -------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, device="cpu",
                        dtype: torch.dtype = torch.float32) -> "CausalLM":
        """Load an HF directory. Raises FileNotFoundError / ValueError with the cause."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: --model must be a local HF model "
                                    "directory holding config.json and *.safetensors")
        cfg = ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        with torch.device("meta"):
            model = cls(cfg)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        # assign=True: the loaded tensors become the parameters (no to_empty, whose
        # empty_like on meta tensors goes through torch._refs and imports sympy)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model = model.to(device=device)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights in {path} do not match the config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        model = model.to(dtype=dtype).eval()
        model.fuse()
        return model

    def fuse(self, enabled: bool = True) -> None:
        """Build fused inference weights (qkv, gate|up) used in eval mode. Call
        again after changing weights, or ``fuse(False)`` before training."""
        self.weights_version += 1
        with torch.no_grad():
            packed = enabled and self.packable()
            for layer in self.model.layers:
                if enabled:
                    layer.fuse(packed=packed)
                else:
                    layer.self_attn._qkv_w = layer.self_attn.qkv_bias = layer.self_attn._o_wt = None
                    layer.self_attn.qkv_packed = layer.self_attn.o_packed = None
                    layer.mlp._gate_up_w = layer.mlp._down_wt = None
                    layer.mlp.gate_up_packed = layer.mlp.down_packed = None
                    layer.norm_folded = False
            w = self.lm_head.weight
            self.lm_head_t = transposed(w) if enabled and w.device.type == "cpu" else None
            self.lm_packed = linear_kernel.pack(self.lm_head_t) if packed and self.lm_head_t is not None else None

    def packable(self) -> bool:
        """Whether the eager few-row forwards read bfloat16-packed weights
        (``actors.engine.linear_kernel``): float32 weights on a CPU whose every linear
        weight holds bfloat16 values (a bfloat16 checkpoint loaded as float32), and the
        kernel built. Then the RMSNorm weights are not folded into the GEMMs."""
        lin = [m.weight for m in self.modules() if isinstance(m, nn.Linear)]
        return bool(lin) and lin[0].device.type == "cpu" and linear_kernel.load() is not None \
            and all(linear_kernel.bf16_exact(w) for w in lin)

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write ``config.json`` + ``model.safetensors`` (HF layout) in ``dtype``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        d = self.config.to_hf_dict()
        d["torch_dtype"] = str(dtype).replace("torch.", "")
        (path / "config.json").write_text(json.dumps(d, indent=2))

    def rotary(self, pos: torch.Tensor, dtype: torch.dtype, signed: bool = False,
              max_pos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, Q, D] from a table built once per device/dtype (positions < max).

        signed: sin with its first half negated (``apply_rope_signed``'s table).
        max_pos: the largest position when the caller knows it (no device sync).
        """
        key = (pos.device, dtype)
        table = getattr(self, "rope_table", None)
        if table is None or table[0] != key:
            n = self.config.max_position_embeddings
            all_pos = torch.arange(n, device=pos.device)[None]
            c, s_ = rope_cos_sin(all_pos, self.config.head_dim, self.config.rope_theta, dtype)
            c, s_ = c[0, 0], s_[0, 0]  # [n, D] each
            half = s_.shape[-1] // 2
            table = (key, c, s_, torch.cat([-s_[:, :half], s_[:, half:]], -1))
            self.rope_table = table
        top = int(pos.max()) if max_pos is None else max_pos
        if top >= table[1].shape[0]:  # past the table: compute directly
            c, s_ = rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta, dtype)
            if signed:
                half = s_.shape[-1] // 2
                s_ = torch.cat([-s_[..., :half], s_[..., half:]], -1)
            return c, s_
        return table[1][pos][:, None], table[3 if signed else 2][pos][:, None]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- forward ----------------------------------------------------------
    def forward_stack(self, input_ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                      stack, logits_index: torch.Tensor, max_pos: int | None = None,
                      aux_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """The flat forward (``BatchMeta.flat``) with every layer in one C call
        (``layer_kernel.run_stack``; ``stack``: its ``Stack`` of this model over the cache).
        input_ids [1, T], pos / slots [T] int64 (each token's position and cache slot),
        logits_index [1, R] (max_pos: the largest position, when the caller knows it) ->
        logits [1, R, V], hidden [1, T, H], aux_hidden [1, T, A * H] (``aux_layers``, as
        ``forward``'s) or None. Raises as ``run_stack``."""
        from actors.engine import layer_kernel

        x = self.model.embed_tokens(input_ids[0])                       # [T, H], a new tensor
        cos, sin = self.rotary(pos, x.dtype, signed=True,
                              max_pos=int(pos.max()) if max_pos is None else max_pos)
        aux = layer_kernel.run_stack(stack, x, cos[:, 0].contiguous(), sin[:, 0].contiguous(),
                                     slots, pos, aux_layers)
        h = self.model.norm(x)
        logits = linear_t(h[logits_index[0]], self.lm_head_t, packed=self.lm_packed)
        return ForwardOutput(logits[None], h[None], None if aux is None else aux[None])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, meta: BatchMeta | None = None,
                logits_index: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Run the model.

        input_ids: [B, Q] int64. Without ``cache``: a plain causal forward from
        position 0 (training). With ``cache`` + ``meta``: row b's tokens sit at
        positions ``meta.starts[b] + j``; their K/V are written to slot
        ``meta.slots[b]`` and attention reads that slot's first ``kv_len``
        positions, masked causally per row (padded rows may hold garbage).
        logits_index: optional [B, R] int64 positions (within Q) whose logits to
        compute, saving the LM head elsewhere. aux_layers: layer indices whose
        outputs are returned concatenated in ``aux_hidden`` (DFlash context).
        """
        B, Q = input_ids.shape
        dev = input_ids.device
        x = self.model.embed_tokens(input_ids)
        if cache is None:
            pos = positions if positions is not None else torch.arange(Q, device=dev).expand(B, Q)
            mask = None
        elif meta.segments is not None or meta.flat:   # packed / flat: positions from the caller
            pos = meta.positions
            mask = None
        else:
            pos = meta.starts[:, None] + torch.arange(Q, device=dev)
            meta.write_pos = pos
            meta.write_rows = meta.slots[:, None].expand(B, Q)
            if B == 1 and meta.single is None:
                meta.single = (int(meta.slots[0]), int(meta.starts[0]))
            elif B > 1:
                meta.single = None
            if B == 1 and Q == 1:
                mask = None
            else:
                kpos = torch.arange(meta.kv_len, device=dev)
                mask = (kpos[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, Q, K]
        fused = not self.training and getattr(self.model.layers[0].self_attn, "_qkv_w",
                                              None) is not None
        cos, sin = self.rotary(pos, x.dtype, signed=fused,
                              max_pos=meta.kv_len - 1 if cache is not None else None)
        aux = []
        for i, layer in enumerate(self.model.layers):
            kv = (cache.k[i], cache.v[i]) if cache is not None else None
            x = layer(x, cos, sin, mask, kv, meta)
            if i in aux_layers:
                aux.append(x)
        h = self.model.norm(x)
        hs = h if logits_index is None else torch.gather(
            h, 1, logits_index[..., None].expand(-1, -1, h.shape[-1]))
        lm_wt = getattr(self, "lm_head_t", None)
        logits = self.lm_head(hs) if lm_wt is None or self.training else linear_t(
            hs, lm_wt, packed=getattr(self, "lm_packed", None))
        return ForwardOutput(logits, h, torch.cat(aux, -1) if aux else None)
