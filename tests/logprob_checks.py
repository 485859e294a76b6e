"""Shared checks for the logprobs / min_tokens tests (engine and HTTP).

A greedy comparison must tell a numerical tie from a lossless violation: at the
first position where two outputs differ, the target's two candidates must be
within ``TIE_LOGPROB`` of each other (fp32 round-off between differently shaped
forwards is ~1e-6), else it is a real divergence.
"""

from __future__ import annotations

import math

ALL_STRATEGIES = ["autoregressive", "draft_model", "ngram", "dflash", "dflash2", "dspark"]
LOGPROB_TOL = 1e-4    # |logprob difference| allowed between strategies (fp32 forwards)
TIE_LOGPROB = 1e-4    # two candidates this close at a divergence are a numerical tie


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def same_or_tie(ref_ids: list[int], ref_top: list[dict[int, float]], ids: list[int]) -> int:
    """How many leading tokens of ``ids`` to compare with the reference: all when equal;
    up to the first divergence when it is a numerical tie (the other token is in the
    reference's top at that position within TIE_LOGPROB of the chosen one). Raises
    AssertionError on a real divergence. ref_top[i]: {token_id: logprob} at position i."""
    i = first_divergence(ref_ids, ids)
    if i is None:
        return len(ids)
    if i >= min(len(ref_ids), len(ids)):
        raise AssertionError(f"lengths differ ({len(ref_ids)} vs {len(ids)}) with equal prefix")
    top = ref_top[i]
    chosen = top.get(ref_ids[i])
    other = top.get(ids[i])
    assert chosen is not None and other is not None and abs(chosen - other) < TIE_LOGPROB, (
        f"greedy divergence at {i}: reference {ref_ids[i]} ({chosen}) vs {ids[i]} ({other}); "
        "not a numerical tie")
    return i


def check_greedy_entry(token_id: int, logprob: float, top: list[tuple[int, float]], n: int):
    """One greedy position: n top entries, sorted, the chosen token their argmax (up
    to a tie) and its logprob equal to its own entry there."""
    assert len(top) == n, (len(top), n)
    vals = [v for _, v in top]
    assert vals == sorted(vals, reverse=True)
    assert logprob <= 0 and math.isfinite(logprob)
    if n:
        assert vals[0] - logprob < TIE_LOGPROB, (token_id, logprob, top[0])
        own = dict(top).get(token_id)
        if own is not None:
            assert abs(own - logprob) < 1e-6
