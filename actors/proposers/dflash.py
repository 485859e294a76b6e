"""``dflash``: block-diffusion drafting (DFlash, arXiv 2602.06036; z-lab/dflash).

Each step one drafter forward over ``[last token, mask x (block-1)]`` per
request, conditioned on the target's hidden states (``aux_layers``) of every
token already in the target's KV cache, proposes ``block-1`` tokens by
independent top-1 (Sec. 3.3). The proposal is deterministic, so the shared
verifier treats q as one-hot and sampling stays lossless.

``BlockDraftProposer`` is the machinery shared with ``dflash2`` and
``dspark``: a slot cache of the drafter's context K/V (fused target hidden
states projected by each draft layer; they never depend on the draft, so
they are computed once per committed token in ``observe_target``), batched
drafting over the live requests, and an optional trace for evaluation.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field

from actors.drafters.decode import BlockDraft, draft_block, draft_confidence
from actors.drafters.model import load_drafter
from actors.engine import layer_kernel
from actors.engine import memory as mem
from actors.engine.kv_cache import KVSlotPool
from actors.engine.types import DraftProposal, ProposeInput
from actors.proposers.base import Proposer, ProposerOptions
from configs.metric_names import FORWARD_PATH_OPS, FORWARD_PATH_STACK
from configs.paths import MODELS_DIR


class DFlashOptions(ProposerOptions):
    """drafter: drafter directory (default ``models/<strategy>``); top_k:
    candidates kept per position (dflash2 selects among them; with a trace
    they give the top-k coverage); record_trace: keep every block's path,
    top-1, top-k candidates and confidences (tensors) in ``proposer.trace``
    (for ``bench.acceptance``; confidences the step did not need are computed
    by ``finish_trace``, after the timed run)."""

    drafter: str | None = None
    top_k: int = Field(16, ge=1, le=256)
    record_trace: bool = False


class ContextCache:
    """Per-request context K/V of every draft layer: ``k[l]`` is [S, T, KVH, D] (the target
    cache's layout, so the decoder-stack C call reads and writes it: ``BlockDraftProposer``);
    ``gather`` gives attention's [B, KVH, C, D] views.

    Slots and lengths come from the shared ``KVSlotPool`` (``self.pool``): only
    committed target tokens are written, so the length only grows, except when
    the engine re-reports a position (``write`` rolls back to ``start`` first).
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, kvh: int, d: int,
                 device, dtype, room: int = 0):
        # ``room`` positions past max_len: scratch where a draft block's own K/V go
        # (``gather(room=...)``), so attention reads one buffer instead of a concatenation
        shape = (num_slots, max_len + room, kvh, d)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.pool = KVSlotPool(num_slots, max_len, "drafter context cache")
        self.max_len = max_len

    def slot(self, rid: str) -> int:
        """The request's slot, allocated on first use (KVCacheFullError when none is free)."""
        return self.pool.slot(rid) if rid in self.pool else self.pool.allocate(rid)

    def release(self, rid: str) -> None:
        self.pool.free(rid)

    def write(self, rid: str, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store context K/V ([1, KVH, n, D] per layer) of positions ``start .. start+n-1``.

        Raises ValueError when ``start`` skips unobserved positions or the
        request would pass ``max_len``.
        """
        s = self.reserve(rid, start, kv[0][0].shape[2])
        for layer, (k, v) in enumerate(kv):
            self.k[layer][s, start:start + k.shape[2]] = k[0].transpose(0, 1)
            self.v[layer][s, start:start + v.shape[2]] = v[0].transpose(0, 1)

    def reserve(self, rid: str, start: int, n: int) -> int:
        """The bookkeeping of ``write``: the request's slot, its length rolled back to
        ``start`` and grown by n (the caller writes positions start..start+n-1). Raises
        ValueError when ``start`` skips unobserved positions or the request would pass
        ``max_len``."""
        s = self.slot(rid)
        have = self.pool.length(rid)
        if start > have:
            raise ValueError(f"observe_target for {rid!r} starts at {start} but only "
                             f"{have} positions were observed: the engine must report "
                             "every token committed to the target cache, in order")
        self.pool.rollback(rid, start)
        self.pool.append(rid, n)
        return s

    def gather(self, slots: list[int], rids: list[str], room: int = 0
               ) -> tuple[list[tuple], list[int]]:
        """Context K/V [B, KVH, C + room, D] per layer (C = longest) and lengths [B].

        The last ``room`` positions (at most the constructor's ``room``) are
        scratch the caller may overwrite (a draft block's K/V): past every row's
        committed length, so nothing observed is lost.
        """
        lengths = [self.pool.length(r) for r in rids]
        C = max(max(lengths), 1) + room
        lo = slots[0]
        if slots == list(range(lo, lo + len(slots))):  # consecutive slots: views, no copy
            kv = [(k[lo:lo + len(slots), :C].transpose(1, 2),
                   v[lo:lo + len(slots), :C].transpose(1, 2)) for k, v in zip(self.k, self.v)]
        else:
            idx = torch.tensor(slots, device=self.k[0].device)
            kv = [(k[idx, :C].transpose(1, 2), v[idx, :C].transpose(1, 2))
                  for k, v in zip(self.k, self.v)]
        return kv, lengths


def draft_stack(drafter, cache: ContextCache) -> "layer_kernel.Stack | None":
    """The drafter's layers as one decoder-stack C call over ``cache``
    (``layer_kernel.Stack.of_layers``): a draft layer is a Qwen3 decoder layer whose
    attention reads the context K/V before the block (DFlash, arXiv 2602.06036, Sec. 3.1),
    which the call gets from ``span``, and (DFlash 2) a dynamic convolution on each norm's
    output (``dyn_conv``). None where it does not apply: not a CPU float32 drafter in eval
    with its fused, packed weights (``BlockDrafter.fuse``), or no library
    (``SPECLOAD_LAYER_KERNEL=0``, no compiler)."""
    cfg = drafter.config
    if drafter.training or not getattr(drafter, "_fused", False) \
            or getattr(drafter, "_fc_pk", None) is None or layer_kernel.load() is None \
            or cache.k[0].dtype != torch.float32 or cache.k[0].device.type != "cpu":
        return None
    layers = []
    for i, layer in enumerate(drafter.layers):
        if any(getattr(layer, n, None) is None for n in ("_qkv_pk", "_o_pk", "_gate_up_pk",
                                                        "_down_pk")):
            return None
        layers.append(dict(w_in=layer.input_layernorm.weight.detach().contiguous(),
                           w_post=layer.post_attention_layernorm.weight.detach().contiguous(),
                           qkv_b=None, qk_w=layer._qk_norm_w.contiguous(), qkv=layer._qkv_pk,
                           o=layer._o_pk, gate_up=layer._gate_up_pk, down=layer._down_pk,
                           ck=cache.k[i], cv=cache.v[i]))
        for tag, conv in (("ca", layer.conv_attn), ("cm", layer.conv_mlp)):
            if conv is None:
                continue
            if getattr(conv, "_up_pk", None) is None or conv.up.bias.dtype != torch.float32:
                return None
            layers[-1].update({f"{tag}_down": conv._down_wt.contiguous(), f"{tag}_up": conv._up_pk,
                               f"{tag}_b": conv.up.bias.detach().contiguous(),
                               "conv_r": conv.down.out_features, "conv_block": cfg.block_size})
    l0 = drafter.layers[0]
    return layer_kernel.Stack.of_layers(
        layers, (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                 cfg.head_dim), float(l0.input_layernorm.eps), float(l0.q_norm.eps))


class BlockDraftProposer(Proposer):
    """Shared batched drafting for the DFlash family (see module docstring)."""

    name = "dflash"
    Options = DFlashOptions
    default_num_speculative_tokens = 7  # block size 8 - the anchor
    use_selector: bool | None = False  # None = as the drafter's config says

    def __init__(self, target, num_speculative_tokens, max_num_seqs, max_model_len, draft_model,
                 options):
        super().__init__(target, num_speculative_tokens, max_num_seqs, max_model_len,
                         draft_model, options)
        path = Path(options.drafter or draft_model or MODELS_DIR / self.name)
        self.drafter = load_drafter(path, target, **self.load_overrides())
        cfg = self.drafter.config
        self.aux_layers = cfg.target_layer_ids
        self.block_size = cfg.block_size
        self.cache = ContextCache(cfg.num_layers, max_num_seqs, max_model_len or
                                  target.config.max_position_embeddings, cfg.num_kv_heads,
                                  cfg.head_dim, target.device, self.drafter.mask_embed.dtype,
                                  room=cfg.block_size)
        self.trace: list[dict] | None = [] if options.record_trace else None
        self.stack = draft_stack(self.drafter, self.cache)
        self._c_call = False    # the bound C block call, on the first draft (``_block_draft_c``)
        self.paths: list[str] = []      # the forward path of each draft (``last_path``)

    @property
    def last_path(self) -> str | None:
        """The forward path of the last draft: ``stack`` (one C call) or ``ops`` (torch)."""
        return self.paths[-1] if self.paths else None

    def load_overrides(self) -> dict:
        return {}

    @classmethod
    def draft_tokens_limit(cls, draft_model, options):
        """block_size - 1 of the drafter's ``config.json`` (None when it is not there:
        building the proposer then fails on the missing drafter anyway)."""
        from actors.drafters.config import DrafterConfig

        path = Path(options.drafter or draft_model or MODELS_DIR / cls.name) / "config.json"
        if not path.is_file():
            return None
        bs = DrafterConfig.from_file(path).block_size
        return bs - 1, f"{path.parent} drafts blocks of {bs} tokens: at most {bs - 1} drafts"

    def draft_params(self) -> int:
        return self.drafter.num_params()

    def memory(self) -> dict:
        shared = {mem.storage_key(t) for t in mem.module_tensors(self.target)}
        c = self.cache
        _, _, kvh, d = c.k[0].shape
        return {"draft_weight_bytes": mem.unique_bytes(mem.module_tensors(self.drafter), shared),
                "draft_fused_weight_bytes": mem.unique_bytes(
                    mem.fused_tensors(self.drafter),
                    shared | {mem.storage_key(t) for t in mem.fused_tensors(self.target)}),
                "draft_kv_allocated_bytes": mem.cache_bytes(c.k, c.v),
                "draft_kv_bytes_per_token": mem.kv_bytes_per_token(len(c.k), kvh, d, c.k[0].dtype)}

    def kv_pool(self):
        return self.cache.pool

    # -- request lifecycle ------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int]) -> None:
        self.cache.slot(request_id)

    def remove_request(self, request_id: str) -> None:
        self.cache.release(request_id)

    @torch.no_grad()
    def observe_target(self, request_id, start, token_ids, aux_hidden) -> None:
        if aux_hidden is None or len(token_ids) == 0:
            return
        dev = self.target.device
        pos = torch.arange(start, start + len(token_ids), device=dev)[None]
        d = self.drafter
        if self.stack is not None and aux_hidden.dtype == torch.float32 \
                and aux_hidden.device.type == "cpu":
            slot = self.cache.reserve(request_id, start, len(token_ids))
            cos, sin = d.rope(pos, torch.float32)
            layer_kernel.context_kv(self.stack, aux_hidden.contiguous(), d._fc_pk,
                                    d.hidden_norm.weight, d.hidden_norm.eps,
                                    cos.reshape(len(token_ids), -1),
                                    sin.reshape(len(token_ids), -1), slot, start)
            return
        self.cache.write(request_id, start, d.context_kv(aux_hidden.to(dev)[None], pos))

    # -- drafting -----------------------------------------------------------------
    @torch.no_grad()
    def draft(self, batch: list[ProposeInput]) -> BlockDraft:
        """One batched drafter forward + decoding for every row of ``batch``."""
        dev = self.target.device
        slots = [self.cache.slot(r.request_id) for r in batch]
        bs = self.block_size
        # the block's own K/V are written into the cache's scratch past the context
        # (``ctx_room``): attention reads one buffer, no per-layer concatenation
        positions = [len(r.token_ids) - 1 for r in batch]
        anchor_ids = [r.token_ids[-1] for r in batch]
        anchors = torch.tensor(anchor_ids, device=dev)
        lens = [self.cache.pool.length(r.request_id) for r in batch]
        # Candidates beyond the top-1 are only needed by the selector (a trace ranks
        # the kept logits at read time, outside the timed step).
        selects = self.use_selector is not False and self.drafter.selector is not None
        top_k = self.options.top_k if selects else 1
        pre = None
        if self.stack is not None and lens == positions:
            # every row's context is exactly the tokens before its anchor: the block goes
            # to positions anchor..anchor+bs-1 of its slot and reads 0..anchor+bs-1 (one C
            # call; a row with other context runs the torch form, which masks it)
            pre = self._block_draft_c(anchor_ids, positions, slots, top_k if selects else 0)
            h = None if pre is not None else self._block_hidden_stack(anchors, positions,
                                                                       slots)
            self.paths.append(FORWARD_PATH_STACK)
        else:
            h = self._block_hidden_ops(batch, slots, anchors, positions)
            self.paths.append(FORWARD_PATH_OPS)
        return draft_block(self.drafter, h, anchors, top_k, self.use_selector,
                           confidence=self.needs_confidence(),
                           computed=pre)

    def _block_draft_c(self, anchors: list[int], positions: list[int], slots: list[int],
                       top_k: int):
        """The block forward, final norm, LM head, top-1 and (top_k > 0) top-k of every
        row in one C call (``layer_kernel.BlockDraftCall``): (hidden [B, bs - 1, H], logits
        [B, bs - 1, V], top1 [B, bs - 1], topk indices, values [B, bs - 1, top_k] or
        None) of the draft positions. None where the call does not apply (no packed LM
        head shared with the target, a position past the rotary table):
        ``_block_hidden_stack`` and the torch head then."""
        call = self._c_call
        if call is False:
            call = self._c_call = self._bind_c_call()
        if call is None or max(positions) + self.block_size > call.P:
            return None
        return call(anchors, positions, slots, self.block_size, top_k, decode=True)

    def _bind_c_call(self):
        """``layer_kernel.BlockDraftCall`` of this drafter, or None where it does not apply."""
        d = self.drafter
        target = d._target_ref[0] if d._target_ref else None
        wt = getattr(target, "lm_head_t", None)
        if self.stack is None or wt is None or wt.shape != d._shared[1].shape[::-1]:
            return None
        d.rope(torch.zeros(1, 1, dtype=torch.long), torch.float32)  # builds the table
        _, cos_t, sin_t = d._rope_table
        selector = markov = None
        if self.use_selector is not False and d.selector is not None and d.markov is None:
            sel = d.selector
            selector = (sel.query.weight.detach().contiguous(),
                        d.vocab_table("selector", sel.cand, sel.right, sel.left),
                        float(sel.logp_scale))
        elif d.markov is not None:
            hid = d.markov.hid
            w = getattr(hid, "weight", None)
            markov = (d.vocab_table("markov_prev", d.markov.prev),
                      None if w is None else w.detach().contiguous(),
                      hid.bias.detach().contiguous(), d.markov_vocab_proj_t())
        return layer_kernel.BlockDraftCall.of(self.stack, d._shared[0], d.mask_embed.detach(),
                                              cos_t, sin_t, d.norm.weight.detach(),
                                              d.norm.eps, getattr(target, "lm_packed", None),
                                              selector, markov)

    def _block_hidden_stack(self, anchors: torch.Tensor, positions: list[int],
                            slots: list[int]) -> torch.Tensor:
        """``BlockDrafter.block_hidden`` on the decoder-stack C call (``draft_stack``):
        anchors [B]; the block's K/V are written past each row's context (positions its
        next ``observe_target`` overwrites). Returns [B, bs, H] after the final norm."""
        d, bs = self.drafter, self.block_size
        B = len(positions)
        x = torch.cat([d.embed(anchors[:, None]), d.mask_embed.expand(B, bs - 1, -1)], dim=1)
        x = x.reshape(B * bs, -1).contiguous()
        # positions, slots and spans of the B * bs tokens: one host-to-tensor copy
        idx = torch.tensor([[p + i for p in positions for i in range(bs)],
                            [s_ for s_ in slots for _ in range(bs)],
                            [p + bs - 1 for p in positions for _ in range(bs)]])
        pos, slot, span = idx[0], idx[1], idx[2]
        cos, sin = d.rope(pos[None], torch.float32)
        layer_kernel.run_stack(self.stack, x, cos.reshape(B * bs, -1), sin.reshape(B * bs, -1),
                               slot, pos, span=span)
        return d.norm(x.view(B, bs, -1))

    def _block_hidden_ops(self, batch: list[ProposeInput], slots: list[int],
                          anchors: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """``BlockDrafter.block_hidden`` in torch, over the gathered context K/V."""
        dev = self.target.device
        bs = self.block_size
        kv, lens = self.cache.gather(slots, [r.request_id for r in batch], room=bs)
        pos = torch.tensor(positions, device=dev)
        C = kv[0][0].shape[2] - bs
        seen = [min(n, p) for n, p in zip(lens, positions)]  # strictly before the anchor
        ctx_mask = None if all(n == C for n in seen) else (   # None: every row sees all C
            torch.arange(C, device=dev)[None] < torch.tensor(seen, device=dev)[:, None])[:, None]
        return self.drafter.block_hidden(anchors[:, None], pos[:, None], kv, ctx_mask,
                                         ctx_room=True)

    def needs_confidence(self) -> bool:
        """Whether ``lengths`` reads the confidence head (else it is not run in the
        step; a trace computes it afterwards in ``finish_trace``)."""
        return False

    def lengths(self, batch: list[ProposeInput], d: BlockDraft) -> list[int]:
        """Draft tokens to verify per row (fixed length: as many as allowed)."""
        return [min(r.max_draft, d.tokens.shape[1]) for r in batch]

    def propose(self, batch: list[ProposeInput]) -> list[DraftProposal]:
        out = [DraftProposal(token_ids=[]) for _ in batch]
        rows = [i for i, r in enumerate(batch) if r.max_draft > 0]
        if not rows:
            return out
        sub = [batch[i] for i in rows]
        d = self.draft(sub)
        toks = d.tokens.tolist()
        for j, (i, n) in enumerate(zip(rows, self.lengths(sub, d))):
            out[i] = DraftProposal(token_ids=toks[j][:n])
        if self.trace is not None:  # tensors now, lists at read time: keeps draft_ms honest
            for j, i in enumerate(rows):
                self.trace.append({"request_id": sub[j].request_id,
                                   "pos": len(sub[j].token_ids) - 1, "path": d.tokens[j],
                                   "top1": d.top1[j], "top_k": self.options.top_k,
                                   "topk": d.topk_ids[j]
                                   if d.topk_ids.shape[-1] >= self.options.top_k else None,
                                   "logits": d.logits[j] if d.logits is not None else None,
                                   "n": len(out[i].token_ids),
                                   "confidence": None if d.confidence is None
                                   else d.confidence[j]})
                if d.confidence is None and self.drafter.confidence is not None:
                    self.trace[-1]["confidence_inputs"] = (
                        d.hidden[j], None if d.markov_z is None else d.markov_z[j], d.logits[j])
        return out

    def finish_trace(self) -> None:
        """Fill each trace record's deferred confidence (``draft_confidence``), after
        the timed run: the fixed-length step never computes it."""
        for rec in self.trace or []:
            inputs = rec.pop("confidence_inputs", None)
            if inputs is not None:
                rec["confidence"] = draft_confidence(self.drafter, *inputs)


class DFlashProposer(BlockDraftProposer):
    """``dflash``: independent top-1 per block position."""

    name = "dflash"
