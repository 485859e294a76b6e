"""``autoregressive``: the proposer that proposes nothing (the speedup baseline).

Every step then verifies exactly one token per request (the bonus token), so
the same batched loop does plain autoregressive decoding.
"""

from __future__ import annotations

from actors.engine.types import DraftProposal, ProposeInput
from actors.proposers.base import Proposer


class AutoregressiveProposer(Proposer):
    """No drafts: tau = 1 by construction."""

    name = "autoregressive"
    default_num_speculative_tokens = 0

    def propose(self, batch: list[ProposeInput]) -> list[DraftProposal]:
        return [DraftProposal(token_ids=[]) for _ in batch]
