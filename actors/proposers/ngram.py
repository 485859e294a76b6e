"""``ngram``: prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding";
vLLM's ``ngram`` speculative method).

The last n tokens of the sequence (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are searched for earlier in the same sequence (prompt +
output); the tokens that followed the most recent earlier match are proposed.
The proposal is deterministic, so the verifier treats q as one-hot.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from pydantic import Field, model_validator

from actors.engine.types import DraftProposal, ProposeInput
from actors.proposers.base import Proposer, ProposerOptions


class NgramOptions(ProposerOptions):
    prompt_lookup_min: int = Field(2, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _order(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the most recent earlier occurrence of the
    longest suffix n-gram (max_n..min_n) of ``tokens`` [L] int; [] if none."""
    L = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = tokens[L - n:]
        windows = sliding_window_view(tokens[:L - 1], n)  # window i covers i..i+n-1
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Prompt-lookup proposer; options: ``prompt_lookup_min``, ``prompt_lookup_max``."""

    name = "ngram"
    Options = NgramOptions

    def propose(self, batch: list[ProposeInput]) -> list[DraftProposal]:
        o = self.options
        return [DraftProposal(token_ids=ngram_lookup(
            np.asarray(r.token_ids, dtype=np.int64), o.prompt_lookup_min, o.prompt_lookup_max,
            r.max_draft)) for r in batch]
