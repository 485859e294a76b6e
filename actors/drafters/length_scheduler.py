"""DSpark's hardware-aware verification-length scheduler (arXiv 2607.05147, Sec. 4).

Each step, every running request has a drafted block and, from the
confidence head, the survival probabilities ``s_j = P(first j drafts all
accepted)``. Verifying ``L_r`` drafts of request r costs ``L_r`` extra
verification tokens in the batched target forward and is expected to emit
``1 + sum_{j<=L_r} s_j`` tokens. The scheduler picks the lengths that
maximise expected emitted tokens per unit of step time,
``sum_r E[emitted_r] / cost(sum_r (1 + L_r))``, where ``cost`` is the step-time
curve profiled on the target at start-up. Draft tokens are admitted in order
of survival (the most likely to be accepted first), so the objective is
``E[accepted] x throughput(batch tokens)`` evaluated along that order and the
best prefix wins.

The decision is non-anticipating: its inputs are the drafter's confidences
and the cost curve, never the target's output for the drafted tokens.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch


class StepCostCurve:
    """Step time (ms) vs verification tokens in the step; piecewise linear,
    non-decreasing, extrapolated linearly past the last profiled point."""

    def __init__(self, tokens, ms):
        order = np.argsort(tokens)
        self.tokens = np.asarray(tokens, dtype=np.float64)[order]
        self.ms = np.maximum.accumulate(np.asarray(ms, dtype=np.float64)[order])
        if len(self.tokens) < 2 or self.tokens[0] < 1:
            raise ValueError("a step-cost curve needs >= 2 points with tokens >= 1, got "
                             f"{list(zip(self.tokens, self.ms))}")

    def __call__(self, tokens):
        t = np.asarray(tokens, dtype=np.float64)
        slope = (self.ms[-1] - self.ms[-2]) / max(self.tokens[-1] - self.tokens[-2], 1e-9)
        inside = np.interp(t, self.tokens, self.ms)
        return np.where(t > self.tokens[-1], self.ms[-1] + slope * (t - self.tokens[-1]), inside)

    def to_list(self) -> list[list[float]]:
        return [[float(t), round(float(m), 4)] for t, m in zip(self.tokens, self.ms)]

    @classmethod
    @torch.no_grad()
    def profile(cls, target, max_tokens: int, max_rows: int, ctx_len: int = 64,
                repeats: int = 3) -> "StepCostCurve":
        """Time target verification forwards at a ladder of batch token counts.

        Rows = min(tokens, max_rows), each with ``ceil(tokens / rows)`` new tokens
        on ``ctx_len`` cached ones (the shape of a decode step). Median of
        ``repeats`` after one warm-up; a few hundred ms on the embedded target.
        """
        from actors.engine.kv_cache import KVCache
        from actors.engine.model import BatchMeta

        dev = target.device
        ladder = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, max_tokens} & set(
            range(1, max(2, max_tokens) + 1)))
        if len(ladder) < 2:
            ladder = [1, 2]
        ms = []
        for t in ladder:
            rows = max(1, min(t, max_rows))
            q = math.ceil(t / rows)
            cache = KVCache(target.config, rows, ctx_len + q, device=dev,
                            dtype=target.lm_head.weight.dtype)
            meta = BatchMeta(torch.arange(rows, device=dev),
                             torch.full((rows,), ctx_len, device=dev), ctx_len + q)
            ids = torch.randint(0, target.config.vocab_size, (rows, q), device=dev)
            times = []
            for i in range(repeats + 1):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                target(ids, cache=cache, meta=meta)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    times.append((time.perf_counter() - t0) * 1e3)
            ms.append(float(np.median(times)))
        return cls(ladder, ms)


def schedule_lengths(survival: list[np.ndarray], cost: StepCostCurve,
                     other_tokens: int = 0) -> list[int]:
    """Verification length per request.

    survival[r]: [m_r] prefix survival probabilities of request r's drafts
    (m_r = most drafts it may verify; made non-increasing here). other_tokens:
    verification tokens already in the step from elsewhere (e.g. prefill).
    Returns L_r in 0..m_r maximising expected emitted tokens per ms.
    """
    B = len(survival)
    if B == 0:
        return []
    items = []  # (survival, request, index): admission order = survival desc
    for r, s in enumerate(survival):
        s = np.minimum.accumulate(np.clip(np.asarray(s, dtype=np.float64), 0.0, 1.0))
        items.extend((-float(p), r, j) for j, p in enumerate(s))
    items.sort()
    gains = np.array([-it[0] for it in items])
    k = np.arange(len(items) + 1)
    emitted = B + np.concatenate([[0.0], np.cumsum(gains)])
    rate = emitted / cost(other_tokens + B + k)
    best = int(np.argmax(rate))
    lengths = [0] * B
    for _, r, _j in items[:best]:
        lengths[r] += 1
    return lengths
