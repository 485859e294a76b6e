"""The batched speculative decoding engine (one per replica).

One step = { schedule -> propose (drafter, batched) -> verify (ONE target
forward over every running request's ``[last token, drafts...]``, ragged
draft lengths padded) -> accept (shared verifier) -> KV rollback
(``KVSlotPool.rollback``: the rejected drafts leave the cache) -> stream
accepted tokens } plus one forward for prefill chunks. Every step appends a
row to the step log (``on_step``). The engine sets no process-wide state
(torch threads are the replica's or the CLI's business).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from actors.engine import memory as mem
from actors.engine.config import EngineConfig
from actors.engine.detokenizer import Detokenizer
from actors.engine.errors import InvalidRequest, QueueFull, check_prompt_ids, queue_full
from actors.engine.model import CausalLM
from actors.engine.prefix_cache import PrefixCache
from actors.engine.runner import ModelRunner, RowInput
from actors.engine.logprobs import emitted_logprobs
from actors.engine.sampling import make_generator, mask_min_tokens
from actors.engine.scheduler import Request, ScheduledDecode, ScheduledPrefill, Scheduler
from actors.engine.strategies import get_proposer_class
from actors.engine.types import (DraftProposal, MemoryReport, ProposeInput, RequestOutput,
                                 SamplingParams, VerificationResult)
from actors.engine.verifier import verify_batch
from configs import metric_names as M
from configs.results_schema import StepRow
from configs.serve_config import spec_schedule_k, unconditional_to_conditional_rates

logger = logging.getLogger(__name__)

QueueFullError = QueueFull  # raised by ``add_request`` when max_waiting requests wait (429)


@dataclass
class _StepCounters:
    """What one step did, summed over its requests (tokens; ms)."""

    prefill_tokens: int = 0
    verification_tokens: int = 0
    padded_tokens: int = 0          # decode forward: tokens it computed (batch x longest row
                                    # when it padded, else the rows' own tokens)
    context_tokens: int = 0         # decode forward: sum over rows of the KV length attended
    batch_size: int = 0             # decoding requests whose verification completed
    draft_tokens: int = 0
    accepted_tokens: int = 0        # accepted drafts the users received (cuts applied)
    emitted_tokens: int = 0         # tokens verification delivered (cuts applied)
    prefill_emitted_tokens: int = 0  # first tokens sampled from the prefill forward
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    verify_cpu_ms: float = 0.0      # this thread's CPU time in the verify phase (no time-sharing waits)
    num_speculative_tokens: int = 0  # k of the step
    k_batch_size: int | None = None  # the batch size k was looked up with (None: fixed k)
    speculation_off: set[str] = field(default_factory=set)  # M.SPEC_OFF_REASONS seen this step
    degraded_requests: int = 0      # requests whose drafter was dropped this step


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of an HF model directory. A plain ``tokenizer.json`` tokenizer
    (``tokenizer_class`` PreTrainedTokenizerFast, what the embedded models have) loads
    through that class directly: ``AutoTokenizer``'s import resolves transformers' whole
    model registry (about 2.3 s of every engine process's start-up here). Anything else
    goes through ``AutoTokenizer``. Raises what transformers raises (OSError for a
    directory without a tokenizer)."""
    cfg = Path(model_dir) / "tokenizer_config.json"
    try:
        cls_name = json.loads(cfg.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls_name = None
    if cls_name in ("PreTrainedTokenizerFast", "TokenizersBackend") \
            and (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class LLMEngine:
    """Continuous-batching engine with a pluggable proposer.

    Raises InvalidRequest (a ValueError with ``param``) from ``add_request`` on
    bad input; a bad request never touches the running batch. A fault while
    serving one request (the target forward, sampling, detokenizing, the stop
    check) finishes that request alone with finish_reason "error". A drafter
    fault does not: a proposer that raises (``add_request``, ``propose``,
    ``observe_target``), returns an invalid draft or misses ``draft_deadline_ms``
    *degrades* the request: it decodes autoregressively (target alone, no drafts)
    for the rest of its life and succeeds, its output unchanged (lossless either
    way); the rest of the batch keeps speculating. Counted in
    ``degraded_requests`` (reason -> requests since start), the request's
    ``SpecStats.degraded_reason`` and the step row's ``degraded_requests`` /
    ``speculation_off``.
    """

    # Tests inject a fault into one request through this: called as
    # ``fault_hook(phase, request_id)`` inside each guarded phase (propose,
    # forward, sample, detokenize); whatever it raises is that request's fault.
    fault_hook: Callable[[str, str], None] | None = None

    def __init__(self, config: EngineConfig, on_step: Callable[[StepRow], None] | None = None):
        if config.backend != "embedded":
            raise ValueError(f"backend {config.backend!r}: this is the embedded engine; vLLM's "
                             "runs in its venv (actors.engine.vllm_backend.make_vllm_engine, "
                             "which StrategyReplica starts for backend vllm)")
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.device = config.resolved_device()
        self.model = CausalLM.from_pretrained(config.model, device=self.device,
                                              dtype=config.resolved_dtype())
        mc = self.model.config
        self.max_model_len = min(config.max_model_len or min(mc.max_position_embeddings, 4096),
                                 mc.max_position_embeddings)
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None \
            else mc.eos_token_id
        self.detok = Detokenizer(self.tokenizer, eos, self.max_model_len)
        # characters of the longest vocabulary entry (added tokens included): bounds how
        # few tokens a text can be (byte-level BPE: one character per byte)
        self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) or 1
        cls = get_proposer_class(config.strategy)
        options = config.strategy_options_model()  # validated by EngineConfig
        k = config.num_speculative_tokens
        self.num_speculative_tokens = cls.default_num_speculative_tokens if k is None else k
        self.proposer = cls(self.model, self.num_speculative_tokens, config.max_num_seqs,
                            self.max_model_len, config.draft_model, options)
        self.aux_layers = tuple(self.proposer.aux_layers)
        self.runner = ModelRunner(self.model, config.max_num_seqs, self.max_model_len,
                                  pad_id=self.eos_token_id or 0)
        self.kv = self.runner.pool   # the target cache's slots and per-request lengths
        # enforce_eager off: the target's decode / verify forwards compiled (not for
        # proposers that read the target's hidden states: those forwards stay eager)
        self.compiled = False
        if not config.enforce_eager and not self.aux_layers:
            self.compiled = self.runner.compile()
            self.proposer.compile()
        logger.info("target forward route: %s", self.runner.route.name)
        self.prefix_cache = PrefixCache(self.runner.cache, config.prefix_cache_tokens) \
            if config.enable_prefix_caching and not self.aux_layers else None
        self.served_model_name = config.served_model_name or config.strategy
        # k per step from the batch size (num_speculative_tokens_per_batch_size; validated)
        self.spec_schedule = config.spec_schedule()
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.num_speculative_tokens,
                                   config.max_waiting, None if self.spec_schedule is None else
                                   functools.partial(spec_schedule_k, self.spec_schedule))
        self.draft_deadline_ms = config.draft_deadline_ms
        self._init_accept_rule(config)
        # reason (M.DEGRADE_REASONS) -> requests degraded to autoregressive since start
        self.degraded_requests: collections.Counter[str] = collections.Counter()
        self.requests: dict[str, Request] = {}
        self.on_step = on_step
        self._memory_static = self._static_memory()
        # the startup's objects (model, tokenizer, imports) out of the cyclic collector's
        # reach, as vLLM's engine core does after startup (``gc.freeze``): a collection
        # then walks only what the steps allocate (1-6% of a batch-1 step here)
        gc.collect()
        gc.freeze()

    def _init_accept_rule(self, config: EngineConfig) -> None:
        """The accept rule (vLLM's ``rejection_sample_method``): standard | synthetic |
        block. synthetic: per-position unconditional rates [k] -> conditional ones; greedy
        requests (no generator of their own) draw the forced decisions from one
        engine-level generator (seed 0: a run is reproducible)."""
        self.rejection_sample_method = config.rejection_sample_method
        rates = config.synthetic_rates()
        self.synthetic_acceptance_rates = rates
        self.synthetic_conditional_rates = \
            unconditional_to_conditional_rates(rates) if rates is not None else None
        self._synthetic_generator = torch.Generator().manual_seed(0) \
            if rates is not None else None

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends a request (held by the detokenizer, which applies it)."""
        return self.detok.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self.detok.eos_token_id = value

    # -- request lifecycle ------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams) -> int:
        """Queue a request; returns its prompt length in tokens.

        Raises InvalidRequest naming the field (``param="prompt"``) for an
        empty prompt, a prompt that leaves no room to generate within
        ``max_model_len``, token ids out of the vocabulary, or a duplicate id;
        QueueFullError when ``max_waiting`` requests already wait.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be a SamplingParams")
        if request_id in self.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must be a non-empty string", param="prompt")
            # no token is longer than _max_token_chars characters, so a prompt of N
            # characters is at least ceil(N / that) tokens: one far over the context is
            # refused before tokenizing it (tokenizing megabytes would stall every
            # request of this replica for seconds)
            at_least = -(-len(prompt) // self._max_token_chars)
            if at_least >= self.max_model_len:
                raise InvalidRequest(
                    f"prompt is at least {at_least} tokens ({len(prompt)} characters); "
                    f"max_model_len is {self.max_model_len}, which leaves no room to "
                    "generate", param="prompt", code="context_length_exceeded")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = list(prompt)
        check_prompt_ids(ids, self.model.config.vocab_size, self.max_model_len,
                         check_vocab=not isinstance(prompt, str))
        if queue_full(len(self.scheduler.waiting), len(self.scheduler.running),
                      self.config.max_num_seqs, self.config.max_waiting):
            raise QueueFullError(f"{self.num_waiting} requests are waiting "
                                 f"(max_waiting={self.config.max_waiting})")
        if params.max_tokens is None:  # the rest of the context (OpenAI chat, vLLM)
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(ids))
        gen = None if params.greedy else make_generator(params.seed)
        req = Request(request_id, ids, params, gen)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return len(ids)

    def abort_request(self, request_id: str) -> None:
        """Drop a request, freeing its KV slot; unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.remove(request_id)
        self._release(req)

    def _release(self, req: Request) -> None:
        if req.slot >= 0:
            if self.prefix_cache is not None and req.finish_reason != "error":
                self.prefix_cache.store(req.prompt_ids, req.slot,
                                        min(req.num_computed, len(req.prompt_ids)))
            # the running requests keep slots 0..n-1, so a batch reads its K/V as a
            # view of the cache, not a gather per layer (KVCache.release)
            moved = self.runner.cache.release(req.request_id)
            req.slot = -1
            if moved is not None and moved[0] in self.requests:
                self.requests[moved[0]].slot = moved[1]
            try:
                self.proposer.remove_request(req.request_id)
            except Exception:  # noqa: BLE001 - a proposer fault must not stop the loop
                logger.exception("proposer.remove_request(%s) failed", req.request_id)

    # -- memory -----------------------------------------------------------------
    def _static_memory(self) -> MemoryReport:
        cfg, cache = self.model.config, self.runner.cache
        out = {"strategy": self.config.strategy, "replica": self.config.replica_id,
               "device": str(self.device), "dtype": str(cache.k[0].dtype).replace("torch.", ""),
               "max_num_seqs": self.config.max_num_seqs, "max_model_len": self.max_model_len,
               "num_speculative_tokens": self.num_speculative_tokens,
               "rejection_sample_method": self.rejection_sample_method,
               "synthetic": self.synthetic_acceptance_rates is not None,
               "target_weight_bytes": mem.unique_bytes(mem.module_tensors(self.model)),
               "target_fused_weight_bytes": mem.unique_bytes(mem.fused_tensors(self.model)),
               "target_kv_allocated_bytes": mem.cache_bytes(cache.k, cache.v),
               "target_kv_bytes_per_token": mem.kv_bytes_per_token(
                   cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cache.k[0].dtype)}
        out.update(self.proposer.memory())
        return out

    def memory(self) -> MemoryReport:
        """This replica's memory, bytes unless named otherwise.

        Static: target / draft weight bytes (parameters and buffers, shared
        tensors once; ``*_fused_weight_bytes``: the engine's fused inference
        copies), KV cache allocated bytes and bytes per token (target cache and
        the proposer's own). Live, from the caches' slot pools: KV tokens held
        now and at peak since start or ``reset_peak_memory`` (a step's writes
        count before the rejected drafts are rolled back),
        ``*_kv_peak_used_bytes`` = peak tokens x bytes per token; and the
        process's RSS (CPU) or ``torch.cuda.max_memory_allocated`` (GPU).
        Safe to call from another thread (it reads counters the engine sets).
        """
        out = dict(self._memory_static)
        dpool = self.proposer.kv_pool()
        t_now, t_peak = self.kv.used, self.kv.peak_used
        d_now, d_peak = (dpool.used, dpool.peak_used) if dpool is not None else (0, 0)
        out.update(target_kv_tokens_used=t_now, target_kv_peak_tokens=t_peak,
                   target_kv_peak_used_bytes=t_peak * out["target_kv_bytes_per_token"],
                   draft_kv_tokens_used=d_now, draft_kv_peak_tokens=d_peak,
                   draft_kv_peak_used_bytes=d_peak * out["draft_kv_bytes_per_token"])
        out.update(mem.process_memory(self.device))
        return out

    def reset_peak_memory(self) -> None:
        """Restart the peak KV counters (and CUDA's peak statistics) from the current values."""
        self.kv.reset_peak()
        dpool = self.proposer.kv_pool()
        if dpool is not None:
            dpool.reset_peak()
        if self.device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(self.device)

    def reset_prefix_cache(self) -> bool:
        """Forget every stored prefix block (vLLM's ``POST /reset_prefix_cache``): each cell
        of a load run starts from the same cold cache, so a repeat is not sped up by the
        prompts its strategy saw in earlier cells. Call between steps (the serve layer
        applies it as a command). Returns True (no prefix cache: nothing to forget)."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        return True

    # -- fault isolation ----------------------------------------------------------
    # Every per-request phase runs under a guard. A batched phase (the target
    # forward, sampling) that raises is retried one request at a time, so only the
    # request that fails alone is finished with finish_reason "error"; the rest
    # of the batch and the engine loop go on. Drafting is retried the same way but
    # degrades its culprit instead of failing it (``_propose``).
    def _hook(self, phase: str, request_id: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase, request_id)

    def _fail(self, r: Request, phase: str, exc: BaseException) -> None:
        """Finish ``r`` alone with finish_reason "error" (released in ``_finish``)."""
        logger.warning("request %s failed in %s: %r", r.request_id, phase, exc)
        r.finish_reason = "error"
        r.error = f"{phase} failed: {type(exc).__name__}: {exc}"

    def _isolated(self, phase: str, fn: Callable[[list], list], reqs: list[Request],
                  items: list) -> list:
        """``fn(items)`` -> one result per item. When the batch raises, each item is
        retried alone; a request whose item still raises gets ``_fail`` (result None)."""
        def call(rs, its):
            for r in rs:
                self._hook(phase, r.request_id)
            out = list(fn(its))
            if len(out) != len(its):
                raise RuntimeError(f"{phase} returned {len(out)} results for {len(its)} requests")
            return out
        # The batched attempt may have drawn from seeded generators before it raised:
        # rewind them so a retried request samples exactly what it would have alone.
        rng = [(g, g.get_state()) for g in {id(r.generator): r.generator for r in reqs
                                             if r.generator is not None}.values()]
        try:
            return call(reqs, items)
        except Exception as exc:  # noqa: BLE001 - isolate, then fail only the culprit
            if len(items) == 1:
                self._fail(reqs[0], phase, exc)
                return [None]
        for g, state in rng:
            g.set_state(state)
        out = []
        for r, it in zip(reqs, items):
            try:
                out.append(call([r], [it])[0])
            except Exception as exc:  # noqa: BLE001
                self._fail(r, phase, exc)
                out.append(None)
        return out

    # -- degrade instead of fail: a drafter fault costs its request the drafts only --
    def _degrade(self, r: Request, reason: str, detail: str, stats: "_StepCounters") -> None:
        """Drop ``r``'s drafter: it decodes autoregressively (k = 0) from now on.

        reason: one of ``M.DEGRADE_REASONS``; counted once per request in
        ``degraded_requests``, ``r.stats.degraded_reason`` and the step row."""
        if r.degraded:
            return
        logger.warning("request %s: %s drafter dropped (%s: %s); it decodes "
                       "autoregressively from now on", r.request_id, self.proposer.name,
                       reason, detail)
        r.degraded = r.stats.degraded_reason = reason
        self.degraded_requests[reason] += 1
        stats.degraded_requests += 1

    def _observe(self, r: Request, start: int, token_ids: list[int],
                 aux: torch.Tensor | None, stats: "_StepCounters") -> None:
        """``proposer.observe_target`` for a request that still drafts; a proposer
        that raises degrades the request."""
        if r.degraded:
            return
        try:
            self.proposer.observe_target(r.request_id, start, token_ids, aux)
        except Exception as exc:  # noqa: BLE001 - the drafter's fault, not the request's
            self._degrade(r, M.DEGRADE_DRAFTER_ERROR, f"observe_target raised {exc!r}", stats)

    def _check_draft(self, p: object, item: ProposeInput) -> str | None:
        """What is wrong with proposal ``p`` for ``item`` (None: usable).

        Usable: a ``DraftProposal`` of at most ``item.max_draft`` int token ids in
        [0, vocab), and probs either None or an [n, V] tensor of finite q >= 0 whose
        rows sum to 1 (1e-3) and give each drafted token q > 0 (it was drawn from q).
        """
        if not isinstance(p, DraftProposal):
            return f"expected a DraftProposal, got {type(p).__name__}"
        toks, V = p.token_ids, self.model.config.vocab_size
        if not isinstance(toks, (list, tuple)):
            return f"token_ids must be a list, got {type(toks).__name__}"
        if len(toks) > item.max_draft:
            return f"{len(toks)} tokens proposed; at most {item.max_draft} were allowed"
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V for t in toks):
            return f"token ids outside [0, {V}) or not Python ints: {list(toks)[:8]}"
        q = p.probs
        if q is None:
            return None
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (len(toks), V):
            return (f"probs must be a [{len(toks)}, {V}] tensor, got "
                    f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        if toks:
            qf = q.float()
            ok = (torch.isfinite(qf).all() & (qf >= 0).all()
                  & (qf[torch.arange(len(toks), device=qf.device),
                        torch.tensor(toks, device=qf.device)] > 0).all()
                  & ((qf.sum(-1) - 1).abs() <= 1e-3).all())
            if not bool(ok):
                return "probs are not distributions the tokens were drawn from (NaN, < 0, " \
                       "rows not summing to 1, or q = 0 at a drafted token)"
        return None

    def _propose_call(self, reqs: list[Request], items: list[ProposeInput]
                      ) -> tuple[list | None, str, str]:
        """One ``proposer.propose`` call -> (results, reason, detail); results None
        and reason set when it raised or returned the wrong number of proposals;
        reason ``draft_deadline`` (results kept) when it returned too late."""
        try:
            for r in reqs:
                self._hook("propose", r.request_id)
            t = time.perf_counter()
            out = self.proposer.propose(items)
            ms = (time.perf_counter() - t) * 1e3
            out = list(out)
        except Exception as exc:  # noqa: BLE001 - the drafter's fault
            return None, M.DEGRADE_DRAFTER_ERROR, f"propose raised {exc!r}"
        if len(out) != len(items):
            return None, M.DEGRADE_INVALID_DRAFT, (f"propose returned {len(out)} proposals "
                                                   f"for {len(items)} requests")
        if self.draft_deadline_ms is not None and ms > self.draft_deadline_ms:
            return out, M.DEGRADE_DRAFT_DEADLINE, (f"propose took {ms:.1f} ms for {len(items)} "
                                                   f"requests (draft_deadline_ms "
                                                   f"{self.draft_deadline_ms:g})")
        return out, "", ""

    def _propose(self, decodes: list[ScheduledDecode], stats: "_StepCounters"
                 ) -> list[DraftProposal]:
        """Drafts for every decoding request (same order); never fails a request.

        The proposer is asked, in one batched call, for the requests that may draft
        this step (``max_draft`` > 0, drafter not dropped); the others get no drafts.
        A batched call that raises, returns the wrong number of proposals or misses
        ``draft_deadline_ms`` is retried request by request (seeded generators
        rewound first), so only a request whose own call fails is degraded; an
        invalid proposal (``_check_draft``) degrades its request alone. A degraded
        request gets no drafts this step either, its generator rewound to before
        the failed call."""
        out = [DraftProposal(token_ids=[]) for _ in decodes]
        idx = [i for i, d in enumerate(decodes) if d.max_draft > 0 and not d.request.degraded]
        if not idx:
            return out
        reqs = [decodes[i].request for i in idx]
        items = [ProposeInput(r.request_id, r.all_ids, decodes[i].max_draft, r.params,
                              r.generator, len(r.output_ids), self.eos_token_id)
                 for i, r in zip(idx, reqs)]
        gens = [(r, r.generator.get_state() if r.generator is not None else None) for r in reqs]

        def rewind(r, state):
            if state is not None:
                r.generator.set_state(state)

        res, reason, detail = self._propose_call(reqs, items)
        if res is not None and not reason:
            for i, r, item, p, (_, state) in zip(idx, reqs, items, res, gens):
                bad = self._check_draft(p, item)
                if bad is None:
                    out[i] = p
                else:
                    rewind(r, state)
                    self._degrade(r, M.DEGRADE_INVALID_DRAFT, bad, stats)
            return out
        if len(items) == 1:
            rewind(*gens[0])
            self._degrade(reqs[0], reason, detail, stats)
            return out
        logger.warning("%s propose for %d requests: %s (%s); retrying request by request",
                       self.proposer.name, len(items), reason, detail)
        for r, state in gens:
            rewind(r, state)
        for i, r, item, (_, state) in zip(idx, reqs, items, gens):
            one, reason, detail = self._propose_call([r], [item])
            bad = detail if reason else self._check_draft(one[0], item)
            if bad is None:
                out[i] = one[0]
            else:
                rewind(r, state)
                self._degrade(r, reason or M.DEGRADE_INVALID_DRAFT, bad, stats)
        return out

    def _forward(self, rows: list[RowInput], last_only: bool = False) -> list[tuple]:
        """Target forward -> [(logits_i, aux_i or None)] per row."""
        logits, aux = self.runner.run(rows, last_only=last_only, aux_layers=self.aux_layers)
        return [(lg, aux[i] if aux is not None else None) for i, lg in enumerate(logits)]

    # -- the step: one function per phase ---------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns deltas for requests that emitted or finished.

        Phases: schedule + admit (prefix-cache hits copied in) -> decode (propose,
        verify, accept + KV rollback) -> prefill chunks -> finish (outputs, release) ->
        step-log row. Decodes and prompt chunks share one packed target forward when
        the step has both (``_mixed``); the step row's ``verify_ms`` then includes the
        chunks' share of that forward.
        A request that fails in this step is in the deltas with finish_reason
        "error" and ``error`` set; it is left out of the step row's token counts.
        """
        t0, c0 = time.perf_counter(), time.thread_time()
        self.runner.paths.clear()      # the step row's forward_path: this step's forwards
        draft_paths = getattr(self.proposer, "paths", None)
        if draft_paths is not None:
            draft_paths.clear()        # ... and its draft_forward_path
        sched = self.scheduler.schedule(self.kv.num_free)
        touched: dict[str, Request] = {}
        stats = _StepCounters(num_speculative_tokens=sched.num_speculative_tokens,
                              k_batch_size=sched.k_batch_size)
        self._admit(sched.admitted, t0, touched, stats)
        if self.prefix_cache is not None and sched.admitted:
            # an admitted prompt's prefix found in the prefix cache is not computed again:
            # its first chunk starts after it (no longer than scheduled)
            new = {id(r) for r in sched.admitted if r.num_computed}
            for p in sched.prefills:
                r = p.request
                if id(r) in new:
                    p.chunk = r.prompt_ids[r.num_computed:r.num_computed + len(p.chunk)]
        decodes = [d for d in sched.decodes if d.request.finish_reason is None]
        prefills = [p for p in sched.prefills if p.request.finish_reason is None]
        if decodes and prefills and self.runner.fuses(
                [len(p.chunk) for p in prefills] + [1 + self.num_speculative_tokens]):
            self._mixed(decodes, prefills, stats, touched)
        else:
            if decodes:
                self._decode(decodes, stats, touched)
            if prefills:
                self._prefill(prefills, stats, touched)
        outputs = self._finish(list(touched.values()))
        if self.on_step is not None and (sched.decodes or sched.prefills):
            self.on_step(self._step_row(stats, t0, c0))
        return outputs

    def _admit(self, admitted: list[Request], now: float, touched: dict[str, Request],
               stats: "_StepCounters") -> None:
        """Give each newly scheduled request a KV slot and tell the proposer (a
        proposer that raises degrades the request to autoregressive decoding)."""
        for r in admitted:
            r.slot = self.kv.allocate(r.request_id)
            r.first_scheduled = now
            r.stats.queue_ms = (now - r.arrival) * 1e3
            if self.prefix_cache is not None:
                n = self.prefix_cache.load(r.prompt_ids, r.slot)
                if n:
                    self.kv.append(r.request_id, n)
                    r.num_computed = n
            try:
                self.proposer.add_request(r.request_id, r.prompt_ids)
            except Exception as exc:  # noqa: BLE001
                self._degrade(r, M.DEGRADE_DRAFTER_ERROR, f"add_request raised {exc!r}", stats)

    def _decode(self, decodes: list[ScheduledDecode], stats: "_StepCounters",
                touched: dict[str, Request]) -> None:
        """Propose for every decoding request, verify all drafts in one target
        forward, accept, roll rejected drafts out of the KV cache, emit."""
        live, rows, clock = self._decode_rows(decodes, stats, touched)
        fwd = self._isolated("forward", self._forward, [r for r, _ in live], rows) \
            if rows else []
        self._decode_done(decodes, live, rows, fwd, clock, stats)

    def _mixed(self, decodes: list[ScheduledDecode], prefills: list[ScheduledPrefill],
               stats: "_StepCounters", touched: dict[str, Request]) -> None:
        """Decodes and prompt chunks of one step in ONE target forward (packed, no
        padding: ``ModelRunner.run_packed``): the arriving requests' prefill rides
        with the running requests' verification instead of a second forward. Same
        results as ``_decode`` then ``_prefill``; a forward that raises is retried
        request by request as there."""
        live, rows, clock = self._decode_rows(decodes, stats, touched)
        preqs = [p.request for p in prefills]
        prows = [RowInput(r.slot, self.kv.append(r.request_id, len(p.chunk)), p.chunk)
                 for r, p in zip(preqs, prefills)]
        n_dec = len(rows)
        last = [False] * n_dec + [True] * len(prows)

        def fwd_all(items):
            its_rows = [row for row, _ in items]
            logits, aux = self.runner.run(its_rows, last_only=[lo for _, lo in items],
                                          aux_layers=self.aux_layers)
            return [(lg, aux[i] if aux is not None else None) for i, lg in enumerate(logits)]

        fwd = self._isolated("forward", fwd_all, [r for r, _ in live] + preqs,
                             list(zip(rows + prows, last)))
        self._decode_done(decodes, live, rows, fwd[:n_dec], clock, stats)
        self._prefill_done(prefills, prows, fwd[n_dec:], stats, touched)

    def _decode_rows(self, decodes: list[ScheduledDecode], stats: "_StepCounters",
                     touched: dict[str, Request]) -> tuple[list, list[RowInput], tuple]:
        """Propose for every decoding request; its verification row ``[last token,
        drafts...]`` (KV positions reserved). Returns (live, rows, clock)."""
        td = time.perf_counter()
        props = self._propose(decodes, stats)
        tv, cv = time.perf_counter(), time.thread_time()
        live: list[tuple[Request, DraftProposal]] = []
        for d, p in zip(decodes, props):
            r = d.request
            touched[r.request_id] = r
            live.append((r, p))
            if r.degraded:
                stats.speculation_off.add(r.degraded)
            elif stats.num_speculative_tokens == 0 and self.num_speculative_tokens > 0:
                stats.speculation_off.add(M.SPEC_OFF_BATCH_SIZE_POLICY)
        rows = [RowInput(r.slot, self.kv.append(r.request_id, 1 + len(p.token_ids)),
                         [r.output_ids[-1]] + p.token_ids) for r, p in live]
        return live, rows, (td, tv, cv)

    def _decode_done(self, decodes: list[ScheduledDecode], live: list, rows: list[RowInput],
                     fwd: list, clock: tuple, stats: "_StepCounters") -> None:
        """Verify every row's draft from its forward result, accept, roll back, emit."""
        td, tv, cv = clock
        reqs = [d.request for d in decodes]
        if rows:
            # what the forward computed: B x longest row where it padded the rows, else each
            # row's own tokens (the stack, flat and packed forwards are ragged)
            stats.padded_tokens = (len(rows) * max(len(x.token_ids) for x in rows)
                                   if self.runner.last_padded else sum(len(x.token_ids) for x in rows))
            stats.context_tokens = sum(x.start + len(x.token_ids) for x in rows)
            ok = [(r, p, row, f) for (r, p), row, f in zip(live, rows, fwd) if f is not None]
            for r, _, _, f in ok:   # min_tokens: EOS is -inf where it may not come yet
                if r.params.min_tokens > len(r.output_ids):
                    mask_min_tokens(f[0], len(r.output_ids), r.params, self.eos_token_id)
            # every verdict of the batch from one device-to-host transfer (a batch that
            # raises is retried request by request, so a bad row fails alone)
            verdicts = self._isolated("sample", lambda items: verify_batch(
                [f[0] for _, _, _, f in items], [len(row.token_ids) for _, _, row, _ in items],
                [p.token_ids for _, p, _, _ in items], [p.probs for _, p, _, _ in items],
                [r.params for r, _, _, _ in items], [r.generator for r, _, _, _ in items],
                self.rejection_sample_method, self.synthetic_conditional_rates,
                self._synthetic_generator), [r for r, _, _, _ in ok], ok)
            for (r, p, row, f), res in zip(ok, verdicts):
                if res is not None:
                    self._accept(r, p, row, res, f, stats)
        draft_ms, verify_ms = (tv - td) * 1e3, (time.perf_counter() - tv) * 1e3
        stats.draft_ms, stats.verify_ms = draft_ms, verify_ms
        stats.verify_cpu_ms = (time.thread_time() - cv) * 1e3
        for r in reqs:
            r.stats.draft_ms += draft_ms
            r.stats.verify_ms += verify_ms

    def _accept(self, r: Request, p: DraftProposal, row: RowInput, res: VerificationResult,
                fwd: tuple, stats: "_StepCounters") -> None:
        """Apply one request's verdict (``verify_batch``): keep the accepted prefix
        plus one target token and roll the rest out of the cache.

        Counts what the user received: of the accepted drafts + bonus token only
        ``kept`` survive EOS / max_tokens / a stop string; the step's own token
        is one of them, the other kept - 1 are accepted drafts. A fault fails
        ``r`` alone (not counted). fwd: (logits [len(row), V], aux or None) of
        the row; a request that asked for logprobs gets them from those logits."""
        logits, aux = fwd
        phase = "accept"
        try:
            committed = row.token_ids[:1 + res.num_accepted]
            self.kv.rollback(r.request_id, row.start + len(committed))
            r.num_computed = self.kv.length(r.request_id)
            self._observe(r, row.start, committed,
                          aux[:len(committed)] if aux is not None else None, stats)
            phase = "logprobs"
            lps = None if r.params.logprobs is None else emitted_logprobs(
                logits, res.emitted, r.params, r.params.logprobs)
            phase = "detokenize"
            self._hook(phase, r.request_id)
            kept = self.detok.append(r, res.emitted, lps)
        except Exception as exc:  # noqa: BLE001
            self._fail(r, phase, exc)
            return
        accepted = max(0, kept - 1)
        r.stats.synthetic = self.synthetic_acceptance_rates is not None
        r.stats.record(len(p.token_ids), accepted)
        stats.batch_size += 1
        stats.draft_tokens += len(p.token_ids)
        stats.accepted_tokens += accepted
        stats.verification_tokens += len(row.token_ids)
        stats.emitted_tokens += kept

    def _prefill(self, prefills: list[ScheduledPrefill], stats: "_StepCounters",
                 touched: dict[str, Request]) -> None:
        """Forward this step's prompt chunks; a request whose prompt is done emits
        its first token (counted as prefill-emitted, not as verification output)."""
        reqs = [p.request for p in prefills]
        rows = [RowInput(r.slot, self.kv.append(r.request_id, len(p.chunk)), p.chunk)
                for r, p in zip(reqs, prefills)]
        fwd = self._isolated("forward", lambda rws: self._forward(rws, last_only=True),
                             reqs, rows)
        self._prefill_done(prefills, rows, fwd, stats, touched)

    def _prefill_done(self, prefills: list[ScheduledPrefill], rows: list[RowInput], fwd: list,
                      stats: "_StepCounters", touched: dict[str, Request]) -> None:
        """After the prompt chunks' forward (``fwd``: (last logits [1, V], aux) per row or
        None when it failed): observe, and sample the first token of every finished prompt."""
        reqs = [p.request for p in prefills]
        done: list[tuple[Request, torch.Tensor]] = []  # prompt finished: first token due
        for r, p, row, f in zip(reqs, prefills, rows, fwd):
            if f is None:
                touched[r.request_id] = r
                continue
            try:
                r.num_computed = self.kv.length(r.request_id)
                stats.prefill_tokens += len(p.chunk)
                self._observe(r, row.start, p.chunk, f[1], stats)
            except Exception as exc:  # noqa: BLE001
                touched[r.request_id] = r
                self._fail(r, "observe", exc)
                continue
            if not r.in_prefill:
                touched[r.request_id] = r
                if r.params.min_tokens > 0:
                    mask_min_tokens(f[0][-1:], 0, r.params, self.eos_token_id)
                done.append((r, f[0][-1:]))
        if not done:
            return
        # the first tokens: a verification with no drafts, all rows in one transfer
        firsts = self._isolated("sample", lambda items: verify_batch(
            [lg for _, lg in items], [1] * len(items), [[] for _ in items],
            [None] * len(items), [r.params for r, _ in items],
            [r.generator for r, _ in items]), [r for r, _ in done], done)
        for (r, lg), res in zip(done, firsts):
            if res is None:
                continue
            phase = "logprobs"
            try:
                lps = None if r.params.logprobs is None else emitted_logprobs(
                    lg, res.emitted, r.params, r.params.logprobs)
                phase = "detokenize"
                self._hook(phase, r.request_id)
                stats.prefill_emitted_tokens += self.detok.append(r, res.emitted, lps)
            except Exception as exc:  # noqa: BLE001
                self._fail(r, phase, exc)

    def _finish(self, touched: list[Request]) -> list[RequestOutput]:
        """Deltas for the requests that emitted; finished ones leave the engine."""
        outputs = [self.detok.delta(r) for r in touched]
        for r in touched:
            if r.finish_reason is not None:
                self.requests.pop(r.request_id, None)
                self.scheduler.remove(r.request_id)
                self._release(r)
        return outputs

    def _step_row(self, stats: "_StepCounters", t0: float, c0: float) -> StepRow:
        """The step-log row (``configs.results_schema.StepRow``: ``ENGINE_STEP_COLUMNS``)."""
        return {
            M.STEP_TS: time.time(), M.STEP_STRATEGY: self.config.strategy,
            M.STEP_MODEL: self.served_model_name,
            M.STEP_REPLICA: self.config.replica_id, M.STEP_BATCH_SIZE: stats.batch_size,
            M.STEP_PREFILL_TOKENS: stats.prefill_tokens,
            M.STEP_VERIFICATION_TOKENS: stats.verification_tokens,
            M.STEP_DRAFT_TOKENS: stats.draft_tokens, M.STEP_ACCEPTED_TOKENS: stats.accepted_tokens,
            M.STEP_EMITTED_TOKENS: stats.emitted_tokens,
            M.STEP_PREFILL_EMITTED_TOKENS: stats.prefill_emitted_tokens,
            M.STEP_MS: (time.perf_counter() - t0) * 1e3,
            M.STEP_DRAFT_MS: stats.draft_ms, M.STEP_VERIFY_MS: stats.verify_ms,
            M.STEP_QUEUE_DEPTH: self.num_waiting, M.STEP_PADDED_TOKENS: stats.padded_tokens,
            M.STEP_CONTEXT_TOKENS: stats.context_tokens,
            M.STEP_CPU_MS: (time.thread_time() - c0) * 1e3, M.STEP_VERIFY_CPU_MS: stats.verify_cpu_ms,
            M.STEP_NUM_SPEC_TOKENS: stats.num_speculative_tokens,
            M.STEP_SPECULATION_OFF: ",".join(x for x in M.SPEC_OFF_REASONS
                                             if x in stats.speculation_off),
            M.STEP_DEGRADED_REQUESTS: stats.degraded_requests,
            M.STEP_K_BATCH_SIZE: stats.k_batch_size,
            M.STEP_FORWARD_PATH: ",".join(dict.fromkeys(self.runner.paths)),
            M.STEP_DRAFT_PATH: ",".join(dict.fromkeys(getattr(self.proposer, "paths", None) or ()))}


def run_requests(engine: LLMEngine, requests: list[tuple[str, str | list[int], SamplingParams]],
                 batch_size: int = 1, arrival_steps: list[int] | None = None
                 ) -> dict[str, dict]:
    """Drive ``engine`` to completion (offline use: CLI, bench, tests).

    At most ``batch_size`` requests are in the engine at once; with
    ``arrival_steps`` request i is not added before engine step
    ``arrival_steps[i]`` (staggered arrivals). Returns id -> {token_ids, text,
    finish_reason, stop_reason, stats (SpecStats), logprobs ([TokenLogprob], empty unless the
    request asked)}.
    """
    pending = list(range(len(requests)))
    results: dict[str, dict] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.requests) < batch_size and (
                arrival_steps is None or arrival_steps[pending[0]] <= step):
            rid, prompt, params = requests[pending.pop(0)]
            engine.add_request(rid, prompt, params)
            results[rid] = {"token_ids": [], "text": "", "finish_reason": None, "stats": None,
                            "logprobs": []}
        for out in engine.step():
            res = results[out.request_id]
            res["token_ids"].extend(out.new_token_ids)
            res["text"] += out.new_text
            res["logprobs"].extend(out.logprobs or [])
            if out.finished:
                res["finish_reason"] = out.finish_reason
                res["stop_reason"] = out.stop_reason
                res["stats"] = out.stats
        step += 1
    return results
