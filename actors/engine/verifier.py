"""The shared verifier: greedy prefix acceptance and speculative-sampling rejection.

Speculative sampling follows Leviathan et al. 2023 (arXiv 2211.17192, Alg. 1)
and Chen et al. 2023 (arXiv 2302.01318, Alg. 2): draft token x ~ q is kept with
probability min(1, p(x)/q(x)); at the first rejection a token is drawn from
normalize(max(0, p - q)); if all drafts are kept a bonus token is drawn from
p at the next position. For a deterministic proposal (top-1, path selection,
n-gram) q is one-hot, so x is kept with probability p(x) and the residual is p
with x removed. With greedy params both reduce to: accept the longest prefix
where draft == argmax p, then emit argmax p at the first mismatch.

Two more accept rules, as vLLM 0.32's ``speculative_config.rejection_sample_method``:

- ``synthetic`` (forced acceptance, ``verify_synthetic``): the draft and the
  target's distributions are real, only the accept decision is drawn: draft i
  (0-based) is kept with the *conditional* probability c_i = r_i / r_{i-1} of the
  per-position unconditional rates r (``configs.serve_config``), stopping at the
  first refusal, so P(at least i+1 accepted) = r_i and the mean tokens per verify
  step is 1 + sum(r). The accepted tokens are the drafts (vLLM's rule), the
  correction / bonus token is the target's (argmax, or a draw from the residual
  max(0, p - q) / p as in standard sampling). The text is not the target's.
- ``block`` (block verification, Sun et al. 2024, arXiv 2403.10444, Alg. 2,
  ``verify_block``): the draft block is judged jointly; lossless (the output has
  the target's distribution) and in expectation at least as many tokens per step
  as token-by-token verification. With greedy params it is the greedy rule.
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


def _correction(p: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, a: int,
                generator: torch.Generator | None, scale: float = 1.0) -> int:
    """The target's token after ``a`` accepted drafts: a draw from the residual
    normalize(max(0, scale * p[a] - q[a])) when a < n (q one-hot at draft[a] when
    ``draft_probs`` is None), else the bonus token from p[n]. scale: block
    verification's p_tau (1 for token-by-token rejection). p: [n + 1, V]."""
    n = len(draft)
    if a >= n:
        return int(torch.multinomial(p[n], 1, generator=generator))
    if draft_probs is None:
        residual = p[a].clone()
        residual[draft[a]] = 0.0
    else:
        residual = torch.clamp(scale * p[a] - draft_probs[a].float().cpu(), min=0.0)
    total = residual.sum()
    # p == q exactly at this position makes rejection impossible in theory; guard
    # against round-off by falling back to p.
    dist = residual / total if total > 1e-12 else p[a]
    return int(torch.multinomial(dist, 1, generator=generator))


def synthetic_num_accepted(n: int, conditional_rates: list[float],
                           generator: torch.Generator | None) -> int:
    """Forced acceptance count of an n-token draft: draft i is kept when u_i <
    conditional_rates[i] (u_i uniform on [0, 1), ``n`` draws from ``generator``),
    stopping at the first refusal; positions past len(conditional_rates) are
    refused (vLLM's -1 padding). Returns 0..n."""
    if n == 0:
        return 0
    u = torch.rand(n, generator=generator).tolist()
    a = 0
    while a < n and a < len(conditional_rates) and u[a] < conditional_rates[a]:
        a += 1
    return a


def verify_synthetic(target: list[int] | torch.Tensor, draft: list[int],
                     draft_probs: torch.Tensor | None, conditional_rates: list[float],
                     generator: torch.Generator | None, greedy: bool) -> VerificationResult:
    """Forced acceptance (vLLM's ``rejection_sample_method: synthetic``).

    target: greedy: [n + 1] target argmax at ``[last, d_1 .. d_n]``; sampled: [n + 1, V]
    processed target p. conditional_rates: [k] c_i (``unconditional_to_conditional_rates``).
    A draft of n < k tokens (a block drafter that verifies fewer, the end of a request,
    a k-per-batch-size step) is judged on its n positions only, with the rates of those
    positions (vLLM pads the missing ones with -1, which are refused): its expected
    acceptance is 1 + sum(r[:n]), less than the set length. Accepted tokens are the
    drafts; the next is the target's (argmax at the first refusal, or the residual /
    bonus draw of standard sampling)."""
    n = len(draft)
    a = synthetic_num_accepted(n, conditional_rates, generator)
    if greedy:
        nxt = int(target[a])
    else:
        nxt = _correction(target.float().cpu(), draft, draft_probs, a, generator)
    return VerificationResult(num_accepted=a, emitted=list(draft[:a]) + [nxt])


def block_num_accepted(p: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                       u: torch.Tensor) -> tuple[int, float]:
    """Block verification's accepted length (Sun et al. 2024, arXiv 2403.10444, Alg. 2).

    p: [n + 1, V] target distributions at ``[last, d_1 .. d_n]``; draft: [n]; draft_probs:
    [n, V] q (None: one-hot, a deterministic proposal); u: [n] uniforms. With
    p_0 = 1, p_i = min(1, p_{i-1} * p(d_i) / q(d_i)); h_i = rho_i / (rho_i + 1 - p_i)
    with rho_i = sum_x max(0, p_i * p[i](x) - q[i](x)) for i < n (one-hot q: rho_i =
    p_i * (1 - p[i](d_{i+1}))), h_n = p_n; tau = the last i with u_i < h_i (0 if none).
    Returns (tau, p_tau): the residual at tau is max(0, p_tau * p[tau] - q[tau])."""
    n = len(draft)
    idx = torch.tensor(draft, dtype=torch.long)
    px = p[torch.arange(n), idx]
    q = None if draft_probs is None else draft_probs.float().cpu()
    qx = torch.ones(n) if q is None else q[torch.arange(n), idx]
    tau, p_tau, cum = 0, 1.0, 1.0
    for i in range(1, n + 1):
        ratio = float(px[i - 1]) / float(qx[i - 1]) if float(qx[i - 1]) > 0 else 0.0
        cum = min(cum * ratio, 1.0)
        if i < n:
            if q is None:
                rho = cum * (1.0 - float(px[i]))
            else:
                rho = float(torch.clamp(cum * p[i] - q[i], min=0.0).sum())
            denom = rho + 1.0 - cum
            h = rho / denom if denom > 0.0 else 1.0
        else:
            h = cum
        if float(u[i - 1]) < h:
            tau, p_tau = i, cum
    return tau, p_tau


def verify_block(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                 generator: torch.Generator | None) -> VerificationResult:
    """Block verification (lossless; Sun et al. 2024, arXiv 2403.10444, Alg. 2; vLLM 0.32's
    ``rejection_sample_method: block``). target_probs: [n + 1, V] processed p; draft: [n];
    draft_probs: [n, V] q or None (one-hot q). Draws n uniforms then one token from
    ``generator``. Keeps d_1 .. d_tau (``block_num_accepted``), then draws from
    normalize(max(0, p_tau * p[tau] - q[tau])) (tau < n) or the bonus p[n] (tau = n)."""
    p = target_probs.float().cpu()
    n = len(draft)
    if n == 0:
        return VerificationResult(0, [int(torch.multinomial(p[0], 1, generator=generator))])
    u = torch.rand(n, generator=generator)
    tau, p_tau = block_num_accepted(p, draft, draft_probs, u)
    nxt = _correction(p, draft, draft_probs, tau, generator, scale=p_tau)
    return VerificationResult(num_accepted=tau, emitted=list(draft[:tau]) + [nxt])


def verify(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator | None,
           method: str = "standard", conditional_rates: list[float] | None = None
           ) -> VerificationResult:
    """Dispatch on ``params`` and ``method``: logits [n + 1, V] raw target logits."""
    from actors.engine.sampling import process_logits

    if method == "synthetic":
        t = logits.argmax(-1).tolist() if params.greedy else process_logits(logits, params)
        return verify_synthetic(t, draft, draft_probs, conditional_rates or [], generator,
                                params.greedy)
    if params.greedy:
        return verify_greedy(logits.argmax(-1).tolist(), draft)
    if method == "block":
        return verify_block(process_logits(logits, params), draft, draft_probs, generator)
    return verify_sampling(process_logits(logits, params), draft, draft_probs, generator)


def verify_batch(logits: torch.Tensor | list[torch.Tensor], lens: list[int],
                 drafts: list[list[int]],
                 draft_probs: list[torch.Tensor | None], params: list[SamplingParams],
                 generators: list[torch.Generator | None], method: str = "standard",
                 conditional_rates: list[float] | None = None,
                 synthetic_generator: torch.Generator | None = None
                 ) -> list[VerificationResult]:
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
    method: "standard", "synthetic" (``verify_synthetic`` with ``conditional_rates``;
    greedy rows, which have no generator of their own, draw their forced decisions
    from ``synthetic_generator``) or "block" (``verify_block`` for sampled rows; greedy
    rows use the greedy rule, as vLLM).
    """
    B = len(logits)
    _check_batch(B, lens, drafts, draft_probs, params, generators)
    rates = conditional_rates or []
    if B and all(p.greedy for p in params) and all(
            lg.device.type == "cpu" and lg.dtype == torch.float32 for lg in logits):
        # greedy on the host already: numpy argmaxes of views (first maximum on ties,
        # as torch's), no packing or dtype round trip (~3x fewer microseconds per row)
        if method == "synthetic":
            return [verify_synthetic(lg[:n].numpy().argmax(-1).tolist(), d, None,
                                     rates, synthetic_generator, True)
                    for lg, n, d in zip(logits, lens, drafts)]
        return [verify_greedy(lg[:n].numpy().argmax(-1).tolist(), d)
                for lg, n, d in zip(logits, lens, drafts)]
    V = logits[0].shape[-1] if B else 0
    parts, starts, layout = _pack_for_host(logits, lens, drafts, draft_probs, params)
    host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu()
    argmax = host[:parts[0].numel()].long().tolist()
    out = []
    for b in range(B):
        if layout[b] is None:
            am = argmax[starts[b]:starts[b] + lens[b]]
            out.append(verify_synthetic(am, drafts[b], None, rates, synthetic_generator, True)
                       if method == "synthetic" else verify_greedy(am, drafts[b]))
            continue
        po, qo = layout[b]
        n = lens[b]
        p = host[po:po + n * V].view(n, V)
        q = None if qo < 0 else host[qo:qo + (n - 1) * V].view(n - 1, V)
        if method == "synthetic":
            out.append(verify_synthetic(p, drafts[b], q, rates, generators[b], False))
        elif method == "block":
            out.append(verify_block(p, drafts[b], q, generators[b]))
        else:
            out.append(verify_sampling(p, drafts[b], q, generators[b]))
    return out


def _check_batch(B: int, lens: list[int], drafts: list[list[int]], draft_probs: list,
                 params: list[SamplingParams], generators: list) -> None:
    """``verify_batch``'s input check: one entry per row everywhere and
    ``lens[b] == len(drafts[b]) + 1``; raises ValueError saying which differs."""
    if not (len(lens) == len(drafts) == len(draft_probs) == len(params) == len(generators) == B):
        raise ValueError(f"verify_batch: {B} logit rows but lens/drafts/draft_probs/params/"
                         f"generators have {len(lens)}/{len(drafts)}/{len(draft_probs)}/"
                         f"{len(params)}/{len(generators)}")
    for b, (n, d) in enumerate(zip(lens, drafts)):
        if n != len(d) + 1:
            raise ValueError(f"verify_batch: row {b} has {n} logit positions for "
                             f"{len(d)} draft tokens; expected {len(d) + 1}")


def _pack_for_host(logits: torch.Tensor | list[torch.Tensor], lens: list[int],
                   drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
                   params: list[SamplingParams]
                   ) -> tuple[list[torch.Tensor], list[int], list[tuple[int, int] | None]]:
    """What ``verify_batch`` moves to the host in one transfer: (parts, starts, layout).
    parts[0]: every row's argmax as float32 (ids < 2**24 are exact), row b's from
    ``starts[b]``; then per sampled row its processed p [n_b + 1, V] and q [n_b, V]
    (when given) flattened. layout[b]: None for a greedy row, else (offset of p, offset
    of q or -1) in the concatenation of parts."""
    from actors.engine.sampling import process_logits

    B = len(logits)
    if isinstance(logits, torch.Tensor):
        Q = logits.shape[1]
        parts = [logits.argmax(-1).flatten().float()]  # ids < 2**24 are exact in float32
        starts = [b * Q for b in range(B)]
    else:  # per-row tensors: per-row argmaxes, still one transfer
        parts = [torch.cat([lg[:n].argmax(-1) for lg, n in zip(logits, lens)]).float()]
        starts = [sum(lens[:b]) for b in range(B)]
    layout: list[tuple[int, int] | None] = []
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
    return parts, starts, layout
