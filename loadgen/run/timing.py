"""Per-request streaming timing: SSE parsing and the metrics of one request row.

Pure Python (no gevent, no locust) so it is unit-testable and reusable.
Definitions (docs/design.md, "Metric definitions"):

- TTFT: from the request's *scheduled* send time (= the actual send time in
  closed-loop mode) to the first chunk whose text is non-empty. An empty
  role/heartbeat chunk does not count.
- e2e: scheduled send time -> end of the stream ([DONE] or EOF), ms.
- TPOT = (e2e - TTFT) / (output_tokens - 1), ms per token.
- output tokens: ``usage.completion_tokens`` from the server, never counted
  from the text (re-tokenising chunks over-counts).
- ITL, per token: each gap between consecutive content chunks is spread over
  the tokens the later chunk carries (a speculative step emits several). The
  tokens per chunk come, in order of preference, from a per-chunk
  ``spec_decode.num_tokens`` extension, ``choices[0].token_ids``, or a
  per-chunk cumulative ``usage.completion_tokens`` (vLLM continuous usage).
  When the server gives none of these, the tokens after the first chunk
  (``completion_tokens - 1``: the first content chunk is assumed to carry one
  token, which holds for prefill) are spread evenly over the later chunks; the
  p50/p99 are then token-weighted percentiles of gap/tokens. ITL never
  includes TTFT.
- Per-token emit timestamps: when every content chunk carries
  ``choices[0].token_ts`` (specload's extension: the engine's emit time of
  each token, unix s; tokens of one engine step share a time), the ITL is
  computed per engine step instead of per chunk, so it stays per token
  whatever the server's ``stream_interval``: each chunk is split into its
  steps, step g placed at ``chunk arrival - (last ts in chunk - ts of g)``
  on the client clock, and each step's gap from the previous one is spread
  over its tokens. With one chunk per step this is the per-chunk rule.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from configs import metric_names as M
from configs.results_schema import RequestRow

# speculative stats copied from the final chunk's "spec_decode" object into the row
SPEC_INT_FIELDS = (M.NUM_DRAFTS, M.NUM_DRAFT_TOKENS, M.NUM_ACCEPTED_TOKENS)
SPEC_FLOAT_FIELDS = (M.ACCEPTANCE_LENGTH, M.DRAFT_MS, M.VERIFY_MS, M.QUEUE_MS)
SPEC_LIST_FIELDS = (M.NUM_ACCEPTED_TOKENS_PER_POS,)
PER_CHUNK_TOKENS_FIELD = "num_tokens"  # optional per-chunk extension: spec_decode.num_tokens
# what other engines report per request, under specload's names (engine_spec_stats)
ENGINE_SPEC_FIELDS = (M.REQ_SPEC_SOURCE, M.REQ_NUM_SPEC_TOKENS, M.DEGRADED_REASON, M.REQ_ENGINE_ACCEPT_LENGTH)
ENGINE_LIST_FIELDS = (M.REQ_ACCEPTANCE_HISTOGRAM,)


def engine_spec_stats(obj: dict[str, Any]) -> dict[str, Any]:
    """Per-request speculative stats of a response object (a stream chunk or a whole
    response) under specload's names; {} when it carries none.

    - specload: the ``spec_decode`` extension (``actors.serve.openai_response``), names as is.
    - vLLM (``--per-request-spec-decode-metrics summary|detailed``): ``metrics.speculative_decoding``,
      in a stream on the final usage chunk: ``num_spec_steps`` -> num_drafts,
      ``num_draft_tokens``, ``num_accepted_draft_tokens`` -> num_accepted_tokens,
      ``mean_acceptance_length`` -> acceptance_length, ``num_spec_tokens`` (k),
      ``acceptance_histogram`` (steps by accepted count 0..k). Accepted counts per position
      follow from the histogram, since a draft is accepted as a prefix: accepted at
      position i (0-based) = steps that accepted more than i = sum(histogram[i+1:]).
    - SGLang: ``meta_info`` (top level, or on the choice) ``spec_verify_ct`` -> num_drafts,
      accepted draft tokens -> num_accepted_tokens, drafted tokens -> num_draft_tokens, in
      every spelling it has shipped (``SGLANG_SPEC_KEYS``; no per-position split); its own
      accept length (completion_tokens / spec_verify_ct) -> engine_accept_length, kept
      apart from tau = 1 + accepted / drafts.
    """
    spec = obj.get(M.SPEC_DECODE_FIELD)
    if isinstance(spec, dict) and spec:
        out = {k: spec[k] for k in SPEC_INT_FIELDS + SPEC_FLOAT_FIELDS + SPEC_LIST_FIELDS if k in spec}
        if out:
            out[M.REQ_SPEC_SOURCE] = M.ENGINE_SPECLOAD
            if isinstance(spec.get(M.DEGRADED_REASON), str):   # degrade-instead-of-fail
                out[M.DEGRADED_REASON] = spec[M.DEGRADED_REASON]
        return out
    metrics = obj.get("metrics")
    sd = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if isinstance(sd, dict):
        out = {M.REQ_SPEC_SOURCE: M.ENGINE_VLLM}
        for ours, theirs in ((M.NUM_DRAFTS, "num_spec_steps"), (M.NUM_DRAFT_TOKENS, "num_draft_tokens"),
                             (M.NUM_ACCEPTED_TOKENS, "num_accepted_draft_tokens"),
                             (M.REQ_NUM_SPEC_TOKENS, "num_spec_tokens")):
            if isinstance(sd.get(theirs), int):
                out[ours] = sd[theirs]
        if isinstance(sd.get("mean_acceptance_length"), (int, float)):
            out[M.ACCEPTANCE_LENGTH] = float(sd["mean_acceptance_length"])
        hist = sd.get("acceptance_histogram")
        if isinstance(hist, list) and all(isinstance(h, int) for h in hist) and len(hist) >= 2:
            out[M.REQ_ACCEPTANCE_HISTOGRAM] = hist
            out[M.NUM_ACCEPTED_TOKENS_PER_POS] = [sum(hist[i + 1:]) for i in range(len(hist) - 1)]
        return out
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        choices = obj.get("choices") or []
        meta = choices[0].get("meta_info") if choices and isinstance(choices[0], dict) else None
    if isinstance(meta, dict) and any(k in meta for keys in SGLANG_SPEC_KEYS.values() for k in keys):
        out = {M.REQ_SPEC_SOURCE: M.ENGINE_SGLANG}
        for ours, spellings in SGLANG_SPEC_KEYS.items():
            for theirs in spellings:
                if isinstance(meta.get(theirs), int) and not isinstance(meta.get(theirs), bool):
                    out[ours] = meta[theirs]
                    break
        # SGLang's own accept length: completion tokens / verify count (prefill token included)
        ct = meta.get("completion_tokens")
        if isinstance(ct, int) and out.get(M.NUM_DRAFTS):
            out[M.REQ_ENGINE_ACCEPT_LENGTH] = ct / out[M.NUM_DRAFTS]
        return out
    return {}


# every spelling SGLang has shipped in ``meta_info``, per specload name, oldest first: the
# verify count; accepted draft tokens (``spec_accept_token_num``; 0.5.11 ``spec_accepted_drafts``;
# later ``spec_num_correct_drafts``); drafted tokens (``spec_draft_token_num``; 0.5.11
# ``spec_proposed_drafts``; later ``spec_num_proposed_drafts``)
SGLANG_SPEC_KEYS: dict[str, tuple[str, ...]] = {
    M.NUM_DRAFTS: ("spec_verify_ct",),
    M.NUM_ACCEPTED_TOKENS: ("spec_accept_token_num", "spec_accepted_drafts", "spec_num_correct_drafts"),
    M.NUM_DRAFT_TOKENS: ("spec_draft_token_num", "spec_proposed_drafts", "spec_num_proposed_drafts"),
}


class SSEParser:
    """Incremental Server-Sent-Events parser: feed raw lines, get ``data`` payloads.

    Handles ``\\r\\n`` and ``\\n`` line ends, comment lines (``:``), multi-line
    ``data:`` fields (joined with ``\\n``) and events without a trailing blank line
    (call ``flush`` at EOF).
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, raw: bytes | str) -> list[str]:
        """One line (with or without its line end); returns the events it completed."""
        line = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return []
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return []

    def flush(self) -> list[str]:
        if not self._data:
            return []
        data, self._data = "\n".join(self._data), []
        return [data]


def weighted_percentile(values: Iterable[float], weights: Iterable[float], q: float) -> float:
    """Percentile ``q`` in [0, 100] of ``values`` where value i counts ``weights[i]`` times.

    Lower-value convention (the smallest value whose cumulative weight reaches
    q% of the total); NaN for no data.
    """
    pairs = sorted((v, w) for v, w in zip(values, weights) if w > 0)
    if not pairs:
        return math.nan
    total = sum(w for _, w in pairs)
    target = q / 100.0 * total
    acc = 0.0
    for v, w in pairs:
        acc += w
        if acc >= target - 1e-12:
            return v
    return pairs[-1][0]


def _median(vals: list[float]) -> float | None:
    """Median (midpoint of the two middle values for an even count); None for no data."""
    if not vals:
        return None
    v = sorted(vals)
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2.0


@dataclass
class StreamRecorder:
    """Collects one streamed completion; ``row()`` turns it into request-row fields.

    Timestamps are unix seconds (``time.time()``); ``scheduled_ts`` is the
    open-loop schedule slot (or the send time in closed-loop mode).
    """

    scheduled_ts: float
    sent_ts: float | None = None
    chunk_ts: list[float] = field(default_factory=list)        # content chunks only
    chunk_tokens: list[int | None] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    done: bool = False                                          # saw data: [DONE]
    error: str | None = None
    error_code: str | None = None                               # the error object's `code`
    _usage_completion_seen: int = 0
    _pending_tokens: int = 0      # tokens of empty-text chunks (token_ids), credited to the next content chunk
    # per-token engine emit times (token_ts extension), per content chunk; None once
    # a content chunk came without them (then ITL falls back to chunk arrivals)
    chunk_token_ts: list[list[float]] | None = field(default_factory=list)
    _pending_ts: list[float] = field(default_factory=list)

    def on_data(self, data: str, ts: float) -> None:
        """Handle one SSE ``data`` payload that arrived at ``ts`` (unix s)."""
        obj = self._payload(data)
        if obj is None:
            return
        text, token_ids, token_ts = self._read_choices(obj)
        spec = obj.get(M.SPEC_DECODE_FIELD) or {}
        if not isinstance(spec, dict):
            spec = {}
        usage = obj.get("usage")
        n = self._chunk_tokens(obj, spec, usage, token_ids)
        ts_ok = (isinstance(token_ids, list) and isinstance(token_ts, list)
                 and len(token_ts) == len(token_ids)
                 and all(isinstance(t, (int, float)) for t in token_ts))
        self._record_chunk(ts, text, n, token_ts if ts_ok else None)
        if isinstance(usage, dict):
            self.usage = usage
            if isinstance(usage.get("completion_tokens"), int):
                self._usage_completion_seen = usage["completion_tokens"]
        self.spec.update(engine_spec_stats(obj))

    def _payload(self, data: str) -> dict | None:
        """The payload's JSON object, or None after ``[DONE]`` (``done`` set), bad JSON or an
        error object (``error`` / ``error_code`` set), or a non-object."""
        if data.strip() == "[DONE]":
            self.done = True
            return None
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad JSON in stream: {data[:200]!r}"
            return None
        if not isinstance(obj, dict):
            return None
        if obj.get("error"):
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:500]
            self.error_code = err.get("code") if isinstance(err, dict) else None
            return None
        return obj

    def _read_choices(self, obj: dict) -> tuple[str, list | None, list | None]:
        """(text, token ids, per-token emit times) of a chunk's choices (the chat-completions
        delta shape tolerated); a finish_reason is kept."""
        text, token_ids, token_ts = "", None, None
        for choice in obj.get("choices") or []:
            piece = choice.get("text")
            if piece is None:  # chat-completions shape, tolerated
                piece = (choice.get("delta") or {}).get("content")
            text += piece or ""
            if choice.get("token_ids") is not None:
                token_ids = choice["token_ids"]
            if isinstance(choice.get(M.TOKEN_TS_FIELD), list):
                token_ts = choice[M.TOKEN_TS_FIELD]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return text, token_ids, token_ts

    def _chunk_tokens(self, obj: dict, spec: dict, usage: Any, token_ids: list | None) -> int | None:
        """Tokens this chunk carries: specload's per-chunk count, else its token ids, else the
        growth of vLLM / SGLang's cumulative continuous-usage completion_tokens; None: unknown."""
        if isinstance(spec.get(PER_CHUNK_TOKENS_FIELD), int):
            return spec[PER_CHUNK_TOKENS_FIELD]
        if isinstance(token_ids, list):
            return len(token_ids)
        if (obj.get("choices") and isinstance(usage, dict)
                and isinstance(usage.get("completion_tokens"), int)):
            return usage["completion_tokens"] - self._usage_completion_seen
        return None

    def _record_chunk(self, ts: float, text: str, n: int | None, token_ts: list | None) -> None:
        """A content chunk: its arrival, its tokens (with those of earlier empty-text chunks) and
        per-token times (``token_ts``: None when absent or not one per token id). An empty-text
        chunk's tokens (half a UTF-8 character) are counted with the next content chunk."""
        if text:
            self.chunk_ts.append(ts)
            self.chunk_tokens.append(None if n is None else n + self._pending_tokens)
            self._pending_tokens = 0
            if self.chunk_token_ts is not None:
                if token_ts is not None and (token_ts or self._pending_ts):
                    self.chunk_token_ts.append(self._pending_ts + [float(t) for t in token_ts])
                else:
                    self.chunk_token_ts = None
            self._pending_ts = []
        elif n:  # tokens whose text is not out yet (e.g. half a UTF-8 character): count them later
            self._pending_tokens += n
            if token_ts is not None:
                self._pending_ts.extend(float(t) for t in token_ts)

    @property
    def complete(self) -> bool:
        """The server said the stream is over ([DONE], or a finish_reason plus usage)."""
        return self.done or (self.finish_reason is not None and self.usage is not None)

    def step_times(self) -> tuple[list[float], list[int]] | None:
        """Per engine step (client-clock time in unix s, tokens), rebuilt from the
        ``token_ts`` extension; None when a content chunk lacked it."""
        if not self.chunk_token_ts or len(self.chunk_token_ts) != len(self.chunk_ts):
            return None
        times: list[float] = []
        counts: list[int] = []
        for arrival, tts in zip(self.chunk_ts, self.chunk_token_ts):
            last = tts[-1]
            for i, t in enumerate(tts):
                if i and t == tts[i - 1]:
                    counts[-1] += 1   # same engine step as the previous token
                else:
                    times.append(arrival - (last - t))
                    counts.append(1)
        return times, counts

    def chunk_gaps_ms(self) -> list[float]:
        """Gaps between consecutive content chunks, ms (per chunk, not per token)."""
        return [(b - a) * 1000.0 for a, b in zip(self.chunk_ts, self.chunk_ts[1:])]

    def itl_source(self) -> str | None:
        """Where a per-token ITL can come from (``metric_names.ITL_SOURCES``); None with
        fewer than two content chunks (no gap at all)."""
        if len(self.chunk_ts) < 2:
            return None
        if self.step_times() is not None:
            return M.ITL_SOURCE_STEPS
        if all(isinstance(n, int) and n > 0 for n in self.chunk_tokens[1:]):
            return M.ITL_SOURCE_TOKENS
        return M.ITL_SOURCE_CHUNKS

    def itl_samples(self, output_tokens: int | None = None) -> tuple[list[float], list[float]]:
        """(per-token ITL values in ms, token weights): a chunk of n tokens arriving g ms
        after the previous content chunk contributes n intervals of g / n ms; per engine
        step instead when every chunk carried ``token_ts``. ([], []) when the server gave
        no per-chunk token count: a chunk gap is never passed off as a per-token ITL
        (``chunk_gaps_ms`` has the gaps). ``output_tokens`` is unused (kept for callers)."""
        steps = self.step_times()
        if steps is not None:
            times, counts = steps
            gaps = [(b - a) * 1000.0 for a, b in zip(times, times[1:])]
            later = [float(c) for c in counts[1:]]
            return [g / c for g, c in zip(gaps, later)], later
        gaps = self.chunk_gaps_ms()
        later = self.chunk_tokens[1:]
        if not gaps or not all(isinstance(n, int) and n > 0 for n in later):
            return [], []
        tokens = [float(n) for n in later]  # exact per-chunk counts
        return [g / n for g, n in zip(gaps, tokens)], tokens

    def row(self, end_ts: float, status: str, error: str | None = None) -> RequestRow:
        """Request-row timing fields (metric_names REQ_* and spec stats); times in ms."""
        out_tokens = self.usage.get("completion_tokens") if self.usage else None
        prompt_tokens = self.usage.get("prompt_tokens") if self.usage else None
        first = self.chunk_ts[0] if self.chunk_ts else None
        ttft = (first - self.scheduled_ts) * 1000.0 if first is not None else None
        e2e = (end_ts - self.scheduled_ts) * 1000.0
        tpot = None
        if status == M.STATUS_OK and ttft is not None and isinstance(out_tokens, int) and out_tokens > 1:
            tpot = (e2e - ttft) / (out_tokens - 1)
        vals, wts = self.itl_samples(out_tokens if isinstance(out_tokens, int) else None)
        row: RequestRow = {
            M.REQ_SCHEDULED_TS: self.scheduled_ts,
            M.REQ_SENT_TS: self.sent_ts,
            M.REQ_FIRST_TOKEN_TS: first,
            M.REQ_END_TS: end_ts,
            M.REQ_TTFT_MS: ttft,
            M.REQ_TPOT_MS: tpot,
            M.REQ_ITL_P50_MS: weighted_percentile(vals, wts, 50) if vals else None,
            M.REQ_ITL_P90_MS: weighted_percentile(vals, wts, 90) if vals else None,
            M.REQ_ITL_P99_MS: weighted_percentile(vals, wts, 99) if vals else None,
            M.REQ_ITL_MEAN_MS: (sum(v * w for v, w in zip(vals, wts)) / sum(wts)) if vals else None,
            M.REQ_ITL_SOURCE: self.itl_source(),
            M.REQ_TOKENS_PER_CHUNK: ((out_tokens - 1) / (len(self.chunk_ts) - 1)
                                     if isinstance(out_tokens, int) and len(self.chunk_ts) > 1 else None),
            M.REQ_MULTI_TOKEN_CHUNKS: (sum(1 for n in self.chunk_tokens[1:] if n > 1)
                                       if all(isinstance(n, int) for n in self.chunk_tokens[1:])
                                       and len(self.chunk_ts) > 1 else None),
            M.REQ_CHUNK_GAP_P50_MS: _median(self.chunk_gaps_ms()),
            M.REQ_E2E_MS: e2e,
            M.REQ_OUTPUT_TOKENS: out_tokens,
            M.REQ_PROMPT_TOKENS: prompt_tokens,
            M.REQ_NUM_CHUNKS: len(self.chunk_ts),
            M.REQ_FINISH_REASON: self.finish_reason,
            M.REQ_STATUS: status,
            M.REQ_ERROR: error if error is not None else self.error,
        }
        for k in SPEC_INT_FIELDS + SPEC_FLOAT_FIELDS + SPEC_LIST_FIELDS + ENGINE_SPEC_FIELDS + ENGINE_LIST_FIELDS:
            row[k] = self.spec.get(k)
        if (row[M.REQ_SPEC_SOURCE] == M.ENGINE_SGLANG and row[M.REQ_ENGINE_ACCEPT_LENGTH] is None
                and row[M.NUM_DRAFTS] and isinstance(out_tokens, int)):
            row[M.REQ_ENGINE_ACCEPT_LENGTH] = out_tokens / row[M.NUM_DRAFTS]   # SGLang's definition
        return row
