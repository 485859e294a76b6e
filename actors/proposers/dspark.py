"""``dspark``: DSpark (arXiv 2607.05147; deepseek-ai/DeepSpec).

A DFlash backbone drafts the block in one forward; a low-rank Markov head
corrects each position from the previously drafted token (Sec. 3.2); a
confidence head gives each position's calibrated acceptance probability
given an accepted prefix (Sec. 3.3). With ``scheduler=True`` the
verification length of every request is chosen each step by
``actors.drafters.length_scheduler.schedule_lengths`` (Sec. 4) from the prefix
survival probabilities and a step-cost curve profiled on the target when the
proposer is built (or given as ``step_cost_ms``); the decision uses only the
drafter's outputs, never the target's verdict on them (non-anticipating).
``scheduler=False`` is the fixed-length mode (as many drafts as allowed).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from actors.drafters.length_scheduler import StepCostCurve, schedule_lengths
from actors.proposers.dflash import BlockDraftProposer, DFlashOptions


class DSparkOptions(DFlashOptions):
    """scheduler: confidence-scheduled verification length (else fixed);
    step_cost_ms: [[batch tokens, ms], ...] to use instead of profiling;
    profile_ctx_len: cached tokens per row in the start-up profile."""

    scheduler: bool = False
    step_cost_ms: list[tuple[int, float]] | None = None
    profile_ctx_len: int = Field(64, ge=1)


class DSparkProposer(BlockDraftProposer):
    name = "dspark"
    Options = DSparkOptions
    use_selector = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.drafter.confidence is None and self.options.scheduler:
            raise ValueError("scheduler=True needs a drafter with a confidence head "
                             "(train one with `python -m train.drafters --method dspark`)")
        self.cost_curve = None
        if self.options.scheduler:
            if self.options.step_cost_ms:
                t, ms = zip(*self.options.step_cost_ms)
                self.cost_curve = StepCostCurve(t, ms)
            else:
                k = max(1, min(self.max_draft_tokens, self.block_size - 1))
                self.cost_curve = StepCostCurve.profile(
                    self.target, self.max_num_seqs * (k + 1), self.max_num_seqs,
                    self.options.profile_ctx_len)

    def needs_confidence(self) -> bool:
        return self.cost_curve is not None  # the scheduler reads it every step

    def lengths(self, batch, d):
        fixed = super().lengths(batch, d)
        if self.cost_curve is None:
            return fixed
        surv = np.cumprod(d.confidence.float().cpu().numpy(), axis=1)
        return schedule_lengths([surv[j, :m] for j, m in enumerate(fixed)], self.cost_curve)
