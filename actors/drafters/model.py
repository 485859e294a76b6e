"""Block drafter backbone shared by DFlash, DFlash 2 and DSpark.

DFlash (arXiv 2602.06036, Sec. 3): a small non-causal transformer drafts a
whole block in one forward over ``[anchor token, mask x (block-1)]``. Target
hidden states from several target layers are fused by ``fc`` + RMSNorm and
injected as context keys/values in every draft layer: each layer's attention
reads ``concat(K/V(context), K/V(block))`` (the block attends to all of
itself, and to the context strictly before the anchor). Embedding and LM head
are the target's, frozen and shared (not stored with the drafter).

DFlash 2 ("Keep Drafting Parallel", Sec. on dynamic convolution): an optional
two-tap dynamic depthwise convolution ``y_t = k_t0 * x_t + k_t1 * x_(t-1)``
on the normalised input of attention and of the MLP, taps predicted from
``x_t``; ``x_(-1)`` is zero at every block start, so nothing crosses a block
boundary. Heads (path selector, Markov head, confidence head) live in
``actors.drafters.heads``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from actors.drafters.config import DrafterConfig
from actors.drafters.heads import ConfidenceHead, MarkovHead, PathSelector
from actors.engine import linear_kernel
from actors.engine.model import RMSNorm as _TargetRMSNorm
from actors.engine.model import (apply_rope, apply_rope_signed, linear_t, rms_unweighted,
                                 rope_cos_sin, transposed)


class RMSNorm(_TargetRMSNorm):
    """Same parameters as the target's RMSNorm. Training: ``F.rms_norm``;
    fp32 inference: written out (``rms_unweighted``), which on a CPU is fewer
    kernels than ``F.rms_norm``'s decomposition (20 vs 33 us per [8, 256] call)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training or x.dtype != torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return rms_unweighted(x, self.eps) * self.weight


def packed_copy(wt: torch.Tensor) -> torch.Tensor | None:
    """``linear_kernel.pack(wt)`` for a CPU float32 inference weight [in, out] whose values
    are all bfloat16 values (a checkpoint stored in bfloat16), else None (``linear_t`` then
    runs ``mm``)."""
    return linear_kernel.pack(wt) if wt.device.type == "cpu" and wt.dtype == torch.float32 \
        else None


class DynamicConv2(nn.Module):
    """Two-tap dynamic depthwise conv within blocks of ``block_size`` positions.

    Taps [2, H] per position come from a rank-``r`` bottleneck of ``x_t``; the
    up-projection starts at zero with bias (1, 0), so the conv starts as the
    identity and training only moves it where it helps.
    """

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, 2 * hidden)
        with torch.no_grad():
            self.up.weight.zero_()
            self.up.bias.copy_(torch.cat([torch.ones(hidden), torch.zeros(hidden)]))

    def forward(self, x: torch.Tensor, block_size: int) -> torch.Tensor:
        """x: [B, Q, H] with Q a multiple of block_size (blocks laid end to end)."""
        fused = getattr(self, "_down_wt", None)
        if fused is not None and not self.training:  # inference: transposed weights
            k0, k1 = linear_t(F.silu(linear_t(x, fused)), self._up_wt,
                              self.up.bias, packed=self._up_pk).chunk(2, dim=-1)
        else:
            k0, k1 = self.up(F.silu(self.down(x))).chunk(2, dim=-1)
        prev = F.pad(x, (0, 0, 1, 0))[:, :-1]
        if x.shape[1] > block_size:  # one block: the pad already zeroed its first position
            first = (torch.arange(x.shape[1], device=x.device) % block_size) == 0
            prev = prev.masked_fill(first[None, :, None], 0.0)  # never read the previous block
        return torch.addcmul(k0 * x, k1, prev)

    def fuse(self, enabled: bool = True) -> None:
        """Inference only: transposed copies of both projections (``linear_t``)."""
        self._down_wt = transposed(self.down.weight) if enabled else None
        self._up_wt = transposed(self.up.weight) if enabled else None
        self._up_pk = packed_copy(self._up_wt) if enabled else None


class DraftLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads the context K/V."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, h, kvh, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.h, self.kvh, self.d = h, kvh, d
        self.q_proj = nn.Linear(H, h * d, bias=False)
        self.k_proj = nn.Linear(H, kvh * d, bias=False)
        self.v_proj = nn.Linear(H, kvh * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.conv_attn = DynamicConv2(H, cfg.conv_rank) if cfg.use_conv else None
        self.conv_mlp = DynamicConv2(H, cfg.conv_rank) if cfg.use_conv else None

    def fuse(self, enabled: bool = True) -> None:
        """Inference only (``BlockDrafter.fuse``): one GEMM for q|k|v (the context's
        k|v read a column slice of it), one for gate|up, every weight transposed
        for ``linear_t``, and the q/k norms as one per-head-weighted norm. Float
        results differ from the unfused path by rounding only (other GEMM shapes
        and summation orders). Kept as plain attributes, so
        ``actors.engine.memory.fused_tensors`` counts them."""
        for conv in (self.conv_attn, self.conv_mlp):
            if conv is not None:
                conv.fuse(enabled)
        if not enabled:
            self._qkv_wt = self._o_wt = self._gate_up_wt = self._down_wt = None
            self._qkv_pk = self._kv_pk = self._o_pk = self._gate_up_pk = self._down_pk = None
            self._qk_norm_w = None
            return
        q, k, v = self.q_proj.weight, self.k_proj.weight, self.v_proj.weight
        self._qkv_wt = transposed(torch.cat([q, k, v]))  # [H, (h + 2 kvh) D]
        self._o_wt = transposed(self.o_proj.weight)  # [h D, H]
        self._gate_up_wt = transposed(torch.cat([self.gate_proj.weight,
                                                 self.up_proj.weight]))  # [H, 2 I]
        self._down_wt = transposed(self.down_proj.weight)  # [I, H]
        self._qk_norm_w = torch.cat([self.q_norm.weight.expand(self.h, self.d),
                                     self.k_norm.weight.expand(self.kvh, self.d)])  # [h+kvh, D]
        # the bfloat16-weight kernel's copies (``linear_kernel``: half the bytes, the same
        # float32 products), where the weights are bfloat16 values (as stored) on a CPU
        self._qkv_pk = packed_copy(self._qkv_wt)
        # the k|v columns' blocks of the same copy (a view: [N / 64, K, 64] is block-major)
        self._kv_pk = None if self._qkv_pk is None or (self.h * self.d) % linear_kernel.BLOCK \
            else self._qkv_pk[self.h * self.d // linear_kernel.BLOCK:]
        self._o_pk = packed_copy(self._o_wt)
        self._gate_up_pk = packed_copy(self._gate_up_wt)
        self._down_pk = packed_copy(self._down_wt)

    def _fast(self) -> bool:
        return not self.training and getattr(self, "_qkv_wt", None) is not None

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, H] -> k, v: [B, KVH, T, D] (k normed and rotated).

        cos, sin: [B, 1, T, D]; with fused weights sin is the signed table
        (``apply_rope_signed``, ``BlockDrafter.rope``)."""
        B, T, _ = x.shape
        if self._fast():
            kv = linear_t(x, self._qkv_wt[:, self.h * self.d:], packed=self._kv_pk
                          ).view(B, T, 2 * self.kvh, self.d)
            k = rms_unweighted(kv[:, :, :self.kvh], self.k_norm.eps) * self._qk_norm_w[self.h:]
            return (apply_rope_signed(k.transpose(1, 2), cos, sin),
                    kv[:, :, self.kvh:].transpose(1, 2))
        k = self.k_norm(self.k_proj(x).view(B, T, self.kvh, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kvh, self.d).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, block_size: int, ctx_room: bool = False):
        """x: [B, Q, H]; ctx_k/v: [B, KVH, C, D]; mask: bool [B, 1, Q, C + Q].

        ctx_room: ctx_k/v are [B, KVH, C + Q, D] whose last Q positions are
        scratch: the block's own K/V are written there instead of concatenated."""
        B, Q, _ = x.shape
        if self._fast():
            return self._forward_fused(x, cos, sin, ctx_k, ctx_v, mask, block_size, ctx_room)
        if ctx_room:
            ctx_k, ctx_v = ctx_k[:, :, :-Q], ctx_v[:, :, :-Q]
        hn = self.input_layernorm(x)
        if self.conv_attn is not None:
            hn = self.conv_attn(hn, block_size)
        q = self.q_norm(self.q_proj(hn).view(B, Q, self.h, self.d)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(hn, cos, sin)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=2)
        v = torch.cat([ctx_v.to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.h != self.kvh)
        x = x + self.o_proj(out.transpose(1, 2).reshape(B, Q, self.h * self.d))
        hn = self.post_attention_layernorm(x)
        if self.conv_mlp is not None:
            hn = self.conv_mlp(hn, block_size)
        return x + self.down_proj(F.silu(self.gate_proj(hn)) * self.up_proj(hn))

    def _forward_fused(self, x, cos, sin, ctx_k, ctx_v, mask, block_size: int,
                       ctx_room: bool = False):
        """``forward`` from the fused weights: about a third of the kernels (a
        batch-1 draft step is bound by their count on a CPU). sin: the signed table."""
        B, Q, _ = x.shape
        h, kvh, d = self.h, self.kvh, self.d
        hn = self.input_layernorm(x)
        if self.conv_attn is not None:
            hn = self.conv_attn(hn, block_size)
        qkv = linear_t(hn, self._qkv_wt, packed=self._qkv_pk).view(B, Q, h + 2 * kvh, d)
        qk = rms_unweighted(qkv[:, :, :h + kvh], self.q_norm.eps) * self._qk_norm_w
        qk = apply_rope_signed(qk.transpose(1, 2), cos, sin)
        if ctx_room and ctx_k.dtype == qk.dtype:
            ctx_k[:, :, -Q:] = qk[:, h:]
            ctx_v[:, :, -Q:] = qkv[:, :, h + kvh:].transpose(1, 2)
            k, v = ctx_k, ctx_v
        else:
            if ctx_room:
                ctx_k, ctx_v = ctx_k[:, :, :-Q], ctx_v[:, :, :-Q]
            k = torch.cat([ctx_k.to(qk.dtype), qk[:, h:]], dim=2)
            v = torch.cat([ctx_v.to(qk.dtype), qkv[:, :, h + kvh:].transpose(1, 2)], dim=2)
        out = F.scaled_dot_product_attention(qk[:, :h], k, v, attn_mask=mask,
                                             enable_gqa=h != kvh)
        x = x + linear_t(out.transpose(1, 2).reshape(B, Q, h * d), self._o_wt, packed=self._o_pk)
        hn = self.post_attention_layernorm(x)
        if self.conv_mlp is not None:
            hn = self.conv_mlp(hn, block_size)
        gate, up = linear_t(hn, self._gate_up_wt, packed=self._gate_up_pk).chunk(2, dim=-1)
        return x + linear_t(F.silu(gate) * up, self._down_wt, packed=self._down_pk)


class BlockDrafter(nn.Module):
    """The drafter: context fusion, draft layers, final norm and optional heads.

    The target's embedding and LM head are bound with ``bind_target`` and kept
    outside the module's parameters (they are neither trained nor saved).
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H = cfg.hidden_size
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.mask_embed = nn.Parameter(torch.randn(H) * 0.02)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.selector = PathSelector(H, cfg.selector_rank) if cfg.use_selector else None
        self.markov = (MarkovHead(H, cfg.markov_rank, cfg.markov_hidden_term)
                       if cfg.use_markov else None)
        self.confidence = (ConfidenceHead(H, cfg.markov_rank if cfg.use_markov else 0,
                                          cfg.confidence_logit_features)
                           if cfg.use_confidence else None)
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None
        self._target_ref: tuple = ()
        self._rope_table: tuple | None = None  # (device, dtype), cos [P, D], signed sin [P, D]
        self._max_positions = 4096  # the bound target's max_position_embeddings

    # -- inference weights ------------------------------------------------------
    def fuse(self, enabled: bool = True) -> "BlockDrafter":
        """Build the fused inference weights every layer uses in eval mode
        (``DraftLayer.fuse``). ``load_drafter`` calls it; call it again after
        changing weights in eval mode. ``train()`` drops them (training always
        runs the plain modules)."""
        with torch.no_grad():
            for layer in self.layers:
                layer.fuse(enabled)
            self._fc_wt = transposed(self.fc.weight) if enabled else None
            self._fc_pk = packed_copy(self._fc_wt) if enabled else None
        self._fused = enabled
        return self

    def train(self, mode: bool = True) -> "BlockDrafter":
        if mode and getattr(self, "_fused", False):
            self.fuse(False)  # the copies would go stale as the weights train
        return super().train(mode)

    def _fast(self) -> bool:
        return not self.training and getattr(self, "_fused", False)

    def rope(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [B, 1, Q, D] for positions [B, Q] (``apply_rope_signed``'s
        layout), gathered from a table of the target's first
        ``max_position_embeddings`` + block_size positions, built once per device
        and dtype. Raises IndexError for a position past the table."""
        cfg = self.config
        key = (pos.device, dtype)
        if self._rope_table is None or self._rope_table[0] != key:
            n = self._max_positions + cfg.block_size
            c, s_ = rope_cos_sin(torch.arange(n, device=pos.device)[None], cfg.head_dim,
                                 cfg.rope_theta, dtype)
            c, s_ = c[0, 0], s_[0, 0]
            half = cfg.head_dim // 2
            self._rope_table = (key, c, torch.cat([-s_[:, :half], s_[:, half:]], -1))
        _, c, s_ = self._rope_table
        # no bounds check (it would cost a reduction and a sync per call): drafted
        # positions stay below max_model_len + block_size <= the table's length,
        # and index_select raises IndexError past it
        flat = pos.reshape(-1)
        return (c.index_select(0, flat).view(*pos.shape, -1)[:, None],
                s_.index_select(0, flat).view(*pos.shape, -1)[:, None])

    # -- target binding -----------------------------------------------------
    def bind_target(self, target) -> "BlockDrafter":
        """Share ``target``'s embedding and LM head (an ``actors.engine.model.CausalLM``)."""
        self.config.check_target(target.config)
        self._shared = (target.model.embed_tokens.weight, target.lm_head.weight)
        self._target_ref = (target,)  # a tuple: not registered as a submodule
        self._max_positions = target.config.max_position_embeddings
        self._rope_table = None
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self._shared[0]).to(self.mask_embed.dtype)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Shared LM head, float logits [..., V]. On a CPU the few-row matmul runs
        from W^T contiguous (``linear_t``, ~2x faster than ``F.linear``): the
        target's own copy (``CausalLM.fuse``) when it has one, so one 4 MB copy
        serves both and stays warm in cache between verify and draft, and with it the
        target's bfloat16-packed copy (``linear_kernel``: half the bytes, the same
        float32 products); else a copy cached here. On a GPU the weight is used in place (no extra memory)."""
        W = self._shared[1]
        if W.device.type != "cpu":
            return F.linear(h.to(W.dtype), W).float()
        target = self._target_ref[0] if self._target_ref else None
        wt = getattr(target, "lm_head_t", None)
        packed = getattr(target, "lm_packed", None)     # the target's bf16 copy: the C kernel
        if wt is None or wt.shape != W.shape[::-1]:
            key = (W.data_ptr(), W._version)
            if getattr(self, "_lm_t_key", None) != key:
                self._lm_t = W.detach().t().contiguous()
                self._lm_t_key = key
            wt, packed = self._lm_t, None
        return linear_t(h.to(W.dtype), wt, packed=packed if h.dtype == torch.float32 else None
                        ).float()

    def markov_vocab_proj(self) -> torch.Tensor:
        """W_lm @ U [V, r] (float): the Markov head's rank-r update in vocabulary
        space, cached until the head's weights change."""
        key = (self.markov.out.weight._version, self.markov.out.weight.data_ptr())
        if getattr(self, "_mvp_key", None) != key:
            with torch.no_grad():
                self._mvp = (self._shared[1].float() @ self.markov.out.weight.float())
            self._mvp_key = key
        return self._mvp

    def markov_vocab_proj_t(self) -> torch.Tensor:
        """``markov_vocab_proj()`` transposed, contiguous [r, V] (the walk's addmm
        operand: a few-row GEMM from this layout is ~2x faster on a CPU)."""
        proj = self.markov_vocab_proj()
        if getattr(self, "_mvp_t_src", None) is not proj:
            self._mvp_t = proj.T.contiguous()
            self._mvp_t_src = proj
        return self._mvp_t

    def vocab_table(self, name: str, *linears: nn.Module) -> torch.Tensor:
        """``cat([lin(embed(v)) for lin in linears], -1)`` for every token v:
        [V, sum of out features], computed once and cached until those weights
        (or the bound embedding) change. A head that projects embedded token ids
        then gathers rows instead of embedding and projecting per step (one
        kernel instead of 1 + len(linears))."""
        ws = [lin.weight for lin in linears]
        key = (self._shared[0].data_ptr(), self._shared[0]._version,
               *((w.data_ptr(), w._version) for w in ws))
        cache = self.__dict__.setdefault("_vocab_tables", {})
        if name not in cache or cache[name][0] != key:
            with torch.no_grad():
                e = self._shared[0].to(self.mask_embed.dtype)
                cache[name] = (key, torch.cat([lin(e) for lin in linears], -1))
        return cache[name][1]

    def num_params(self, component: str | None = None) -> int:
        mods = {"conv": [m for l in self.layers for m in (l.conv_attn, l.conv_mlp) if m],
                "selector": [self.selector] if self.selector else [],
                "markov": [self.markov] if self.markov else [],
                "confidence": [self.confidence] if self.confidence else []}
        if component is None:
            return sum(p.numel() for p in self.parameters())
        return sum(p.numel() for m in mods[component] for p in m.parameters())

    # -- forward pieces -------------------------------------------------------
    def _rope(self, pos: torch.Tensor, dtype):
        return rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        """aux: [B, C, A*H] target hidden states; positions: [B, C] -> per layer (k, v)
        each [B, KVH, C, D]. Causal and draft-independent, so callers cache it."""
        if self._fast():
            ctx = self.hidden_norm(linear_t(aux.to(self._fc_wt.dtype), self._fc_wt,
                                            packed=self._fc_pk))
        else:
            ctx = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        cos, sin = (self.rope if self._fast() else self._rope)(positions, ctx.dtype)
        return [layer.kv(ctx, cos, sin) for layer in self.layers]

    def block_hidden(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor,
                     ctx_kv: list[tuple], ctx_mask: torch.Tensor,
                     ctx_room: bool = False) -> torch.Tensor:
        """Hidden states of every block position after the final norm.

        anchor_ids, anchor_pos: [B, NB] (NB blocks per row laid end to end);
        ctx_kv: per layer (k, v) [B, KVH, C, D]; ctx_mask: bool [B, NB, C], True
        where a block may read a context position, or None (NB == 1 only) when
        every row may read all C. ctx_room: each (k, v) is [B, KVH, C + NB * bs, D]
        whose last NB * bs positions are scratch for the block's own K/V (written
        there instead of concatenated; ``ContextCache.gather(room=...)``).
        Returns [B, NB * bs, H].
        """
        B, NB = anchor_ids.shape
        bs = self.config.block_size
        fast = self._fast()
        if fast and NB == 1:  # [anchor, mask x (bs - 1)] in one kernel
            x = torch.cat([self.embed(anchor_ids),
                           self.mask_embed.expand(B, bs - 1, -1)], dim=1)
        else:
            x = self.mask_embed.expand(B, NB, bs, -1).clone()
            x[:, :, 0] = self.embed(anchor_ids)
            x = x.view(B, NB * bs, -1)
        pos = (anchor_pos[..., None] + torch.arange(bs, device=x.device)).view(B, NB * bs)
        cos, sin = (self.rope if fast else self._rope)(pos, x.dtype)
        if ctx_mask is None and NB == 1:  # every row sees all its context and block
            mask = None
        elif NB == 1:  # serving: one block per row, which sees all of itself
            mask = torch.cat([ctx_mask.expand(B, bs, -1),
                              ctx_mask.new_ones(B, bs, bs)], dim=-1)[:, None]
        else:
            blk = torch.arange(NB * bs, device=x.device) // bs
            same = blk[:, None] == blk[None, :]  # [Q, Q] each block sees only itself
            mask = torch.cat([ctx_mask.repeat_interleave(bs, dim=1),
                              same.expand(B, -1, -1)], dim=-1)[:, None]
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ck, cv, mask, bs, ctx_room)
        return self.norm(x)

    # -- persistence ------------------------------------------------------------
    def save(self, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write ``config.json`` + ``model.safetensors`` (shared weights excluded)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        tmp = path / "model.safetensors.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.replace(path / "model.safetensors")
        (path / "config.json").write_text(self.config.to_json())


def load_drafter(path: str | Path, target, dtype: torch.dtype | None = None,
                 **overrides) -> BlockDrafter:
    """Load a drafter directory and bind it to ``target`` (``actors.engine.model.CausalLM``).

    overrides: config switches to change at load time (e.g. ``use_selector=False``
    for an ablation); a head switched on that the weights lack raises ValueError.
    """
    from dataclasses import replace

    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} must hold config.json and model.safetensors of a drafter "
                                "(train one with `python -m train.drafters --method ...`)")
    cfg = DrafterConfig.from_file(path / "config.json")
    cfg = replace(cfg, **overrides)
    state = load_file(str(path / "model.safetensors"))
    model = BlockDrafter(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing:
        raise ValueError(f"{path}: weights lack {missing[:4]} needed by config {overrides or ''}")
    # Unexpected keys are heads switched off for an ablation: fine to ignore.
    dtype = dtype or target.lm_head.weight.dtype
    return model.to(device=target.device, dtype=dtype).eval().bind_target(target).fuse()


def read_card(path: str | Path) -> dict:
    """The drafter's ``training.json`` (metrics written by train.drafters), or {}."""
    f = Path(path) / "training.json"
    return json.loads(f.read_text()) if f.is_file() else {}
