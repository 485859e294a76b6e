"""``dflash2``: DFlash 2, "Keep Drafting Parallel" (Inco AI / Z Lab).

DFlash's one-forward block drafting plus (i) top-k (16) candidates per
position with a trained pairwise path selector (unary score + low-rank
bilinear compatibility of adjacent candidates, greedy walk from the anchor)
and (ii) a two-tap dynamic depthwise convolution inside the block around
attention and MLP (``actors.drafters.model.DynamicConv2``). Both switch off
for ablation: ``use_selector=False`` drafts top-1 (``dflash2_conv_only``);
``drafter=models/dflash, use_selector=True`` runs the DFlash backbone with
the selector trained beside it (``dflash2_selector_only``). Proposals are
deterministic (one-hot q for the verifier).
"""

from __future__ import annotations

from actors.proposers.dflash import BlockDraftProposer, DFlashOptions


class DFlash2Options(DFlashOptions):
    """use_selector: walk the candidate path (else top-1); use_conv: None = as
    trained, False = drop the conv at inference (ablation of a conv model)."""

    use_selector: bool = True
    use_conv: bool | None = None


class DFlash2Proposer(BlockDraftProposer):
    name = "dflash2"
    Options = DFlash2Options

    def __init__(self, *args, **kwargs):
        options = args[-1] if args else kwargs["options"]
        self.use_selector = options.use_selector
        super().__init__(*args, **kwargs)

    def load_overrides(self) -> dict:
        o = self.options
        return {} if o.use_conv is None else {"use_conv": o.use_conv}
