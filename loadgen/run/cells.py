"""The request plan of one cell: which prompt, max_tokens, seed and (open loop) send time
request i gets. Pure Python; no gevent.

The plan is a function of (profile seed, request index), never of the strategy,
so every strategy sees the same prompts in the same order with the same
max_tokens and seeds. ``CellPlan`` is a plain dict-serialisable dataclass so the
Locust master can ship it to workers; ``Dispenser`` hands out request indices
inside one load-generator process (worker w of n takes i = w, w + n, w + 2n ...).
"""

from __future__ import annotations

import random
import threading
import time
from email.utils import parsedate_to_datetime
from dataclasses import asdict, dataclass, field
from typing import Any

from configs.tiers import MaxTokens


@dataclass
class CellPlan:
    """Everything a load-generator process needs to run one cell (JSON/msgpack-safe)."""

    run_id: str
    strategy: str
    model: str                     # the request's "model" field
    tier: str
    output_class: str
    dataset: str
    base_url: str                  # e.g. http://127.0.0.1:8000
    arrival: str                   # "closed" | "open"
    users: int
    rate_rps: float | None
    start_ts: float                # unix s: open-loop t=0 and closed-loop start
    deadline_ts: float             # unix s: no request is sent after this
    prompts: list[list[Any]]       # [prompt_id, text, max_tokens | None], already shuffled
    max_tokens: dict[str, Any]     # MaxTokens model dump
    seed: int                      # profile seed: max_tokens draws and arrival times
    sampling: dict[str, Any]       # temperature, top_p, top_k, seed, stop
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 120.0
    cell_id: str = ""
    repeat: int = 0                # 0-based repeat of this cell (--repeats)
    headers: dict[str, str] = field(default_factory=dict)  # --header / --api-key; never written to disk
    insecure: bool = False         # https: skip certificate verification (--insecure)
    max_retries: int = 0           # re-sends of a request answered 429 (0: record it as rejected at once)
    retry_backoff_s: float = 0.5   # first retry delay, doubled per retry; never below Retry-After
    mix: list[str] = field(default_factory=list)  # models to interleave (request i -> mix[i % len]); [] = model
    sampling_label: str = "greedy"  # the cell's sampling label (configs.tiers.Sampling.name; column `sampling`)
    ignore_eos: bool = False       # output class fixes lengths: sent as ignore_eos (vLLM's field)
    min_tokens: int | None = None  # sent as min_tokens (capped at the request's max_tokens); None: not sent
    route: str = ""                # base_url's route kind (direct | strategy | model-field; column `route`)
    # direct route: the strategy's route through the Serve proxy. A user whose connection the
    # replica's listener refuses or drops (the replica was replaced and listens elsewhere, or is
    # gone) stays on it for the rest of the cell; a refused request (nothing sent) is resent there
    fallback_url: str = ""
    categories: dict[str, str] = field(default_factory=dict)   # prompt_id -> category (column `category`)

    def __repr__(self) -> str:  # headers may hold credentials: never in a log line or traceback
        return f"CellPlan(cell_id={self.cell_id!r}, base_url={self.base_url!r}, headers=<redacted>)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CellPlan":
        return cls(**d)


def shuffled_prompts(prompts: list, seed: int) -> list:
    """The run's prompt order: one seeded shuffle, identical for every strategy."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    return order


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (RFC 9110 section 10.2.3: delay-seconds or an HTTP date); None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass

    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def retry_delay_s(attempt: int, retry_after_s: float | None, backoff_s: float, cap_s: float = 30.0) -> float:
    """Seconds to wait before re-send ``attempt`` (1-based) of a request answered 429.

    Exponential backoff ``backoff_s * 2**(attempt-1)``, capped at ``cap_s``, and
    never shorter than the server's ``Retry-After`` (RFC 9110 section 10.2.3).
    """
    return max(min(backoff_s * 2 ** (attempt - 1), cap_s), retry_after_s or 0.0)


def poisson_schedule(rate_rps: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets in seconds from cell start, Poisson at ``rate_rps`` over ``duration_s``."""
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate_rps)
        if t >= duration_s:
            return out
        out.append(t)


@dataclass(frozen=True)
class Job:
    """One request to send: its index, scheduled unix time (None: now), body and prompt id."""

    index: int
    scheduled_ts: float | None
    prompt_id: str
    body: dict[str, Any]
    strategy: str = ""             # row's strategy (the plan's, or the mix entry this request went to)


class Dispenser:
    """Hands request indices of a ``CellPlan`` to this process's users.

    ``worker_index`` / ``n_workers`` split the index space between Locust
    workers. Closed loop: indices until the deadline. Open loop: the Poisson
    schedule's slots, each with its scheduled send time (unix s).
    """

    def __init__(self, plan: CellPlan, worker_index: int = 0, n_workers: int = 1) -> None:
        self.plan = plan
        self.worker_index = worker_index
        self.n_workers = max(1, n_workers)
        self._k = 0
        self._lock = threading.Lock()  # cheap; users are greenlets, but keep it correct anywhere
        self._mt = MaxTokens.model_validate(plan.max_tokens)
        self.in_flight = 0
        self.closed = False
        self.schedule: list[float] | None = None
        if plan.arrival == "open":
            dur = plan.deadline_ts - plan.start_ts
            self.schedule = [plan.start_ts + s for s in
                             poisson_schedule(float(plan.rate_rps or 0), dur, plan.seed)]

    def job(self, index: int, scheduled_ts: float | None) -> Job:
        p = self.plan
        pid, text, ds_max = p.prompts[index % len(p.prompts)]
        max_tokens = ds_max or self._mt.sample(random.Random(f"max-tokens-{p.seed}-{index}"))
        model = p.mix[index % len(p.mix)] if p.mix else p.model
        body: dict[str, Any] = {
            "model": model, "prompt": text, "max_tokens": int(max_tokens),
            "temperature": p.sampling.get("temperature", 0.0),
            "top_p": p.sampling.get("top_p", 1.0), "top_k": p.sampling.get("top_k", 0),
            # continuous_usage_stats (vLLM, SGLang): cumulative usage on every chunk, so each chunk's
            # token count is known and ITL is per token (docs/metrics.md); specload's service sends
            # spec_decode.num_tokens per chunk anyway and accepts the field
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if p.sampling.get("seed") is not None:
            body["seed"] = int(p.sampling["seed"]) + index
        if p.sampling.get("stop"):
            body["stop"] = p.sampling["stop"]
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.min_tokens:
            body["min_tokens"] = min(int(p.min_tokens), int(max_tokens))
        body.update(p.extra_body)
        return Job(index, scheduled_ts, pid, body, model if p.mix else p.strategy)

    def next(self, now: float | None = None) -> Job | None:
        """The next request for this process, or None when the cell has no more to send."""
        now = time.time() if now is None else now
        with self._lock:
            if self.closed:
                return None
            i = self.worker_index + self._k * self.n_workers
            if self.schedule is None:
                if now >= self.plan.deadline_ts:
                    return None
                self._k += 1
                return self.job(i, None)
            if i >= len(self.schedule):
                return None
            self._k += 1
            return self.job(i, self.schedule[i])

    def close(self, now: float | None = None) -> list[Job]:
        """Stop handing out requests; returns the open-loop slots due by ``now`` never handed out."""
        now = time.time() if now is None else now
        with self._lock:
            self.closed = True
            if self.schedule is None:
                return []
            out = []
            i = self.worker_index + self._k * self.n_workers
            while i < len(self.schedule) and self.schedule[i] <= now:
                out.append(self.job(i, self.schedule[i]))
                i += self.n_workers
            return out
