"""A tiny deterministic stand-in for ``actors.engine.llm_engine.LLMEngine`` (same API).

Used by the serving tests when the real engine or the model files are not
available (or ``SPECLOAD_TEST_FAKE_ENGINE=1``). Tokens are words; the output
of a prompt is a fixed function of the prompt, so every "strategy" emits the
same text, speculative ones several tokens per step, like a lossless
speculative decoder. ``step_ms`` simulates compute time (sleep, no CPU).
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from dataclasses import dataclass, field

from actors.engine.errors import InvalidRequest, QueueFull, queue_full
from actors.engine.types import RequestOutput, SamplingParams, SpecStats
from configs import metric_names as mn

VOCAB = [f"w{i}" for i in range(50)]
EOS = len(VOCAB)




class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(w.encode()) % len(VOCAB) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(" " + VOCAB[i] for i in ids if i < len(VOCAB))


@dataclass
class _Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    out: list[int] = field(default_factory=list)
    text: str = ""
    stats: SpecStats = field(default_factory=SpecStats)
    started: bool = False


class FakeEngine:
    """Fake engine. cfg keys: strategy, max_num_seqs, max_waiting, max_model_len,
    num_speculative_tokens, step_ms, replica_id."""

    def __init__(self, cfg: dict):
        self.strategy = cfg.get("strategy", "autoregressive")
        self.max_num_seqs = int(cfg.get("max_num_seqs", 8))
        self.max_waiting = int(cfg.get("max_waiting", 64))
        self.max_model_len = int(cfg.get("max_model_len", 64))
        self.k = 0 if self.strategy == "autoregressive" else int(cfg.get("num_speculative_tokens", 3))
        self.step_s = float(cfg.get("step_ms", 5)) / 1e3
        self.replica = str(cfg.get("replica_id", "0"))
        self.served_model_name = cfg.get("served_model_name") or self.strategy
        self.tokenizer = FakeTokenizer()
        self.on_step = None
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._ids: set[str] = set()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def add_request(self, request_id, prompt, params: SamplingParams) -> int:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; max_model_len is "
                                 f"{self.max_model_len}", param="prompt",
                                 code="context_length_exceeded")
        if request_id in self._ids:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if queue_full(len(self._waiting), len(self._running), self.max_num_seqs, self.max_waiting):
            raise QueueFull(f"{len(self._waiting)} requests waiting (max_waiting)")
        if params.max_tokens is None:  # the rest of the context, as the real engine
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(ids))
        self._ids.add(request_id)
        self._waiting.append(_Req(request_id, ids, params, time.monotonic()))
        return len(ids)

    def abort_request(self, request_id) -> None:
        self._waiting = [r for r in self._waiting if r.rid != request_id]
        self._running = [r for r in self._running if r.rid != request_id]
        self._ids.discard(request_id)

    def _token(self, r: _Req, i: int) -> int:
        h = zlib.crc32(bytes(str(r.prompt_ids), "ascii") + i.to_bytes(4, "little"))
        return EOS if (h % 97 == 0 and not r.params.ignore_eos) else h % len(VOCAB)

    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        while self._waiting and len(self._running) < self.max_num_seqs:
            r = self._waiting.pop(0)
            r.stats.queue_ms = (t0 - r.arrival) * 1e3
            self._running.append(r)
        time.sleep(self.step_s)
        outs, done = [], []
        emitted_total = accepted_total = draft_total = 0
        for r in self._running:
            n_emit = 1 + self.k
            new, reason, stop_reason = [], None, None
            for _ in range(n_emit):
                pos = len(r.prompt_ids) + len(r.out)
                tok = self._token(r, len(r.out))
                if tok == EOS:
                    reason = "stop"
                    break
                r.out.append(tok)
                new.append(tok)
                if tok in r.params.stop_token_ids:   # vLLM's: kept in the ids, not the text
                    reason, stop_reason = "stop", tok
                    break
                if len(r.out) >= r.params.max_tokens:
                    reason = "length"
                    break
                if pos + 1 >= self.max_model_len:
                    reason = "length"
                    break
            if self.k:
                r.stats.record(self.k, max(0, len(new) - 1))
                accepted_total += max(0, len(new) - 1)
                draft_total += self.k
            else:
                r.stats.record(0, 0)
            text = self.tokenizer.decode(new[:-1] if stop_reason is not None
                                         and not r.params.include_stop_str_in_output else new)
            for s in r.params.stop:
                full = r.text + text
                if s in full:
                    text = full[:full.index(s)][len(r.text):]
                    reason = "stop"
            r.text += text
            emitted_total += len(new)
            if reason:
                done.append(r)
            outs.append(RequestOutput(r.rid, new, text, reason is not None, reason,
                                      len(r.prompt_ids), len(r.out), r.stats,
                                      token_ts=[time.time()] * len(new),
                                      stop_reason=stop_reason))
        batch = len(self._running)
        for r in done:
            self._running.remove(r)
            self._ids.discard(r.rid)
        if self.on_step is not None:
            self.on_step({
                mn.STEP_TS: time.time(), mn.STEP_STRATEGY: self.strategy, mn.STEP_MODEL: self.served_model_name,
                mn.STEP_REPLICA: self.replica, mn.STEP_BATCH_SIZE: batch,
                mn.STEP_PREFILL_TOKENS: 0, mn.STEP_VERIFICATION_TOKENS: batch * (self.k + 1),
                mn.STEP_DRAFT_TOKENS: draft_total, mn.STEP_ACCEPTED_TOKENS: accepted_total,
                mn.STEP_EMITTED_TOKENS: emitted_total, mn.STEP_PREFILL_EMITTED_TOKENS: 0,
                mn.STEP_MS: (time.monotonic() - t0) * 1e3, mn.STEP_DRAFT_MS: 0.0,
                mn.STEP_VERIFY_MS: (time.monotonic() - t0) * 1e3,
                mn.STEP_QUEUE_DEPTH: len(self._waiting),
                mn.STEP_PADDED_TOKENS: batch * (self.k + 1), mn.STEP_CONTEXT_TOKENS: 0,
                mn.STEP_CPU_MS: 0.0, mn.STEP_VERIFY_CPU_MS: 0.0,
                mn.STEP_NUM_SPEC_TOKENS: self.k, mn.STEP_SPECULATION_OFF: "",
                mn.STEP_DEGRADED_REQUESTS: 0})
        return outs


def make_fake_engine(engine_config: dict) -> FakeEngine:
    """Engine factory for ``StrategyServer(engine_factory="tests.fake_engine:make_fake_engine")``."""
    return FakeEngine(engine_config)
