"""Typed contracts between the scheduler, the proposers and the verifier.

DeepSpec's ``DraftProposal`` / ``VerificationResult`` idea: one decoding loop,
strategies plug in through ``Proposer.propose``; everything crossing a
boundary is a frozen dataclass with tensor shapes in comments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from actors.engine.errors import InvalidRequest
from configs.results_schema import StepRow

if TYPE_CHECKING:  # annotations only: the Serve replicas import these types without torch
    import torch

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): logits / T would
# overflow float32 (max 3.4e38) for T ~ 1e-40, and the limit distribution is the argmax.
GREEDY_TEMPERATURE = 1e-5


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1   # a seed is an int64 (vLLM's range)
MAX_LOGPROBS = 20   # most top logprobs per position (OpenAI's limit for both endpoints)


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-style sampling parameters of one request.

    temperature 0 means greedy, and so does any temperature below
    ``GREEDY_TEMPERATURE`` (1e-5, vLLM's ``_SAMPLING_EPS``): dividing logits by
    1e-40 overflows float32 to inf and softmax to NaN, while the distribution
    it approximates is the argmax one-hot anyway. top_k 0 or -1 means no
    top-k. ``seed`` makes the request's sampling reproducible whatever else is
    in the batch. ``max_tokens`` may exceed the context: the engine stops at
    ``max_model_len`` with finish_reason "length".

    ``logprobs`` (vLLM's field): None = compute none (no cost); N in 0..20 =
    the target's log-probability of every emitted token plus the N most likely
    tokens at that position (``TokenLogprob``), from the logits the token was
    chosen from: after the ``min_tokens`` mask, and for sampled requests after
    temperature / top-k / top-p (vLLM's ``processed_logprobs``; tokens cut by
    top-k / top-p are -inf); for greedy requests the log_softmax of the target
    logits (vLLM's ``raw_logprobs`` when min_tokens is 0).
    ``min_tokens`` (vLLM semantics): EOS (unless ``ignore_eos``) cannot be
    emitted before ``min_tokens`` output tokens (its logit is -inf there, in the
    target's processing, so greedy output is the same for every strategy), and
    stop strings are searched only in text after the first ``min_tokens``
    tokens. ``skip_special_tokens`` (default True, vLLM's): special tokens such
    as EOS are left out of ``text``; ``spaces_between_special_tokens`` is
    passed to a slow tokenizer's decode (a fast tokenizer ignores it, as in
    vLLM). Token ids and counts are the same either way.
    Raises InvalidRequest (a ValueError) with ``param`` = the field on invalid
    values (see ``validate``).
    """

    max_tokens: int | None = 64   # None: up to the end of the context (max_model_len)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: a token in stop_token_ids ends the request ("stop", stop_reason = the id);
    # it counts as an output token, its text is left out unless include_stop_str_in_output
    # (which also keeps a matched stop string in the text); masked before min_tokens like EOS
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        elif self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        self.validate()

    def validate(self) -> None:
        if self.max_tokens is not None and (
                not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                or self.max_tokens <= 0):
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}",
                                 param="max_tokens")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                 param="temperature")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}",
                                 param="top_p")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidRequest(f"top_k must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}",
                                 param="top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequest(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (int64, "
                                 f"as vLLM) or null, got {self.seed!r}", param="seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest(f"stop must be non-empty strings, got {self.stop!r}",
                                 param="stop")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, "
                                 f"got {self.logprobs!r}", param="logprobs")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
                                 param="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                 f"({self.max_tokens})", param="min_tokens")
        if not isinstance(self.stop_token_ids, tuple) or any(
                not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be a list of token ids (integers >= 0), "
                                 f"got {self.stop_token_ids!r}", param="stop_token_ids")
        for name in ("skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a boolean, got {getattr(self, name)!r}",
                                     param=name)

    @property
    def greedy(self) -> bool:
        """True for temperature 0 and for temperatures too small to divide by (< 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one emitted token (``SamplingParams.logprobs``).

    token_id / token / token_bytes: the emitted token (its text alone, and its
    exact bytes: a byte-level token that is part of a UTF-8 character has
    ``token`` "\ufffd" but its true bytes); logprob: natural log, <= 0 (-inf
    never: the token was chosen, so it had mass); top: the N most likely tokens
    at that position, best first, as (token_id, token, token_bytes, logprob)
    (logprob may be -inf for tokens top-k / top-p removed); text_offset:
    characters of the request's text before this token.
    """

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[tuple[int, str, bytes, float], ...]
    text_offset: int


@dataclass
class SpecStats:
    """Per-request (or per-run) speculative decoding counters, names as in docs/design.md."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    queue_ms: float = 0.0
    num_steps: int = 0
    # why the request's drafter was dropped ("" = it speculated throughout): one of
    # configs.metric_names.DEGRADE_REASONS; from then on it decoded autoregressively
    degraded_reason: str = ""
    # forced acceptance (engine rejection_sample_method: synthetic): the request's text
    # is not the target's (accepted tokens are drafts kept by a set schedule)
    synthetic: bool = False

    def record(self, num_draft: int, num_accepted: int) -> None:
        """Add one verification step with ``num_draft`` proposed and ``num_accepted`` accepted."""
        self.num_steps += 1
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft:
            self.num_accepted_tokens_per_pos.extend(
                [0] * (num_draft - len(self.num_accepted_tokens_per_pos)))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.draft_ms += other.draft_ms
        self.verify_ms += other.verify_ms
        self.queue_ms += other.queue_ms
        self.num_steps += other.num_steps
        self.synthetic = self.synthetic or other.synthetic
        n = max(len(self.num_accepted_tokens_per_pos), len(other.num_accepted_tokens_per_pos))
        a = self.num_accepted_tokens_per_pos + [0] * (n - len(self.num_accepted_tokens_per_pos))
        for i, v in enumerate(other.num_accepted_tokens_per_pos):
            a[i] += v
        self.num_accepted_tokens_per_pos = a

    @property
    def acceptance_length(self) -> float:
        """tau = 1 + accepted / drafts (counts the bonus / correction token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "acceptance_length": round(self.acceptance_length, 4),
                "draft_ms": round(self.draft_ms, 3), "verify_ms": round(self.verify_ms, 3),
                "queue_ms": round(self.queue_ms, 3), "num_steps": self.num_steps,
                "degraded_reason": self.degraded_reason,
                **({"synthetic": True} if self.synthetic else {})}


@dataclass(frozen=True)
class ProposeInput:
    """What a proposer sees for one running request at one step.

    token_ids: the request's whole sequence so far (prompt + emitted), the
    last of which is not yet in the target's KV cache. max_draft: the most
    draft tokens the scheduler allows this step (0..k, ragged across requests).
    num_output: how many of ``token_ids`` are output tokens (the rest is the
    prompt); eos_token_id: the engine's EOS. A proposer that samples may use
    both to mask EOS before ``params.min_tokens`` as the target does
    (``sampling.mask_min_tokens``): not needed for losslessness (the target
    rejects an EOS it masked), only to waste fewer drafts.
    """

    request_id: str
    token_ids: list[int]
    max_draft: int
    params: SamplingParams
    generator: torch.Generator | None
    num_output: int = 0
    eos_token_id: int | None = None


@dataclass(frozen=True)
class DraftProposal:
    """A proposer's draft for one request.

    token_ids: [n] proposed tokens (n <= max_draft, may be 0).
    probs: [n, V] the distribution each token was drawn from (after the same
    temperature / top-k / top-p processing as the target), or None for a
    deterministic proposal (top-1, path selection, n-gram): q is then one-hot.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class VerificationResult:
    """The verifier's verdict for one request at one step.

    num_accepted: how many draft tokens were accepted (prefix length).
    emitted: accepted drafts + the correction or bonus token, len = num_accepted + 1.
    """

    num_accepted: int
    emitted: list[int]


@dataclass
class RequestOutput:
    """What one engine step streams for one request (a delta).

    new_token_ids: tokens emitted this step; new_text: their text (may be ""
    while a multi-byte character is incomplete); stats: the request's
    cumulative SpecStats, final when ``finished``.
    finish_reason: None, "stop" (EOS or stop string), "length", or "abort".
    stop_reason: with finish_reason "stop", what stopped it (vLLM's): the token id of a
    ``stop_token_ids`` entry, the matched stop string, None for EOS.
    token_ts: [len(new_token_ids)] unix seconds at which the engine emitted
    each new token (tokens of one speculative step share their step's time);
    the server forwards them so a client's ITL stays per token whatever the
    streaming interval.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: SpecStats
    error: str | None = None
    token_ts: list[float] = field(default_factory=list)
    # [len(new_token_ids)] when the request asked for logprobs, else None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None


# A replica's memory report (``LLMEngine.memory`` / ``VllmEngine.memory``): field name ->
# bytes or tokens (ints), the device (str), shares (floats); None where a field is unknown.
MemoryReport = dict[str, "int | float | str | None"]


@runtime_checkable
class SyncEngine(Protocol):
    """What the Serve side (``actors.serve.engine_core``, ``actors.serve.async_engine``)
    calls on a synchronous engine: the embedded ``actors.engine.llm_engine.LLMEngine`` and
    ``actors.engine.vllm_backend.VllmEngine`` both implement it (``tests/test_typed_seams.py``
    checks the two classes' signatures against it). Only the engine thread (or the engine
    process) calls it; nothing here is thread-safe.

    max_model_len: tokens of context (prompt + output) a request may hold.
    on_step: called once per engine step with that step's row (``StepRow``; the columns
    of ``configs.results_schema.ENGINE_STEP_COLUMNS``), None: no step log.
    ``add_request`` raises ``InvalidRequest`` (a ValueError naming the field) for a bad
    request and ``QueueFull`` beyond the engine's waiting limit; returns the prompt's
    length in tokens. ``step`` runs one engine step (schedule, propose, forward, verify)
    and returns one ``RequestOutput`` delta per request that emitted or finished.
    """

    max_model_len: int
    on_step: Callable[[StepRow], None] | None

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    def has_unfinished_requests(self) -> bool: ...

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams) -> int: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def memory(self) -> MemoryReport: ...

    def reset_peak_memory(self) -> None: ...
