"""Logit processing and sampling: pure functions shared by target and drafters.

The target's p and a drafter's q must go through the same processing
(temperature, then top-k, then top-p, as HF's ``generate`` orders its
warpers) for speculative sampling to be lossless (docs/design.md, "Lossless
verification").
"""

from __future__ import annotations

import torch

from actors.engine.types import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature / top-k / top-p.

    logits: [..., V] (any float dtype) -> probs: [..., V] float32, rows sum to 1.
    Greedy params (temperature 0) give a one-hot on the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - params.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row: probs [..., V] -> [...] int64 (multinomial on the CPU
    generator so a request's draws do not depend on the rest of the batch).

    Raises ValueError when a row is not a distribution (inf / NaN / negative
    entries or zero mass); the engine then fails that request alone.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not bool(torch.isfinite(flat).all()) or bool((flat < 0).any()) \
            or bool((flat.sum(-1) <= 0).any()):
        raise ValueError("sampling distribution has inf / NaN / negative entries or no mass "
                         "(non-finite logits?)")
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1]).to(probs.device)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded from ``seed`` (a random seed when None)."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
