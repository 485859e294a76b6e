"""Turning a block's hidden states into draft tokens, per method.

- DFlash (arXiv 2602.06036, Sec. 3.3): independent top-1 at every position.
- DFlash 2 ("Keep Drafting Parallel"): top-k candidates per position, path
  chosen by the pairwise selector walking from the anchor.
- DSpark (arXiv 2607.05147, Sec. 3.2-3.3): the Markov head corrects each
  position from the previously drafted token (a left-to-right walk over one
  parallel forward), and the confidence head gives each position's
  calibrated acceptance probability given an accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockDraft:
    """tokens: [B, n] the drafted path; top1: [B, n] the backbone's (or Markov
    head's) own argmax per position; topk_ids: [B, n, K] its top-K candidates;
    confidence: [B, n] calibrated P(accept i | prefix accepted), or None."""

    tokens: torch.Tensor
    top1: torch.Tensor
    topk_ids: torch.Tensor
    confidence: torch.Tensor | None = None


def calibrated(model, conf_logit: torch.Tensor) -> torch.Tensor:
    cfg = model.config
    return torch.sigmoid(cfg.calib_a * conf_logit.float() + cfg.calib_b)


@torch.no_grad()
def draft_block(model, h: torch.Tensor, anchor_ids: torch.Tensor, top_k: int = 16,
                use_selector: bool | None = None) -> BlockDraft:
    """Draft one block per row.

    model: a ``BlockDrafter``; h: [B, bs, H] its block hidden states (position
    0 is the anchor); anchor_ids: [B]. use_selector: None = as configured.
    Returns a ``BlockDraft`` over the bs - 1 draft positions.
    """
    hd = h[:, 1:]
    n = hd.shape[1]
    use_sel = model.selector is not None if use_selector is None else use_selector
    if use_sel and model.selector is None:
        raise ValueError("use_selector=True but this drafter has no trained path selector")
    conf = None
    if model.markov is not None:
        # logits_i = lm_head(h_i + U z_i) = base_i + z_i (W_lm U)^T: one batched LM head,
        # then a rank-r vocabulary update per step of the left-to-right walk.
        base = model.lm_logits(hd)  # [B, n, V]
        proj = model.markov_vocab_proj()  # [V, r]
        zin = model.markov.hid(hd)  # [B, n, r]
        prev, toks, zs, logits = anchor_ids, [], [], []
        for i in range(n):
            z = F.silu(model.markov.prev(model.embed(prev)) + zin[:, i])
            li = base[:, i] + z.float() @ proj.T
            prev = li.argmax(-1)
            toks.append(prev)
            zs.append(z)
            logits.append(li)
        tokens = torch.stack(toks, 1)
        logits = torch.stack(logits, 1)
        topk_ids = logits.topk(top_k, dim=-1).indices
        if model.confidence is not None:
            conf = calibrated(model, model.confidence(hd, torch.stack(zs, 1), logits))
        return BlockDraft(tokens, tokens, topk_ids, conf)
    logits = model.lm_logits(hd)  # [B, n, V]
    if top_k <= 1 and not use_sel:  # plain top-1 drafting: skip the top-k sort
        top1 = logits.argmax(-1)
        conf = (calibrated(model, model.confidence(hd, None, logits))
                if model.confidence is not None else None)
        return BlockDraft(top1, top1, top1[..., None], conf)
    top = logits.topk(top_k, dim=-1)
    top1 = top.indices[..., 0]
    if use_sel:
        logp = top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
        tokens = model.selector.walk(hd, logp.to(hd.dtype), top.indices, anchor_ids, model.embed)
    else:
        tokens = top1
    if model.confidence is not None:
        conf = calibrated(model, model.confidence(hd, None, logits))
    return BlockDraft(tokens, top1, top.indices, conf)


def selector_loss(model, hd: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  prev_ids: torch.Tensor, valid: torch.Tensor, top_k: int) -> torch.Tensor:
    """Teacher-forced selector CE over the top-k candidates (positions whose label
    is among them). hd: [N, n, H] (detached unless training jointly); logits: [N, n, V]; labels, prev_ids,
    valid: [N, n]; prev_ids[:, i] is the true token before position i."""
    with torch.no_grad():
        top = logits.topk(top_k, dim=-1)
        hit = top.indices == labels[..., None]
        keep = valid & hit.any(-1)
    logp = logits.gather(-1, top.indices) - torch.logsumexp(logits, dim=-1, keepdim=True)
    if not keep.any():
        return logits.new_zeros(())
    s = model.selector.scores(hd[keep], logp[keep].to(hd.dtype), model.embed(top.indices[keep]),
                              model.embed(prev_ids[keep]))
    return F.cross_entropy(s.float(), hit[keep].float().argmax(-1))
