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
    head's) own argmax per position; topk_ids: [B, n, K] its top-K candidates
    (K = 1 when only top-1 was asked for); confidence: [B, n] calibrated
    P(accept i | prefix accepted), or None (no confidence head, or deferred:
    ``draft_confidence(model, hidden, markov_z, logits)`` gives it later);
    logits: [B, n, V] the position logits the candidates come from (float), for
    traces that rank them later; hidden: [B, n, H] the draft positions' hidden
    states; markov_z: [B, n, r] the Markov head's features, or None."""

    tokens: torch.Tensor
    top1: torch.Tensor
    topk_ids: torch.Tensor
    confidence: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    markov_z: torch.Tensor | None = None


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (int64, first maximum on ties, as torch's), taken by numpy on
    a CPU tensor: 6 us instead of 70 us for [7, 4096] on one thread, the same
    indices. x: [..., V] -> [...] on x's device."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.argmax(-1)


def calibrated(model, conf_logit: torch.Tensor) -> torch.Tensor:
    cfg = model.config
    return torch.sigmoid(cfg.calib_a * conf_logit.float() + cfg.calib_b)


@torch.no_grad()
def draft_confidence(model, hidden: torch.Tensor, markov_z: torch.Tensor | None,
                     logits: torch.Tensor) -> torch.Tensor:
    """DSpark's calibrated confidence (arXiv 2607.05147, Sec. 3.3) of drafted
    positions: hidden [..., n, H], markov_z [..., n, r] or None, logits [..., n, V]
    (a ``BlockDraft``'s fields) -> [..., n] P(accept i | prefix accepted)."""
    return calibrated(model, model.confidence(hidden, markov_z, logits))


@torch.no_grad()
def draft_block(model, h: torch.Tensor, anchor_ids: torch.Tensor, top_k: int = 16,
                use_selector: bool | None = None, confidence: bool = True,
                computed: tuple | None = None) -> BlockDraft:
    """Draft one block per row.

    model: a ``BlockDrafter``; h: [B, bs, H] its block hidden states (position
    0 is the anchor); anchor_ids: [B]. use_selector: None = as configured.
    confidence: run the confidence head now (when the model has one); False
    defers it (``draft_confidence`` on the result's fields): a fixed-length
    proposer never reads it, and a trace computes it outside the timed step.
    computed: (hidden [B, bs - 1, H], logits [B, bs - 1, V], top1 [B, bs - 1], topk
    indices, values [B, bs - 1, top_k] or None[, (tokens [B, bs - 1], Markov features
    [B, bs - 1, r] or None)]) of the draft positions, already computed (the C block call,
    ``layer_kernel.BlockDraftCall``; h is then None): the LM head, argmax, top-k and, with
    the sixth item, the selector's or Markov head's walk (the logits then corrected) are
    not run again.
    Returns a ``BlockDraft`` over the bs - 1 draft positions.
    """
    logits = top1 = walked = None
    if computed is not None:
        hd, logits, top1, ki, kv = computed[:5]
        walked = computed[5] if len(computed) > 5 else None
    else:
        hd = h[:, 1:]
    use_sel = model.selector is not None if use_selector is None else use_selector
    if use_sel and model.selector is None:
        raise ValueError("use_selector=True but this drafter has no trained path selector")
    conf = None
    if model.markov is not None:
        return _markov_draft(model, hd, anchor_ids, top_k, confidence, logits, walked)
    if logits is None:
        logits = model.lm_logits(hd)  # [B, n, V]
    if top_k <= 1 and not use_sel:  # plain top-1 drafting: skip the top-k sort
        top1 = argmax_last(logits) if top1 is None else top1
        if confidence and model.confidence is not None:
            conf = draft_confidence(model, hd, None, logits)
        return BlockDraft(top1, top1, top1[..., None], conf, logits, hd)
    if computed is not None and ki is not None and ki.shape[-1] == top_k:
        top = torch.return_types.topk((kv, ki))
    else:
        top = logits.topk(top_k, dim=-1)
    top1 = top.indices[..., 0]
    if use_sel:
        # The walk only compares candidates of the same position, so their log-probs
        # may be shifted by any per-position constant: the top-1's logit instead of
        # logsumexp over V (one [B, n, K] subtraction instead of six passes over V;
        # the shifted values stay small, so a bf16 drafter keeps their precision).
        logp = top.values - top.values[..., :1]
        sel = model.selector
        tokens = walked[0] if walked is not None else sel.walk(
            hd, logp.to(hd.dtype), top.indices, anchor_ids, model.embed,
            model.vocab_table("selector", sel.cand, sel.right, sel.left))
    else:
        tokens = top1
    if confidence and model.confidence is not None:
        conf = draft_confidence(model, hd, None, logits)
    return BlockDraft(tokens, top1, top.indices, conf, logits, hd)


def _markov_draft(model, hd: torch.Tensor, anchor_ids: torch.Tensor, top_k: int,
                  confidence: bool, logits: torch.Tensor | None, walked: tuple | None
                  ) -> BlockDraft:
    """``draft_block`` for a drafter with a Markov head (DSpark, arXiv 2607.05147, Sec.
    3.2): logits_i = lm_head(h_i + U z_i) = base_i + z_i (W_lm U)^T, one batched LM head
    (``logits``: the base logits when already computed) then a rank-r vocabulary update
    per step of the left-to-right walk; ``walked`` (tokens, z): the C call walked already
    and ``logits`` are the corrected ones."""
    if walked is not None:
        tokens, zs = walked
    else:
        base = model.lm_logits(hd) if logits is None else logits  # [B, n, V]
        tokens, zs, logits = markov_walk(model, hd, base, anchor_ids)
    # top-1 drafting needs no sort: the walk's tokens are the argmaxes
    topk_ids = tokens[..., None] if top_k <= 1 else logits.topk(top_k, dim=-1).indices
    conf = draft_confidence(model, hd, zs, logits) \
        if confidence and model.confidence is not None else None
    return BlockDraft(tokens, tokens, topk_ids, conf, logits, hd, zs)


# Candidate-table walks cost B x (n-1) x K x V floats; above this the sequential walk
# (n small steps over B rows) is cheaper (on a GPU; on a CPU it always is).
MARKOV_TABLE_MAX_ELEMENTS = 1 << 22
MARKOV_CANDIDATES = 16


@torch.no_grad()
def markov_walk(model, hd: torch.Tensor, base: torch.Tensor, anchor_ids: torch.Tensor,
                candidates: int = MARKOV_CANDIDATES, max_elements: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DSpark's left-to-right Markov walk (arXiv 2607.05147, Sec. 3.2), batched over rows.

    logits_i = base_i + z_i (W_lm U)^T with z_i = silu(P e(prev_i) + C h_i) and
    prev_i the argmax at i - 1 (the anchor at 0). hd: [B, n, H] block hidden
    states; base: [B, n, V] their plain LM-head logits; anchor_ids: [B].
    Returns (tokens [B, n], z [B, n, r], corrected logits [B, n, V] float).

    ``P e(v)`` comes from a [V, r] table (one gather per step). When the
    candidate table fits ``max_elements``, the walk is vectorised over the top
    ``candidates`` tokens of each position's base logits: z and the argmax for
    every (position, candidate prev) pair in one batched matmul, then a
    host-side walk that looks each step up; a row whose previous token is not
    among the candidates continues exactly, step by step, from there. The
    result is the sequential walk's (same formula per step). max_elements
    None: the table on a GPU (launches are what costs there), never on a CPU
    (there the table's K-fold FLOPs cost more than n small steps).
    """
    B, n, V = base.shape
    if max_elements is None:
        max_elements = MARKOV_TABLE_MAX_ELEMENTS if base.device.type == "cuda" else 0
    proj = model.markov_vocab_proj()  # [V, r] float
    pe = model.vocab_table("markov_prev", model.markov.prev)  # [V, r]
    zin = model.markov.hid(hd)  # [B, n, r]

    def step(prev: torch.Tensor, i: int, rows=slice(None)):
        z = F.silu(pe[prev] + zin[rows, i])
        return z, torch.addmm(base[rows, i], z.float(), proj.T)

    K = min(candidates, V)
    if n == 1 or B * (n - 1) * K * V > max_elements:
        return _markov_walk_steps(model, zin, base, anchor_ids, pe)
    z0, l0 = step(anchor_ids, 0)
    # candidates for position i's previous token: the top-K of position i-1's base
    # logits, except at i = 1 where position 0's corrected logits are exact
    cand = torch.cat([l0.topk(K, -1).indices[:, None],
                      base[:, 1:-1].topk(K, -1).indices], 1)  # [B, n-1, K]
    zc = F.silu(pe[cand] + zin[:, 1:, None])  # [B, n-1, K, r]
    lc = base[:, 1:, None] + zc.float() @ proj.T  # [B, n-1, K, V]
    nxt = lc.argmax(-1)  # [B, n-1, K]
    host = torch.cat([l0.argmax(-1), cand.flatten(), nxt.flatten()]).cpu()
    tok0 = host[:B].tolist()
    cand_h = host[B:B + cand.numel()].view(B, n - 1, K).tolist()
    nxt_h = host[B + cand.numel():].view(B, n - 1, K).tolist()
    toks, pick, miss = _table_walk(tok0, cand_h, nxt_h, n)
    idx = torch.tensor(pick, device=base.device)[..., None, None]  # [B, n-1, 1, 1]
    logits = torch.cat([l0[:, None], lc.gather(2, idx.expand(-1, -1, 1, V))[:, :, 0]], 1)
    zs = torch.cat([z0[:, None], zc.gather(2, idx.expand(-1, -1, 1, zc.shape[-1]))[:, :, 0]], 1)
    for b, i0 in miss:  # rare: finish this row exactly, one step at a time
        prev = torch.tensor([toks[b][-1]], device=base.device)
        for i in range(i0, n):
            z, li = step(prev, i, slice(b, b + 1))
            prev = li.argmax(-1)
            toks[b].append(int(prev))
            zs[b, i], logits[b, i] = z[0], li[0]
    return torch.tensor(toks, device=base.device), zs, logits


def _table_walk(tok0: list[int], cand_h: list, nxt_h: list, n: int
                ) -> tuple[list[list[int]], list[list[int]], list[tuple[int, int]]]:
    """``markov_walk``'s host-side walk over the candidate table: row b starts at
    ``tok0[b]``; at position i its previous token is looked up among ``cand_h[b][i-1]``
    (K candidates) and the argmax for that candidate, ``nxt_h[b][i-1][c]``, is taken.
    Returns (tokens per row, so far; pick [B, n-1] the candidate index per position (0
    past a miss); miss: (row, first position whose previous token is not a candidate))."""
    toks = [[t] for t in tok0]
    pick = [[0] * (n - 1) for _ in range(len(tok0))]
    miss: list[tuple[int, int]] = []
    for b, prev in enumerate(tok0):
        for i in range(1, n):
            row = cand_h[b][i - 1]
            if prev not in row:
                miss.append((b, i))
                break
            c = row.index(prev)
            pick[b][i - 1] = c
            prev = nxt_h[b][i - 1][c]
            toks[b].append(prev)
    return toks, pick, miss


@torch.no_grad()
def _markov_walk_steps(model, zin: torch.Tensor, base: torch.Tensor, anchor_ids: torch.Tensor,
                       pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``markov_walk``'s step-by-step form, few kernels per step: the logits buffer
    starts as a copy of ``base`` (one copy, position-major) and each step adds its
    rank-r update in place (``addmm_``, from ``W_lm U`` transposed once and cached:
    the few-row GEMM is ~2x faster from that layout on a CPU); the argmax is taken
    on the host (``argmax_last``) and the previous token's ``P e`` row is a gather
    of one row per batch row. zin: [B, n, r]; base: [B, n, V]; pe: [V, r].
    Returns tokens [B, n], z [B, n, r], logits [B, n, V] (the last two
    transposed views of position-major buffers)."""
    B, n, V = base.shape
    if base.device.type == "cpu":   # the walk in one C call where the library is built
        from actors.engine import layer_kernel

        got = layer_kernel.markov_walk(base, zin, pe, model.markov_vocab_proj_t(), anchor_ids)
        if got is not None:
            return got
    proj_t = model.markov_vocab_proj_t()  # [r, V] contiguous
    logits = base.transpose(0, 1).contiguous()  # [n, B, V], updated in place
    zs = zin.new_empty(n, B, zin.shape[-1])
    toks = torch.empty(n, B, dtype=torch.long, device=base.device)
    prev = anchor_ids
    one = B == 1 and base.device.type == "cpu"  # batch 1: the P e row as a view
    p0 = int(prev[0]) if one else 0
    for i in range(n):
        pe_prev = pe[p0:p0 + 1] if one else pe.index_select(0, prev)
        z = torch.add(pe_prev, zin[:, i], out=zs[i])
        F.silu(z, inplace=True)
        logits[i].addmm_(z.float(), proj_t)
        prev = toks[i] = argmax_last(logits[i])
        if one:
            p0 = int(prev[0])
    return toks.T, zs.transpose(0, 1), logits.transpose(0, 1)


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
