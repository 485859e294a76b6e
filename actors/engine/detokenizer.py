"""From emitted token ids to streamed text: finish rules, stop strings, deltas.

The engine appends each step's emitted tokens here (``append``: EOS,
``max_tokens``, context length and stop strings end a request; a stop string
cuts the ids back to the shortest prefix whose text reaches it) and asks for
what to stream (``delta``). Pure bookkeeping on ``Request``; no tensors.

``stop_token_ids`` (vLLM's) end a request like EOS: the stop token counts as an output
token and is kept in the ids, tokens after it in the same step are dropped, and its text
is left out unless ``include_stop_str_in_output`` (which also keeps a matched stop
string in the text); ``stop_reason`` names the token id or the stop string.

Per request: ``skip_special_tokens`` (default True) leaves special tokens (EOS
emitted under ``ignore_eos``) out of the text and its deltas; ``min_tokens``
lets EOS end the request only after that many tokens (the engine masks it
before, this is the backstop) and searches stop strings only in the text after
the first ``min_tokens`` tokens (a match may start up to len(stop) - 1
characters before, as vLLM's detokenizer); ``logprobs`` entries are kept
beside the ids (cut with them) and given their texts and text offsets in
``delta``.
"""

from __future__ import annotations

import time

from actors.engine.logprobs import RawLogprob, TokenTexts
from actors.engine.scheduler import Request
from actors.engine.types import RequestOutput, TokenLogprob


class Detokenizer:
    """Text state of requests for one tokenizer. ``max_model_len``: tokens per request."""

    def __init__(self, tokenizer, eos_token_id: int | None, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        # A fast (Rust-backed) tokenizer without clean-up decodes a list of ids as its
        # backend does: calling the backend skips transformers' per-id type walk
        # (``to_py_obj``), 28 -> 14 us for 64 ids, once per request per step.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and getattr(
            tokenizer, "clean_up_tokenization_spaces", None) is False else None
        self._slow = not getattr(tokenizer, "is_fast", backend is not None)
        self.token_texts = TokenTexts(tokenizer)

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of ``ids``; ``spaces_between_special_tokens`` reaches slow tokenizers only."""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._slow:
            return self.tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _text(self, r: Request, ids: list[int]) -> str:
        return self.decode(ids, r.params.skip_special_tokens,
                           r.params.spaces_between_special_tokens)

    def append(self, r: Request, tokens: list[int],
               logprobs: list[RawLogprob] | None = None) -> int:
        """Append emitted tokens, applying EOS / max_tokens / context / stop strings.
        Returns how many were kept (>= 1 when ``tokens`` is not empty).
        logprobs: [len(tokens)] entries (``logprobs.emitted_logprobs``) when the
        request asked for them; kept and cut together with the ids."""
        kept = self._take(r, tokens, logprobs)
        ids = r.output_ids
        if ids and ids[-1] == self.eos_token_id and r.finish_reason == "stop" \
                and r.stop_reason is None:
            ids = ids[:-1]  # EOS is not part of the text
        elif r.stop_reason is not None and not r.params.include_stop_str_in_output:
            ids = ids[:-1]  # nor a stop token (vLLM's), unless include_stop_str_in_output
        text = self._text(r, ids)
        if r.params.stop and len(r.output_ids) > r.params.min_tokens:
            text, kept = self._stop_strings(r, text, kept)
        r.text = text
        return kept

    def _take(self, r: Request, tokens: list[int], logprobs: list[RawLogprob] | None) -> int:
        """Append ``tokens`` (and their logprobs) to ``r`` up to the first that ends it:
        EOS (unless ``ignore_eos``) or a ``stop_token_ids`` entry past ``min_tokens``
        ("stop"), ``max_tokens`` or the context (``max_model_len``: "length"). Returns how
        many were kept; each gets the same emit time (unix s)."""
        kept = 0
        now = time.time()
        for i, t in enumerate(tokens):
            r.output_ids.append(t)
            r.token_ts.append(now)
            if logprobs is not None:
                r.logprobs.append(logprobs[i])
            kept += 1
            if t == self.eos_token_id and not r.params.ignore_eos \
                    and len(r.output_ids) > r.params.min_tokens:
                r.finish_reason = "stop"
                break
            if t in r.params.stop_token_ids and len(r.output_ids) > r.params.min_tokens:
                # vLLM's stop_token_ids: the tokens after it in this step are dropped
                r.finish_reason, r.stop_reason = "stop", t
                break
            if len(r.output_ids) >= r.params.max_tokens:
                r.finish_reason = "length"
                break
            if len(r.prompt_ids) + len(r.output_ids) >= self.max_model_len:
                r.finish_reason = "length"
                break
        return kept

    def _stop_strings(self, r: Request, text: str, kept: int) -> tuple[str, int]:
        """Cut ``text`` at the first of ``r.params.stop`` it newly holds (wins over a stop
        token that ended this step, as vLLM): the stop string kept with
        ``include_stop_str_in_output``, ``r.output_ids`` (and times, logprobs) cut to the
        shortest prefix whose text reaches it, ``finish_reason`` "stop". Returns (text,
        tokens of this step still kept)."""
        m = r.params.min_tokens
        # The earlier text held no stop string, so a new match ends in the new text:
        # search from (longest stop - 1) characters before where that stable text
        # ended (a trailing U+FFFD is an incomplete character that may change).
        longest = max(len(s) for s in r.params.stop)
        frm = max(0, len(r.text.rstrip("\ufffd")) - longest + 1)
        # min_tokens: a match must end after the text of the first m tokens
        floor = len(self._text(r, r.output_ids[:m]).rstrip("\ufffd")) if m else 0
        hit = self.find_stop(text, r.params.stop, frm, floor)
        if hit is None:
            return text, kept
        matched = next(s for s in r.params.stop if text.startswith(s, hit))
        text = text[:hit + (len(matched) if r.params.include_stop_str_in_output else 0)]
        r.stop_reason = matched
        # keep the shortest id prefix whose text reaches the stop string
        for j in range(max(len(r.output_ids) - kept + 1, m + 1), len(r.output_ids) + 1):
            if self.find_stop(self._text(r, r.output_ids[:j]), r.params.stop,
                              frm, floor) is not None:
                kept -= len(r.output_ids) - j
                del r.output_ids[j:]
                del r.token_ts[j:]
                del r.logprobs[j:]
                break
        r.finish_reason = "stop"
        return text, kept

    @staticmethod
    def find_stop(text: str, stops: tuple[str, ...], frm: int, floor: int = 0) -> int | None:
        """Smallest index >= ``frm`` where any stop string starts in ``text`` and
        ends past ``floor`` (None: none)."""
        hits = [i for i in (text.find(s, max(frm, floor - len(s) + 1)) for s in stops) if i >= 0]
        return min(hits) if hits else None

    def _logprobs(self, r: Request, start: int, end: int) -> list[TokenLogprob]:
        """The streamed entries of output tokens ``start .. end-1``: texts, bytes and
        text offsets (characters of the text before each token, at most its length)."""
        out = []
        limit = len(r.text)
        for i in range(start, end):
            tid, lp, top = r.logprobs[i]
            tok, raw = self.token_texts.get(tid)
            offset = min(limit, len(self._text(r, r.output_ids[:i]).rstrip("\ufffd")))
            out.append(TokenLogprob(tid, tok, raw, lp, tuple(
                (t, *self.token_texts.get(t), v) for t, v in top), offset))
        return out

    def delta(self, r: Request) -> RequestOutput:
        """What is new since the last delta of ``r``: token ids and text safe to stream
        (an incomplete UTF-8 character and a possible stop-string prefix are held back)."""
        finished = r.finish_reason is not None
        text = r.text
        end = len(text)
        if r.finish_reason == "error":
            end = r.sent_chars  # nothing more of a failed request's text is sent
        elif not finished:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))  # hold back an incomplete UTF-8 character
            if r.params.stop:  # hold back what may be the start of a stop string
                end = max(0, end - max(len(s) for s in r.params.stop) + 1)
        new_text = text[r.sent_chars:end] if end > r.sent_chars else ""
        r.sent_chars = max(r.sent_chars, end)
        lps = None if r.params.logprobs is None else []
        if r.finish_reason == "error":
            new_ids, new_ts = [], []
        else:
            new_ids = r.output_ids[r.sent_tokens:]
            new_ts = r.token_ts[r.sent_tokens:]
            if lps is not None:
                lps = self._logprobs(r, r.sent_tokens, len(r.output_ids))
            r.sent_tokens = len(r.output_ids)
        return RequestOutput(r.request_id, new_ids, new_text, finished, r.finish_reason,
                             len(r.prompt_ids), r.sent_tokens, r.stats, error=r.error,
                             token_ts=new_ts, logprobs=lps,
                             stop_reason=r.stop_reason if finished else None)
