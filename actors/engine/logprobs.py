"""Logprobs of emitted tokens (``SamplingParams.logprobs``): numbers from the target's
logits, then token texts and bytes for the OpenAI response.

The engine calls ``emitted_logprobs`` only for requests that asked (no cost for
the others), on the logit rows the verifier chose the tokens from: for a
speculative step the rows of ``[last token, d_1 .. d_n]`` of the one
verification forward, of which the first ``num_accepted + 1`` picked the
emitted tokens (the accepted drafts, then the correction or bonus token); for
the first token the prefill's last row. So every strategy reports the logprobs
the autoregressive engine would, position by position.
"""

from __future__ import annotations

import torch

from actors.engine.sampling import logprob_rows
from actors.engine.types import SamplingParams

# (token_id, logprob, ((top_id, top_logprob), ...)) for one emitted token
RawLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


def emitted_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams,
                     num_top: int) -> list[RawLogprob]:
    """One ``RawLogprob`` per emitted token.

    logits: [>= len(tokens), V] target logits (min_tokens mask applied), row i
    the one ``tokens[i]`` was chosen from; tokens: [n] emitted ids; num_top:
    top entries per position (0..20), best first (ties in torch.topk's order).
    Values: ``sampling.logprob_rows`` (greedy: log_softmax of the logits;
    sampled: of the temperature / top-k / top-p processed logits). One
    device-to-host transfer.
    """
    n = len(tokens)
    if n == 0:
        return []
    lp = logprob_rows(logits[:n], params)
    idx = torch.tensor(tokens, device=lp.device)
    chosen = lp[torch.arange(n, device=lp.device), idx]
    if num_top > 0:
        top = torch.topk(lp, min(num_top, lp.shape[-1]), dim=-1)
        vals, ids = top.values.cpu().tolist(), top.indices.cpu().tolist()
    else:
        vals, ids = [[] for _ in range(n)], [[] for _ in range(n)]
    return [(t, float(c), tuple(zip(i, v))) for t, c, i, v in
            zip(tokens, chosen.cpu().tolist(), ids, vals)]


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's character -> byte table (the inverse of its
    ``bytes_to_unicode``: printable bytes map to themselves, the others to
    U+0100 upward)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenTexts:
    """Each token id's own text and exact bytes, for one tokenizer (cached per id).

    A byte-level BPE tokenizer (a ``ByteLevel`` decoder: GPT-2, Qwen, Llama 3)
    gives the true bytes of a token even when it is part of a UTF-8 character
    (its text is then "\\ufffd", as ``decode([id])`` gives); special tokens and
    other tokenizers use ``decode([id])`` and its UTF-8 bytes.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self._bytes_of = _byte_decoder() if type(decoder).__name__ == "ByteLevel" else None
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one token id."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        out = None
        if self._bytes_of is not None and token_id not in self._special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece and all(c in self._bytes_of for c in piece):
                raw = bytes(self._bytes_of[c] for c in piece)
                out = (raw.decode("utf-8", errors="replace"), raw)
        if out is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            out = (text, text.encode("utf-8"))
        self._cache[token_id] = out
        return out
