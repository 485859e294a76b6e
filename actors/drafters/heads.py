"""Heads on top of the block drafter backbone.

- ``PathSelector`` (DFlash 2, "Keep Drafting Parallel", path-selection
  section): keeps the top-k candidates per block position and scores a path
  with a unary term per candidate plus a low-rank bilinear compatibility of
  adjacent candidates; decoding walks greedily from the anchor.
- ``MarkovHead`` (DSpark, arXiv 2607.05147, Sec. 3.2 "sequential head"): a
  low-rank correction of each position's hidden state (hence of its
  full-vocabulary logits through the shared LM head) from the previously
  drafted token; drafting walks the block left to right.
- ``ConfidenceHead`` (DSpark Sec. 3.3): per-position acceptance probability
  conditioned on the prefix being accepted, Platt-calibrated after training.

All heads read the backbone's hidden states; embeddings of tokens come from
the target's (shared, frozen) embedding table via the caller's ``embed``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class PathSelector(nn.Module):
    """score(i, c | prev) = a * logp_i(c) + <Wq h_i, Wc e_c> + <Wl e_prev, Wr e_c>."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.query = nn.Linear(hidden, rank, bias=False)
        self.cand = nn.Linear(hidden, rank, bias=False)
        self.left = nn.Linear(hidden, rank, bias=False)
        self.right = nn.Linear(hidden, rank, bias=False)
        self.logp_scale = nn.Parameter(torch.ones(()))
        for m in (self.query, self.left):
            nn.init.zeros_(m.weight)  # start as plain top-1 (score = log-prob)

    def unary(self, h: torch.Tensor, logp: torch.Tensor, e_c: torch.Tensor) -> torch.Tensor:
        """h: [..., H]; logp: [..., K] candidate log-probs; e_c: [..., K, H] -> [..., K]."""
        return self.logp_scale * logp + (self.query(h)[..., None, :] * self.cand(e_c)).sum(-1)

    def scores(self, h, logp, e_c, e_prev) -> torch.Tensor:
        """Teacher-forced scores [..., K] with ``e_prev`` [..., H] the previous token."""
        return self.unary(h, logp, e_c) + (self.left(e_prev)[..., None, :]
                                           * self.right(e_c)).sum(-1)

    @torch.no_grad()
    def walk(self, h: torch.Tensor, logp: torch.Tensor, cand_ids: torch.Tensor,
             anchor_ids: torch.Tensor, embed, table: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy path from the anchor. h: [B, n, H]; logp, cand_ids: [B, n, K]
        (logp: candidate log-probs up to a per-position constant, which no choice
        depends on); anchor_ids: [B]; embed: ids -> vectors. Returns chosen ids [B, n].
        table: optional [V, 3r] ``cand | right | left`` projections of every
        token's embedding (``BlockDrafter.vocab_table``): candidates are then
        looked up instead of embedded and projected.

        The previous token at position i is one of position i-1's candidates,
        so every pairwise score is computed up front ([B, n-1, K, K], one
        batched matmul, over all rows and candidates at once) and the walk
        itself is K-way argmaxes on the host after one transfer.
        """
        if table is not None and h.device.type == "cpu" and h.dtype == torch.float32:
            from actors.engine import layer_kernel     # the walk in one C call
            out = layer_kernel.selector_walk(h, logp, cand_ids, anchor_ids, table,
                                             self.query.weight.detach(),
                                             float(self.logp_scale))
            if out is not None:
                return out
        if table is None:
            e_c = embed(cand_ids)  # [B, n, K, H]
            u = self.unary(h, logp, e_c)  # [B, n, K]
            rc, lc = self.right(e_c), self.left(e_c)  # [B, n, K, r]
            left_anchor = self.left(embed(anchor_ids))
        else:  # rows of the [V, 3r] table: cand | right | left projections of every token
            r = self.cand.out_features
            t = table.index_select(0, cand_ids.flatten()).view(*cand_ids.shape, -1)  # [B, n, K, 3r]
            cc, rc, lc = t[..., :r], t[..., r:2 * r], t[..., 2 * r:]
            u = self.logp_scale * logp + (cc @ self.query(h)[..., None]).squeeze(-1)
            left_anchor = table[anchor_ids, 2 * r:]
        first = u[:, 0] + (left_anchor[:, None, :] * rc[:, 0]).sum(-1)
        pair = u[:, 1:, None, :] + lc[:, :-1] @ rc[:, 1:].transpose(-1, -2)  # [B, n-1, K, K]
        B, n = cand_ids.shape[:2]
        host = cand_ids.device.type == "cpu"
        if host:  # already on the host: numpy views, no copies
            first, pair = first.float().numpy(), pair.float().numpy()
        else:  # one transfer for both (the walk itself is K-way argmaxes on the host)
            both = torch.cat([first.float().flatten(), pair.float().flatten()]).cpu().numpy()
            first, pair = (both[:first.numel()].reshape(first.shape),
                           both[first.numel():].reshape(pair.shape))
        rows = np.arange(B)
        chosen = np.empty((B, n), dtype=np.int64)
        j = chosen[:, 0] = first.argmax(-1)
        for i in range(n - 1):
            j = chosen[:, i + 1] = pair[rows, i, j].argmax(-1)
        if host:
            return torch.from_numpy(np.take_along_axis(cand_ids.numpy(), chosen[..., None],
                                                       2)[..., 0])
        idx = torch.from_numpy(chosen).to(cand_ids.device)
        return cand_ids.gather(2, idx[..., None]).squeeze(-1)


class _BiasOnly(nn.Module):
    """``hid`` of a Markov head without the hidden-state term: h [..., H] -> its
    bias broadcast [..., r] (the parameter keeps the name ``hid.bias``)."""

    def __init__(self, rank: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(rank))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.bias.to(h.dtype).expand(*h.shape[:-1], self.bias.shape[0])


class MarkovHead(nn.Module):
    """h'_i = h_i + U silu(P e_prev + C h_i + b); logits_i = lm_head(h'_i).

    Rank ``r`` keeps it small (3 H r parameters); U starts at zero so the head
    starts as the plain parallel drafter. ``hidden_term=False`` drops C h_i:
    z = silu(P e_prev + b) depends on the previous token only, so the logit
    update z (W_lm U)^T is a token-only rank-r bias, vLLM 0.32's
    ``DSparkMarkovHead`` (markov_w1 = silu(P E^T + b) [V, r], markov_w2 = W_lm U
    [V, r]).
    """

    def __init__(self, hidden: int, rank: int, hidden_term: bool = True):
        super().__init__()
        self.prev = nn.Linear(hidden, rank, bias=False)
        self.hid = nn.Linear(hidden, rank) if hidden_term else _BiasOnly(rank)
        self.out = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.out.weight)

    def forward(self, h: torch.Tensor, e_prev: torch.Tensor):
        """h, e_prev: [..., H] -> (corrected hidden [..., H], features z [..., r])."""
        z = F.silu(self.prev(e_prev) + self.hid(h))
        return h + self.out(z), z


def logit_features(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [..., 3]: top-1 log-prob, top1 - top2 log-prob margin, entropy."""
    logp = F.log_softmax(logits.float(), dim=-1)
    top2 = logp.topk(2, dim=-1).values
    ent = -(logp.exp() * logp).sum(-1)
    return torch.stack([top2[..., 0], top2[..., 0] - top2[..., 1], ent], dim=-1)


class ConfidenceHead(nn.Module):
    """Logit of P(draft token i accepted | tokens < i accepted) from the position's
    hidden state, the Markov features and (``logit_features``, default) the shape of
    its own distribution. Without the logit features it is vLLM 0.32's
    ``DSparkConfidenceHead`` (``proj([h, markov_embed])``)."""

    def __init__(self, hidden: int, markov_rank: int, logit_features: bool = True):
        super().__init__()
        self.logit_features = logit_features
        self.proj = nn.Linear(hidden + markov_rank + (3 if logit_features else 0), 1)

    def forward(self, h: torch.Tensor, z: torch.Tensor | None,
                logits: torch.Tensor) -> torch.Tensor:
        """h [..., H], z [..., r] or None, logits [..., V] -> confidence logit [...]."""
        feats = [h, logit_features(logits).to(h.dtype)] if self.logit_features else [h]
        if z is not None:
            feats.insert(1, z)
        return self.proj(torch.cat(feats, dim=-1)).squeeze(-1)
