"""Continuous-batching scheduler (vLLM v1 style, token-budget based).

Each step: running requests in decode are scheduled first, each costing
1 + draft tokens of the per-step budget ``max_num_batched_tokens``; what is
left goes to prefill chunks (continuing ones first, then newly admitted
requests while a KV slot is free and ``max_num_seqs`` allows). Requests join
and leave between steps; nothing waits for a whole batch to finish.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from actors.engine.types import SamplingParams, SpecStats


@dataclass
class Request:
    """Engine-side state of one request.

    num_computed: tokens of ``prompt_ids + output_ids`` whose K/V is in the
    target cache. In decode, that is everything but the last token.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    token_ts: list[float] = field(default_factory=list)  # unix s, one per output id
    # one logprobs.RawLogprob per output id when params.logprobs is set (else stays [])
    logprobs: list = field(default_factory=list)
    num_computed: int = 0
    slot: int = -1
    first_scheduled: float | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    text: str = ""          # decoded output text so far (after stop-string truncation)
    sent_chars: int = 0     # how much of ``text`` was streamed
    sent_tokens: int = 0    # how many output ids were streamed
    finish_reason: str | None = None  # "stop" | "length" | "error" once finished
    stop_reason: int | str | None = None  # stop token id / stop string (vLLM's stop_reason)
    error: str | None = None          # what failed, when finish_reason is "error"
    degraded: str = ""  # why its drafter was dropped ("" = speculating): decodes alone from then on

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)


@dataclass
class ScheduledDecode:
    request: Request
    max_draft: int          # draft tokens this request may verify this step (0..k)


@dataclass
class ScheduledPrefill:
    request: Request
    chunk: list[int]        # prompt tokens to prefill this step


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledDecode]
    prefills: list[ScheduledPrefill]
    admitted: list[Request]
    num_speculative_tokens: int = 0   # k of this step (the batch-size schedule's, else the engine's)
    k_batch_size: int | None = None   # the batch size k was looked up with (None: fixed k)


class Scheduler:
    """Queues and per-step selection; owns no tensors."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 num_speculative_tokens: int, max_waiting: int,
                 k_for_batch_size: Callable[[int], int] | None = None):
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.k = num_speculative_tokens
        # batch size -> k of a step (num_speculative_tokens_per_batch_size); None: always k
        self.k_for_batch_size = k_for_batch_size
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, request_id: str) -> Request | None:
        for i, r in enumerate(self.running):
            if r.request_id == request_id:
                return self.running.pop(i)
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                return r
        return None

    def max_draft(self, r: Request, k: int | None = None) -> int:
        """k (default: the engine's), capped so that emitted tokens never pass
        max_tokens or the context; 0 for a request whose drafter was dropped."""
        if r.degraded:
            return 0
        left_tokens = r.params.max_tokens - len(r.output_ids) - 1
        left_ctx = self.max_model_len - len(r.all_ids)
        return max(0, min(self.k if k is None else k, left_tokens, left_ctx))

    def step_k(self, free_slots: int) -> int:
        """k of the next step: ``k_for_batch_size`` of the step's batch size, the
        requests running once this step's admissions are in (vLLM counts the
        requests a step schedules), else the engine's k."""
        return self.step_k_lookup(free_slots)[0]

    def step_k_lookup(self, free_slots: int) -> tuple[int, int | None]:
        """(k of the next step, the batch size it was looked up with; None: fixed k)."""
        if self.k_for_batch_size is None:
            return self.k, None
        admit = max(0, min(len(self.waiting), free_slots, self.max_num_seqs - len(self.running)))
        n = len(self.running) + admit
        return self.k_for_batch_size(n), n

    def schedule(self, free_slots: int) -> SchedulerOutput:
        budget = self.budget
        decodes, prefills, admitted = [], [], []
        k, k_batch = self.step_k_lookup(free_slots)
        for r in self.running:
            if not r.in_prefill and budget > 0:
                d = min(self.max_draft(r, k), budget - 1)
                decodes.append(ScheduledDecode(r, d))
                budget -= 1 + d
        for r in self.running:
            if r.in_prefill and budget > 0:
                n = min(len(r.prompt_ids) - r.num_computed, budget)
                prefills.append(ScheduledPrefill(r, r.prompt_ids[r.num_computed:r.num_computed + n]))
                budget -= n
        while self.waiting and budget > 0 and free_slots > 0 \
                and len(self.running) < self.max_num_seqs:
            r = self.waiting.popleft()
            self.running.append(r)
            admitted.append(r)
            free_slots -= 1
            n = min(len(r.prompt_ids), budget)
            prefills.append(ScheduledPrefill(r, r.prompt_ids[:n]))
            budget -= n
        return SchedulerOutput(decodes, prefills, admitted, k, k_batch)
