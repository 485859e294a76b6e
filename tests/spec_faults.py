"""Test doubles for drafter faults (test-only): a proposer wrapper that injects one
fault kind into one request's drafts, and a tie-aware greedy comparison.

``FaultyProposer`` wraps a built engine's proposer (``engine.proposer = FaultyProposer(...)``,
restored by the test); it delegates everything else to the real proposer, so the
other requests of the batch draft exactly as before.
"""

from __future__ import annotations

import time

import torch

from actors.engine.types import DraftProposal

# fault kind -> the reason the engine must record for the degraded request
FAULTS = {
    "raise": "drafter_error",          # propose raises whenever the victim is in the batch
    "garbage_ids": "invalid_draft",    # the victim's draft holds out-of-vocabulary ids
    "nan_q": "invalid_draft",          # the victim's q is NaN
    "bad_shape": "invalid_draft",      # the victim's q has the wrong shape
    "too_many": "invalid_draft",       # one token more than max_draft
    "wrong_count": "invalid_draft",    # the victim's proposal is missing from the result list
    "deadline": "draft_deadline",      # the call sleeps past draft_deadline_ms
    "observe_raise": "drafter_error",  # observe_target raises for the victim
    "admit_raise": "drafter_error",    # add_request raises for the victim (degraded from the start)
}


class FaultyProposer:
    """Delegates to ``inner``; from the victim's ``after``-th+1 propose (or observe)
    call on, injects ``fault`` (one of FAULTS) into what concerns ``victim``
    (``"*"``: every call, with fault "raise" only: a drafter broken for everyone)."""

    def __init__(self, inner, victim: str, fault: str, after: int = 2, sleep_s: float = 0.0):
        assert fault in FAULTS, fault
        self.inner, self.victim, self.fault, self.after, self.sleep_s = \
            inner, victim, fault, after, sleep_s
        self.propose_calls = 0
        self.observe_calls = 0
        self.injected = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_request(self, request_id, prompt_ids):
        if self.fault == "admit_raise" and request_id == self.victim:
            self.injected += 1
            raise RuntimeError("injected add_request fault")
        return self.inner.add_request(request_id, prompt_ids)

    def observe_target(self, request_id, start, token_ids, aux_hidden):
        if self.fault == "observe_raise" and request_id == self.victim:
            self.observe_calls += 1
            if self.observe_calls > self.after:
                self.injected += 1
                raise RuntimeError("injected observe_target fault")
        return self.inner.observe_target(request_id, start, token_ids, aux_hidden)

    def propose(self, batch):
        ids = [b.request_id for b in batch]
        hit = self.victim == "*" or self.victim in ids   # "*": the whole drafter is broken
        if not hit or self.fault in ("observe_raise", "admit_raise"):
            return self.inner.propose(batch)
        self.propose_calls += 1
        if self.propose_calls <= self.after:
            return self.inner.propose(batch)
        self.injected += 1
        if self.fault == "raise":
            raise RuntimeError("injected propose fault")
        out = list(self.inner.propose(batch))
        j = ids.index(self.victim)
        toks = list(out[j].token_ids) or [0]
        V = self.inner.target.config.vocab_size
        if self.fault == "garbage_ids":
            out[j] = DraftProposal(token_ids=[V + 7] + toks[1:])
        elif self.fault == "nan_q":
            out[j] = DraftProposal(token_ids=toks, probs=torch.full((len(toks), V), float("nan")))
        elif self.fault == "bad_shape":
            out[j] = DraftProposal(token_ids=toks, probs=torch.full((len(toks) + 1, V), 1.0 / V))
        elif self.fault == "too_many":
            out[j] = DraftProposal(token_ids=(toks * 64)[:batch[j].max_draft + 1])
        elif self.fault == "wrong_count":
            out.pop(j)
        elif self.fault == "deadline":
            time.sleep(self.sleep_s)
        return out


def greedy_mismatch(model, prompt_ids: list[int], got: list[int], ref: list[int],
                    tie_gap: float = 1e-3) -> str | None:
    """None when ``got`` equals the autoregressive ``ref`` up to a near-tie: at the
    first differing position the target's top-2 logits (fp32, a fresh forward of
    prompt + ref[:i]) are within ``tie_gap`` (either token is a valid argmax; the
    sequences legitimately part there). Otherwise a message describing the violation."""
    n = min(len(got), len(ref))
    i = next((j for j in range(n) if got[j] != ref[j]), None)
    if i is None:
        if len(got) == len(ref):
            return None
        return f"length {len(got)} != {len(ref)} with an equal prefix"
    with torch.inference_mode():
        lg = model(torch.tensor([prompt_ids + ref[:i]])).logits[0, -1].float()
    top = torch.topk(lg, 2).values
    gap = float(top[0] - top[1])
    if gap < tie_gap and int(got[i]) in torch.topk(lg, 2).indices.tolist():
        return None
    return f"position {i}: got {got[i]}, autoregressive {ref[i]} (top-2 logit gap {gap:.2e})"
