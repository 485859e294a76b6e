"""The shared verifier: greedy prefix acceptance and speculative-sampling rejection.

Speculative sampling follows Leviathan et al. 2023 (arXiv 2211.17192, Alg. 1)
and Chen et al. 2023 (arXiv 2302.01318, Alg. 2): draft token x ~ q is kept with
probability min(1, p(x)/q(x)); at the first rejection a token is drawn from
normalize(max(0, p - q)); if all drafts are kept a bonus token is drawn from
p at the next position. For a deterministic proposal (top-1, path selection,
n-gram) q is one-hot, so x is kept with probability p(x) and the residual is p
with x removed. With greedy params both reduce to: accept the longest prefix
where draft == argmax p, then emit argmax p at the first mismatch.
"""

from __future__ import annotations

import torch

from actors.engine.types import SamplingParams, VerificationResult


def verify_greedy(target_argmax: list[int], draft: list[int]) -> VerificationResult:
    """Greedy acceptance.

    target_argmax: [n + 1] argmax of the target at the positions of
    ``[last token, d_1 .. d_n]``; draft: [n] proposed tokens.
    """
    n = len(draft)
    a = 0
    while a < n and draft[a] == target_argmax[a]:
        a += 1
    return VerificationResult(num_accepted=a, emitted=list(draft[:a]) + [target_argmax[a]])


def verify_sampling(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                    generator: torch.Generator | None) -> VerificationResult:
    """Speculative-sampling rejection (lossless for any q).

    target_probs: [n + 1, V] processed target distributions p at the positions
    of ``[last, d_1 .. d_n]``; draft: [n]; draft_probs: [n, V] the q each draft
    token was drawn from, or None (one-hot q). Uses ``generator`` for every
    uniform draw so a seeded request is reproducible.
    """
    p = target_probs.float().cpu()
    n = len(draft)
    if n:
        idx = torch.tensor(draft)
        px = p[torch.arange(n), idx]
        if draft_probs is None:
            qx = torch.ones(n)
        else:
            q = draft_probs.float().cpu()
            qx = q[torch.arange(n), idx]
        u = torch.rand(n, generator=generator)
        ok = u * qx < px  # u < p/q without dividing by q
        a = int(ok.int().cumprod(0).sum())
    else:
        a = 0
    if a < n:
        if draft_probs is None:
            residual = p[a].clone()
            residual[draft[a]] = 0.0
        else:
            residual = torch.clamp(p[a] - draft_probs[a].float().cpu(), min=0.0)
        total = residual.sum()
        # p == q exactly at this position makes rejection impossible in theory; guard
        # against round-off by falling back to p.
        dist = residual / total if total > 1e-12 else p[a]
        nxt = int(torch.multinomial(dist, 1, generator=generator))
    else:
        nxt = int(torch.multinomial(p[n], 1, generator=generator))
    return VerificationResult(num_accepted=a, emitted=list(draft[:a]) + [nxt])


def verify(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator | None) -> VerificationResult:
    """Dispatch on ``params``: logits [n + 1, V] raw target logits."""
    from actors.engine.sampling import process_logits

    if params.greedy:
        return verify_greedy(logits.argmax(-1).tolist(), draft)
    return verify_sampling(process_logits(logits, params), draft, draft_probs, generator)
