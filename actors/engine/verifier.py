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


def verify_batch(logits: torch.Tensor | list[torch.Tensor], lens: list[int],
                 drafts: list[list[int]],
                 draft_probs: list[torch.Tensor | None], params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[VerificationResult]:
    """Verify a whole batch with ONE device-to-host transfer.

    logits: [B, Q, V] raw target logits of the padded verification forward
    (row b's positions ``0 .. lens[b]-1`` are ``[last, d_1 .. d_n]``, so
    ``lens[b] == len(drafts[b]) + 1``), or a list of B per-row [>= lens[b], V]
    tensors (views of that forward's output); drafts[b]: [n_b] proposed tokens;
    draft_probs[b]: [n_b, V] q or None (one-hot q); params / generators: per
    row. Greedy rows need only the argmax, sampled rows their processed p
    (and q); everything crosses to the host packed in one float32 tensor, so
    on a GPU the step synchronises once instead of once per request. The
    per-row acceptance is then exactly ``verify_greedy`` / ``verify_sampling``
    (same draws from each request's generator, so a seeded request gives the
    same tokens as the per-row path). Raises ValueError on inconsistent lens.
    """
    from actors.engine.sampling import process_logits

    B = len(logits)
    if not (len(lens) == len(drafts) == len(draft_probs) == len(params) == len(generators) == B):
        raise ValueError(f"verify_batch: {B} logit rows but lens/drafts/draft_probs/params/"
                         f"generators have {len(lens)}/{len(drafts)}/{len(draft_probs)}/"
                         f"{len(params)}/{len(generators)}")
    for b, (n, d) in enumerate(zip(lens, drafts)):
        if n != len(d) + 1:
            raise ValueError(f"verify_batch: row {b} has {n} logit positions for "
                             f"{len(d)} draft tokens; expected {len(d) + 1}")
    V = logits[0].shape[-1] if B else 0
    if B and all(p.greedy for p in params) and all(
            lg.device.type == "cpu" and lg.dtype == torch.float32 for lg in logits):
        # greedy on the host already: numpy argmaxes of views (first maximum on ties,
        # as torch's), no packing or dtype round trip (~3x fewer microseconds per row)
        return [verify_greedy(lg[:n].numpy().argmax(-1).tolist(), d)
                for lg, n, d in zip(logits, lens, drafts)]
    if isinstance(logits, torch.Tensor):
        Q = logits.shape[1]
        parts = [logits.argmax(-1).flatten().float()]  # ids < 2**24 are exact in float32
        starts = [b * Q for b in range(B)]
    else:  # per-row tensors: per-row argmaxes, still one transfer
        parts = [torch.cat([lg[:n].argmax(-1) for lg, n in zip(logits, lens)]).float()]
        starts = [sum(lens[:b]) for b in range(B)]
    layout = []  # per sampled row: (offset of p, offset of q or -1)
    off = parts[0].numel()
    for b in range(B):
        if params[b].greedy:
            layout.append(None)
            continue
        p = process_logits(logits[b][:lens[b]], params[b])
        parts.append(p.flatten())
        po = off
        off += p.numel()
        qo = -1
        if draft_probs[b] is not None and len(drafts[b]):
            parts.append(draft_probs[b].float().flatten())
            qo = off
            off += draft_probs[b].numel()
        layout.append((po, qo))
    host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu()
    argmax = host[:parts[0].numel()].long().tolist()
    out = []
    for b in range(B):
        if layout[b] is None:
            out.append(verify_greedy(argmax[starts[b]:starts[b] + lens[b]], drafts[b]))
            continue
        po, qo = layout[b]
        n = lens[b]
        p = host[po:po + n * V].view(n, V)
        q = None if qo < 0 else host[qo:qo + (n - 1) * V].view(n - 1, V)
        out.append(verify_sampling(p, drafts[b], q, generators[b]))
    return out
