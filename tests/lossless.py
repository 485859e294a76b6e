"""Shared check that speculative sampling is lossless (docs/design.md, "Lossless verification")."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from actors.engine.llm_engine import LLMEngine, run_requests
from actors.engine.sampling import process_logits
from actors.engine.types import SamplingParams

PROMPT = "for i in range(10):\n    x = x + i\nfor i in range(10):\n    x ="
PARAMS = dict(temperature=0.9, top_k=3, max_tokens=4, ignore_eos=True)


def exact_joint(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams,
                depth: int, masked: int | None = None) -> dict[tuple[int, ...], float]:
    """Exact target probability of every ``depth``-token continuation under
    ``params`` (a small support thanks to top_k); ``masked``: a token id whose logit
    is -inf at every position first (min_tokens' EOS mask)."""
    probs = {}

    def rec(prefix, pr):
        if len(prefix) == depth:
            probs[tuple(prefix)] = pr
            return
        with torch.inference_mode():
            lg = engine.model(torch.tensor([prompt_ids + prefix])).logits[0, -1].float()
        if masked is not None:
            lg = lg.clone()
            lg[masked] = float("-inf")
        p = process_logits(lg, params)
        for t in torch.nonzero(p > 0).flatten().tolist():
            rec(prefix + [t], pr * float(p[t]))

    rec([], 1.0)
    return probs


def assert_sampling_lossless(engine: LLMEngine, n: int = 2000, seed0: int = 1000,
                             params: dict | None = None, masked: int | None = None) -> float:
    """``n`` seeded requests; the joint of the first three emitted tokens (the
    prefill token, then the first two speculative positions) must match the
    target's exact distribution (chi-square, p > 0.001). Returns the p-value.
    params: SamplingParams fields instead of PARAMS; masked: a token the target may
    not emit at those positions (min_tokens' EOS: the engine must mask it too)."""
    params = PARAMS if params is None else params
    ids = engine.tokenizer(PROMPT)["input_ids"]
    out = run_requests(engine, [(f"s{i}", ids, SamplingParams(seed=seed0 + i, **params))
                                for i in range(n)], batch_size=64)
    drafted = sum(o["stats"].num_draft_tokens for o in out.values())
    accepted = sum(o["stats"].num_accepted_tokens for o in out.values())
    # the verifier must have seen plenty of both outcomes for the test to mean anything
    assert accepted >= 200 and drafted - accepted >= 200, (drafted, accepted)
    exact = exact_joint(engine, ids, SamplingParams(**params), 3, masked)
    counts = {k: 0 for k in exact}
    for o in out.values():
        counts[tuple(o["token_ids"][:3])] += 1  # KeyError = a token outside the support
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k, pr in exact.items():  # merge cells with expected count < 5
        if pr * n >= 5:
            obs.append(counts[k])
            exp.append(pr * n)
        else:
            rest_o += counts[k]
            rest_e += pr * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    scale = sum(obs) / sum(exp)
    stat, pval = chisquare(obs, [e * scale for e in exp])
    assert len(obs) >= 6
    assert pval > 0.001, (stat, pval)
    return float(pval)
