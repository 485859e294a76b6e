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
from actors.engine import memory as mem
from actors.engine.kv_cache import KVSlotPool
from actors.engine.types import DraftProposal, ProposeInput
from actors.proposers.base import Proposer, ProposerOptions
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
    """Per-request context K/V of every draft layer: ``k[l]`` is [S, KVH, T, D].

    Slots and lengths come from the shared ``KVSlotPool`` (``self.pool``): only
    committed target tokens are written, so the length only grows, except when
    the engine re-reports a position (``write`` rolls back to ``start`` first).
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, kvh: int, d: int,
                 device, dtype, room: int = 0):
        # ``room`` positions past max_len: scratch where a draft block's own K/V go
        # (``gather(room=...)``), so attention reads one buffer instead of a concatenation
        shape = (num_slots, kvh, max_len + room, d)
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
        s = self.slot(rid)
        n = kv[0][0].shape[2]
        have = self.pool.length(rid)
        if start > have:
            raise ValueError(f"observe_target for {rid!r} starts at {start} but only "
                             f"{have} positions were observed: the engine must report "
                             "every token committed to the target cache, in order")
        self.pool.rollback(rid, start)
        self.pool.append(rid, n)
        for layer, (k, v) in enumerate(kv):
            self.k[layer][s, :, start:start + n] = k[0]
            self.v[layer][s, :, start:start + n] = v[0]

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
            kv = [(k[lo:lo + len(slots), :, :C], v[lo:lo + len(slots), :, :C])
                  for k, v in zip(self.k, self.v)]
        else:
            idx = torch.tensor(slots, device=self.k[0].device)
            kv = [(k[idx, :, :C], v[idx, :, :C]) for k, v in zip(self.k, self.v)]
        return kv, lengths


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
        _, kvh, _, d = c.k[0].shape
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
        self.cache.write(request_id, start, self.drafter.context_kv(aux_hidden.to(dev)[None], pos))

    # -- drafting -----------------------------------------------------------------
    @torch.no_grad()
    def draft(self, batch: list[ProposeInput]) -> BlockDraft:
        """One batched drafter forward + decoding for every row of ``batch``."""
        dev = self.target.device
        slots = [self.cache.slot(r.request_id) for r in batch]
        bs = self.block_size
        # the block's own K/V are written into the cache's scratch past the context
        # (``ctx_room``): attention reads one buffer, no per-layer concatenation
        kv, lens = self.cache.gather(slots, [r.request_id for r in batch], room=bs)
        positions = [len(r.token_ids) - 1 for r in batch]
        pos = torch.tensor(positions, device=dev)
        anchors = torch.tensor([r.token_ids[-1] for r in batch], device=dev)
        C = kv[0][0].shape[2] - bs
        seen = [min(n, p) for n, p in zip(lens, positions)]  # strictly before the anchor
        ctx_mask = None if all(n == C for n in seen) else (   # None: every row sees all C
            torch.arange(C, device=dev)[None] < torch.tensor(seen, device=dev)[:, None])[:, None]
        h = self.drafter.block_hidden(anchors[:, None], pos[:, None], kv, ctx_mask,
                                      ctx_room=True)
        # Candidates beyond the top-1 are only needed by the selector (a trace ranks
        # the kept logits at read time, outside the timed step).
        selects = self.use_selector is not False and self.drafter.selector is not None
        top_k = self.options.top_k if selects else 1
        return draft_block(self.drafter, h, anchors, top_k, self.use_selector,
                           confidence=self.needs_confidence())

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
