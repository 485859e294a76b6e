"""Logit processing and sampling: pure functions shared by target and drafters.

The target's p and a drafter's q must go through the same processing
(temperature, then top-k, then top-p, as HF's ``generate`` orders its
warpers) for speculative sampling to be lossless (docs/design.md, "Lossless
verification").
"""

from __future__ import annotations

import torch

from actors.engine.types import SamplingParams


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits after temperature / top-k / top-p (removed tokens -inf), sampled params only.

    logits: [..., V] (any float dtype) -> [..., V] float32. Raises ValueError for
    greedy params (their distribution is the argmax one-hot: see ``process_logits``).
    """
    if params.greedy:
        raise ValueError("processed_logits is for sampled params; greedy is the argmax")
    logits = logits.float() / params.temperature
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
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature / top-k / top-p.

    logits: [..., V] (any float dtype) -> probs: [..., V] float32, rows sum to 1.
    Greedy params (temperature 0) give a one-hot on the argmax.
    """
    if params.greedy:
        logits = logits.float()
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return processed_logits(logits, params).softmax(-1)


def logprob_rows(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities the tokens are reported with (``SamplingParams.logprobs``).

    logits: [n, V] target logits (the min_tokens mask already applied) ->
    [n, V] float32 natural logs: greedy params, ``log_softmax(logits)`` (vLLM's
    raw logprobs); sampled params, ``log_softmax`` of ``processed_logits``
    (vLLM's processed logprobs: -inf where top-k / top-p removed a token).
    """
    if params.greedy:
        return torch.log_softmax(logits.float(), -1)
    return torch.log_softmax(processed_logits(logits, params), -1)


def mask_min_tokens(logits: torch.Tensor, num_output: int, params: SamplingParams,
                    eos_token_id: int | None) -> None:
    """Forbid EOS before ``params.min_tokens`` output tokens, in place (vLLM's
    ``MinTokensLogitsProcessor``).

    logits: [n, V] target logits of positions that pick output tokens number
    ``num_output .. num_output + n - 1`` (0-based); rows with index <
    ``min_tokens`` get EOS and every ``stop_token_ids`` entry at -inf. EOS is left
    alone with ``ignore_eos`` (it does not end the request then) or without an EOS id.
    """
    ids = list(params.stop_token_ids)   # vLLM masks every stop token id, ignore_eos or not
    if eos_token_id is not None and not params.ignore_eos:
        ids.append(eos_token_id)
    ids = [i for i in ids if i < logits.shape[-1]]
    rows = min(params.min_tokens - num_output, logits.shape[0])
    if rows > 0 and ids:
        logits[:rows, ids] = float("-inf")


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
