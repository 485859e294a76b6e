"""Metric and column names shared by the engine, the server, the load generator
and the analysis (llmperf's ``common_metrics`` idea: the unit is in the name).

Definitions follow docs/design.md ("Metric definitions"):

- acceptance length tau = 1 + num_accepted_tokens / num_drafts (tokens emitted
  per verification step, counting the bonus / correction token).
- verification tokens of a step = sum over the batch of (draft length + 1);
  emitted tokens of a step = what its verification delivered to users (accepted
  drafts that survived EOS / max_tokens / stop-string cuts + one bonus or
  correction token per request); wasted verification tokens = verification
  tokens - emitted tokens = draft tokens - accepted tokens >= 0.
- prefill-emitted tokens: the first output token of a request, sampled from
  the prefill forward; no verification produced it, so it is counted apart
  (``prefill_emitted_tokens``), never in emitted / verification tokens.
  Per request: completion_tokens = 1 (prefill) + num_steps + num_accepted_tokens.
- TTFT from the scheduled send time to the first chunk with non-empty text;
  TPOT = (e2e - TTFT) / (output_tokens - 1); ITL per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

# --- strategies --------------------------------------------------------------
AUTOREGRESSIVE = "autoregressive"
DRAFT_MODEL = "draft_model"
NGRAM = "ngram"
DFLASH = "dflash"
DFLASH2 = "dflash2"
DSPARK = "dspark"
STRATEGIES = (AUTOREGRESSIVE, DRAFT_MODEL, NGRAM, DFLASH, DFLASH2, DSPARK)  # canonical order, baseline first
BLOCK_DRAFTER_STRATEGIES = (DFLASH, DFLASH2, DSPARK)   # the parallel (block) drafter family
SPECULATIVE_STRATEGIES = STRATEGIES[1:]                 # every strategy with a draft length k
# strategies whose proposer picks a path among top-k candidates per position
# (strategy_options.top_k; ``loadgen --top-k-candidates``)
CANDIDATE_STRATEGIES = (DFLASH2,)

# The one strategy table: id -> "module:Class" of its proposer. Adding a strategy is
# one file under actors/proposers/ and one line here. Import paths are strings so
# this lowest layer never imports the engine (actors.engine.strategies loads them).
PROPOSER_CLASSES: dict[str, str] = {
    AUTOREGRESSIVE: "actors.proposers.autoregressive:AutoregressiveProposer",
    DRAFT_MODEL: "actors.proposers.draft_model:DraftModelProposer",
    NGRAM: "actors.proposers.ngram:NgramProposer",
    DFLASH: "actors.proposers.dflash:DFlashProposer",
    DFLASH2: "actors.proposers.dflash2:DFlash2Proposer",
    DSPARK: "actors.proposers.dspark:DSparkProposer",
}
assert tuple(PROPOSER_CLASSES) == STRATEGIES

# --- speculative decoding counters (vLLM SpecDecodingStats names) -------------
NUM_DRAFTS = "num_drafts"                      # verification steps that carried >= 1 draft token
NUM_DRAFT_TOKENS = "num_draft_tokens"          # tokens proposed
NUM_ACCEPTED_TOKENS = "num_accepted_tokens"    # accepted tokens the user received (cuts applied)
NUM_ACCEPTED_TOKENS_PER_POS = "num_accepted_tokens_per_pos"  # list[int], index = draft position
ACCEPTANCE_LENGTH = "acceptance_length"        # tau, tokens per verification step
DRAFT_MS = "draft_ms"                          # proposer wall time, ms
VERIFY_MS = "verify_ms"                        # target forward + acceptance, ms
QUEUE_MS = "queue_ms"                          # arrival -> first scheduled, ms
SPEC_DECODE_FIELD = "spec_decode"              # extension field in API responses
DEGRADED_REASON = "degraded_reason"            # spec_decode field: why the drafter was dropped, "" if not

# Why a request (or a step) decoded without drafts although its strategy speculates.
# A request degraded by its drafter stays autoregressive for the rest of its life.
DEGRADE_DRAFTER_ERROR = "drafter_error"        # the proposer raised (propose / add_request / observe_target)
DEGRADE_INVALID_DRAFT = "invalid_draft"        # out-of-vocab ids, too many tokens, wrong count, bad q
DEGRADE_DRAFT_DEADLINE = "draft_deadline"      # its propose call returned after draft_deadline_ms
DEGRADE_REASONS = (DEGRADE_DRAFTER_ERROR, DEGRADE_INVALID_DRAFT, DEGRADE_DRAFT_DEADLINE)
SPEC_OFF_BATCH_SIZE_POLICY = "batch_size_policy"  # step's k is 0 by num_speculative_tokens_per_batch_size
SPEC_OFF_REASONS = (SPEC_OFF_BATCH_SIZE_POLICY,) + DEGRADE_REASONS
TOKEN_TS_FIELD = "token_ts"    # per-choice extension: engine emit time (unix s) of each token_ids entry
STREAM_INTERVAL_FIELD = "stream_interval"        # request extension: tokens per streamed chunk
STREAM_INTERVAL_MS_FIELD = "stream_interval_ms"  # request extension: or a chunk per this many ms

# --- engine step log (one row per engine step) --------------------------------
STEP_TS = "ts"                                 # unix seconds at step end
STEP_STRATEGY = "strategy"                     # strategy id (proposer), one of STRATEGIES
STEP_MODEL = "model"                           # served model name (OpenAI ``model``; = REQ_MODEL)
STEP_REPLICA = "replica"
STEP_BATCH_SIZE = "batch_size"                 # running requests in the decode forward
STEP_PREFILL_TOKENS = "prefill_tokens"         # prompt tokens processed this step
STEP_VERIFICATION_TOKENS = "verification_tokens"  # sum(draft_len + 1) over the batch
STEP_DRAFT_TOKENS = "num_draft_tokens"
STEP_ACCEPTED_TOKENS = "accepted_tokens"
STEP_EMITTED_TOKENS = "emitted_tokens"         # tokens verification delivered (cuts applied)
STEP_PREFILL_EMITTED_TOKENS = "prefill_emitted_tokens"  # first tokens sampled from prefill
STEP_MS = "step_ms"
STEP_DRAFT_MS = "draft_ms"
STEP_VERIFY_MS = "verify_ms"
STEP_QUEUE_DEPTH = "num_waiting"               # requests waiting for a slot
STEP_PADDED_TOKENS = "padded_tokens"           # decode forward: batch_size x longest row (padding included)
STEP_CONTEXT_TOKENS = "context_tokens"         # decode forward: sum over rows of the KV length attended
# CPU time of the engine thread (time.thread_time): what the step cost without waiting for a core;
# step_ms - cpu_ms is time lost to other processes on a shared machine
STEP_CPU_MS = "cpu_ms"
STEP_VERIFY_CPU_MS = "verify_cpu_ms"
STEP_NUM_SPEC_TOKENS = "num_speculative_tokens"  # k of the step (batch-size schedule, else the engine's)
# "," -joined SPEC_OFF_REASONS (fixed order) of the decoding requests that drafted nothing this
# step although the strategy speculates; "" when none
STEP_SPECULATION_OFF = "speculation_off"
STEP_DEGRADED_REQUESTS = "degraded_requests"   # requests whose drafter was dropped this step
# the batch size the step's k was looked up with (num_speculative_tokens_per_batch_size):
# running + admitted requests when the step was scheduled; null when k is fixed
STEP_K_BATCH_SIZE = "k_batch_size"
# the target forward path(s) the step ran, ","-joined in order without repeats: FORWARD_PATHS
# (the embedded engine), "vllm" (vLLM's engine); "" when the step ran no target forward
STEP_FORWARD_PATH = "forward_path"
FORWARD_PATH_STACK = "stack"          # every layer in one C call (actors.engine.layer_kernel)
FORWARD_PATH_OPS = "ops"              # eager, op by op (torch ops, the C attention kernel)
FORWARD_PATH_COMPILED = "compiled"    # the torch.compile'd flat forward
FORWARD_PATH_VLLM = "vllm"
FORWARD_PATHS = (FORWARD_PATH_STACK, FORWARD_PATH_OPS, FORWARD_PATH_COMPILED, FORWARD_PATH_VLLM)
# the drafter forward path(s) of the step, as STEP_FORWARD_PATH: "stack" (a DFlash-family
# drafter's layers in the decoder-stack C call), "ops" (torch), "vllm"; "" when the step
# ran no drafter forward (autoregressive, ngram, draft_model, or nobody drafted)
STEP_DRAFT_PATH = "draft_forward_path"
STEP_LOG_COLUMNS = (STEP_TS, STEP_STRATEGY, STEP_MODEL, STEP_REPLICA, STEP_BATCH_SIZE, STEP_PREFILL_TOKENS,
                    STEP_VERIFICATION_TOKENS, STEP_DRAFT_TOKENS, STEP_ACCEPTED_TOKENS,
                    STEP_EMITTED_TOKENS, STEP_PREFILL_EMITTED_TOKENS, STEP_MS, STEP_DRAFT_MS,
                    STEP_VERIFY_MS, STEP_QUEUE_DEPTH, STEP_PADDED_TOKENS, STEP_CONTEXT_TOKENS,
                    STEP_CPU_MS, STEP_VERIFY_CPU_MS, STEP_NUM_SPEC_TOKENS, STEP_SPECULATION_OFF,
                    STEP_DEGRADED_REQUESTS, STEP_K_BATCH_SIZE, STEP_FORWARD_PATH, STEP_DRAFT_PATH)

# --- load generator request rows (requests.parquet) ---------------------------
REQ_RUN_ID = "run_id"
REQ_STRATEGY = "strategy"
REQ_TIER = "tier"
REQ_OUTPUT_CLASS = "output_class"              # "short" | "long"
REQ_DATASET = "dataset"
REQ_PROMPT_ID = "prompt_id"
REQ_USERS = "users"                            # requested concurrency of the cell
REQ_SCHEDULED_TS = "scheduled_ts"              # unix seconds
REQ_SENT_TS = "sent_ts"
REQ_FIRST_TOKEN_TS = "first_token_ts"
REQ_END_TS = "end_ts"
REQ_TTFT_MS = "ttft_ms"
REQ_TPOT_MS = "tpot_ms"
REQ_ITL_P50_MS = "itl_ms_p50"
REQ_ITL_P99_MS = "itl_ms_p99"
REQ_ITL_P90_MS = "itl_ms_p90"
REQ_ITL_MEAN_MS = "itl_ms_mean"                # per-token mean ITL (token-weighted), ms
# where the row's ITL comes from (timing.StreamRecorder.itl_source): per-token counts per chunk
# (spec_decode.num_tokens, token_ids, continuous usage), the engine's per-token emit times
# (token_ts), or only chunk arrivals: then itl_ms_* are null and chunk_gap_ms_* hold the gaps
REQ_ITL_SOURCE = "itl_source"
ITL_SOURCE_TOKENS = "per_chunk_tokens"         # each chunk's token count known: per-token ITL
ITL_SOURCE_STEPS = "engine_steps"              # per-token engine emit times (token_ts): per-token ITL
ITL_SOURCE_CHUNKS = "chunks_only"              # no per-chunk count: chunk gaps only, never per-token
ITL_SOURCES = (ITL_SOURCE_TOKENS, ITL_SOURCE_STEPS, ITL_SOURCE_CHUNKS)
REQ_TOKENS_PER_CHUNK = "tokens_per_chunk"      # (output tokens - 1) / (content chunks - 1): mean tokens per later chunk
REQ_MULTI_TOKEN_CHUNKS = "multi_token_chunks"  # later content chunks that carried > 1 token (known counts only)
REQ_CHUNK_GAP_P50_MS = "chunk_gap_ms_p50"      # median gap between content chunks, ms (per chunk, not per token)
REQ_E2E_MS = "e2e_ms"
REQ_OUTPUT_TOKENS = "output_tokens"
REQ_PROMPT_TOKENS = "prompt_tokens"
REQ_STATUS = "status"                          # one of REQ_STATUSES below
REQ_ERROR = "error"
REQ_REQUEST_INDEX = "request_index"            # index into the cell's seeded request plan
REQ_MAX_TOKENS = "max_tokens"                  # max_tokens sent with the request
REQ_FINISH_REASON = "finish_reason"            # server's finish_reason ("length", "stop", ...)
REQ_NUM_CHUNKS = "num_chunks"                  # stream chunks that carried non-empty text
REQ_ARRIVAL = "arrival"                        # "closed" (fixed users) | "open" (Poisson)
REQ_RATE_RPS = "request_rate_rps"              # open-loop arrival rate, requests/s (null if closed)
REQ_REPEAT = "repeat"                          # 0-based repeat of the cell (loadgen --repeats)
REQ_RETRIES = "retries"                        # times this request was re-sent after a 429 (--retry N)
# per-request speculative stats as the server reported them (timing.engine_spec_stats)
REQ_SPEC_SOURCE = "spec_source"                # who reported the row's spec stats: specload | vllm | sglang
REQ_NUM_SPEC_TOKENS = "num_spec_tokens"        # k: draft tokens the server proposes per step (vLLM)
REQ_ACCEPTANCE_HISTOGRAM = "acceptance_histogram"  # list[int]: steps by accepted count 0..k (vLLM)
REQ_ENGINE_ACCEPT_LENGTH = "engine_accept_length"  # the engine's own accept length (SGLang: completion tokens / verify count)
REQ_SAMPLING = "sampling"                      # the cell's sampling label ("greedy", "t0.7", ...)
REQ_TEMPERATURE = "temperature"                # temperature sent with the request
REQ_IGNORE_EOS = "ignore_eos"                  # ignore_eos sent (output class fixes lengths)
REQ_MIN_TOKENS = "min_tokens"                  # min_tokens sent (null: not sent)
REQ_CATEGORY = "category"                      # the prompt's traffic class (code, prose, ...): prompts JSONL `category`
# the built-in prompt sets' categories (data/prompts/*.jsonl carry them per line; the analysis
# falls back on these for rows written before the column, by the prompt id's prefix)
PROMPT_SET_CATEGORY = {"humaneval": "code", "stdlib": "code", "docs": "prose"}
REQ_ROUTE = "route"                            # route the request was answered on (direct | strategy | model-field)
# its values (python -m loadgen --route): a replica's own listener (Serve's direct ingress), the
# strategy's one-hop route through the Serve proxy, the model field on the target's /v1
ROUTE_DIRECT, ROUTE_STRATEGY, ROUTE_MODEL_FIELD = "direct", "strategy", "model-field"

# The one cell key (without the run id): every groupby over cells, in the load generator
# (summary speedups, step labels) and in the analysis (cell table, stability, faults,
# recommendation), uses these columns, so two sampling settings of one tier x output class
# are two cells.
GREEDY = "greedy"                              # sampling label of temperature 0


class CellKey(NamedTuple):
    """A cell's identity, the one key type of the load generator (cells run, results
    written, racing) and the report: strategy (served name), tier, output class, sampling
    label and users. Its field names are the request columns (``CELL_KEY``), so
    ``CellKey.of(row)`` reads a request row, a ``CellSummary`` or a cell-table record alike.
    Frozen and hashable (a tuple): a dict key, equal to the plain tuple of its values."""

    strategy: str
    tier: str
    output_class: str
    sampling: str | None = GREEDY   # None: not recorded (rows older than the column, an unresolved spec)
    users: int | None = None

    @classmethod
    def of(cls, obj: Any) -> "CellKey":
        """The key of a mapping (a request row, a record) or an object with these attributes
        (``CellSummary``, ``CellSpec``); a missing or empty sampling label is None."""
        get = obj.get if isinstance(obj, Mapping) else (lambda k, d=None: getattr(obj, k, d))
        users, sampling = get(REQ_USERS), get(REQ_SAMPLING)
        return cls(str(get(REQ_STRATEGY)), str(get(REQ_TIER)), str(get(REQ_OUTPUT_CLASS)),
                   str(sampling) if sampling else None,
                   None if users is None or users != users else int(users))

    def baseline(self, strategy: str) -> "CellKey":
        """The same cell run by ``strategy`` (speedup's reference: autoregressive's cell)."""
        return self._replace(strategy=strategy)

    def decision(self) -> tuple[str, ...]:
        """The cell a racing decision is about: (tier, output class, sampling), the
        ``analysis.decide.race.DECISION_KEY`` columns as far as recorded (users and strategy
        left out; a key without a sampling label is (tier, output class), as the decisions
        of rows without the column)."""
        return (self.tier, self.output_class) + (() if self.sampling is None else (self.sampling,))

    def label(self) -> str:
        """``strategy tier/output_class[/sampling][ u<users>]``: the console's name of the
        cell (greedy, the default, left out)."""
        samp = "" if self.sampling in (GREEDY, "", None) else f"/{self.sampling}"
        users = "" if self.users is None else f" u{self.users}"
        return f"{self.strategy} {self.tier}/{self.output_class}{samp}{users}"


CELL_KEY = CellKey._fields   # the columns: (strategy, tier, output_class, sampling, users)
assert CELL_KEY == (REQ_STRATEGY, REQ_TIER, REQ_OUTPUT_CLASS, REQ_SAMPLING, REQ_USERS)
# the same cell without the strategy: what speedup compares against (autoregressive's cell)
CELL_KEY_NO_STRATEGY = tuple(k for k in CELL_KEY if k != REQ_STRATEGY)

# request status values (REQ_STATUS)
STATUS_OK = "ok"
STATUS_ERROR = "error"                         # HTTP error or an error object in the stream
STATUS_TIMEOUT = "timeout"                     # client-side request timeout
STATUS_DISCONNECTED = "disconnected"           # stream closed before [DONE] / finish_reason
STATUS_CANCELLED = "cancelled"                 # still in flight when the cell was stopped
STATUS_REJECTED = "rejected"                   # HTTP 429 (overloaded, Retry-After): shed, not an error
STATUS_REPLICA_LOST = "replica_lost"           # the strategy replica serving it died (its process or node lost)
REQ_STATUSES = (STATUS_OK, STATUS_ERROR, STATUS_TIMEOUT, STATUS_DISCONNECTED, STATUS_CANCELLED,
                STATUS_REJECTED, STATUS_REPLICA_LOST)
# Statuses that mean the service failed a request it accepted (a degraded run): not
# `rejected` (load shedding by design) and not `cancelled` (the cell was stopped).
FAILURE_STATUSES = (STATUS_ERROR, STATUS_TIMEOUT, STATUS_DISCONNECTED, STATUS_REPLICA_LOST)
ERROR_CODE_REPLICA_LOST = "replica_lost"       # OpenAI error `code` the ingress sends for a dead replica

# --- per-cell figures (one strategy x tier x output class x users) ----------
# One scheme for the live summary (loadgen/results/summary.py: manifest "cells",
# summary.csv) and the analysis (analysis/data/metrics.py, the report's per-cell table).
CELL_N_REQUESTS = "n_requests"                 # rows of the cell, every status
CELL_N_OK = "n_ok"                             # rows with status ok
CELL_DURATION_S = "duration_s"                 # first send -> last end, s
CELL_OUTPUT_TOKENS_PER_S = "output_tokens_per_s"  # output tokens of ok requests / duration_s
CELL_SPEEDUP = "speedup"                       # output_tokens_per_s / autoregressive's, same cell
CELL_GOODPUT_TOKENS_PER_S = "goodput_tokens_per_s"  # tokens/s of requests meeting both SLOs
CELL_GOODPUT_RPS = "goodput_rps"               # requests/s meeting both SLOs
CELL_SLO_ATTAINMENT = "slo_attainment"         # share of requests meeting both SLOs, 0..1
CELL_ACHIEVED_CONCURRENCY = "achieved_concurrency"  # time-weighted mean requests in flight
CELL_TTFT_MS_P50 = "ttft_ms_p50"
CELL_TTFT_MS_P99 = "ttft_ms_p99"
CELL_TPOT_MS_P50 = "tpot_ms_p50"
CELL_TPOT_MS_P99 = "tpot_ms_p99"
CELL_ITL_MS_P50 = "itl_ms_p50"                 # median over requests of their median per-token ITL
CELL_ITL_MS_P90 = "itl_ms_p90"                 # median over requests of their per-token ITL p90
CELL_ITL_MS_P99 = "itl_ms_p99"                 # median over requests of their per-token ITL p99
CELL_ITL_MS_MEAN = "itl_ms_mean"               # per-token mean over the cell (token-weighted)
CELL_TTFT_MS_MEAN = "ttft_ms_mean"
CELL_TTFT_MS_P90 = "ttft_ms_p90"
CELL_TPOT_MS_MEAN = "tpot_ms_mean"
CELL_TPOT_MS_P90 = "tpot_ms_p90"
CELL_ITL_KIND = "itl_kind"                     # per_token | chunk (no per-chunk token count: chunk gaps)
CELL_TOKENS_PER_CHUNK = "tokens_per_chunk"     # mean tokens per later content chunk over the cell
CELL_CHUNK_GAP_MS_P50 = "chunk_gap_ms_p50"     # median over requests of their median chunk gap, ms
CELL_TPOT_BIMODALITY = "tpot_bimodality"       # Sarle's bimodality coefficient of per-request TPOT
CELL_SEND_LAG_MS_P99 = "send_lag_ms_p99"       # open loop: actual - scheduled send time, ms
CELL_CPU_MEAN_PERCENT = "cpu_mean_percent"     # the load generator's own CPU, % of one core
CELL_CPU_MAX_PERCENT = "cpu_max_percent"
CELL_DEGRADED_REQUESTS = "degraded_requests"   # requests whose drafter failed (degraded, not failed)


def acceptance_label(acceptance_length: float) -> str:
    """``-al<A>`` suffix text of a forced acceptance length: 2.0 -> ``2``, 1.5 -> ``1.5``."""
    return f"{float(acceptance_length):g}"


def variant_name(strategy: str, k: int | None = None, candidates: int | None = None,
                 acceptance_length: float | None = None) -> str:
    """Served name of one variant of a strategy: ``dflash2-k4``, ``dflash2-k4-c16``,
    ``dflash2-c4``, ``draft_model-k4-al2.5`` (k: ``num_speculative_tokens``; c:
    ``strategy_options.top_k``; al: a forced ``synthetic_acceptance_length``, the
    deployment's text is then not the target's)."""
    return (strategy + (f"-k{k}" if k is not None else "")
            + (f"-c{candidates}" if candidates is not None else "")
            + (f"-al{acceptance_label(acceptance_length)}" if acceptance_length is not None else ""))


_VARIANT_RE = r"([a-z0-9_]+?)(?:-k(\d+))?(?:-c(\d+))?(?:-al(\d+(?:\.\d+)?))?"


def parse_variant_name(name: str) -> tuple[str, int | None, int | None] | None:
    """``variant_name``'s inverse: ``"dflash2-k4-c16"`` -> ``("dflash2", 4, 16)``; a plain
    strategy id -> ``(id, None, None)``; None for any other name. A forced-acceptance
    suffix (``-al2.5``) is accepted and left out here: ``parse_acceptance_length``."""
    import re

    m = re.fullmatch(_VARIANT_RE, name or "")
    if not m or m.group(1) not in STRATEGIES:
        return None
    return (m.group(1), int(m.group(2)) if m.group(2) else None,
            int(m.group(3)) if m.group(3) else None)


def parse_acceptance_length(name: str) -> float | None:
    """The forced acceptance length of a variant's served name (``draft_model-k4-al2.5`` ->
    2.5); None for a name without ``-al<A>`` (a real deployment)."""
    import re

    m = re.fullmatch(_VARIANT_RE, name or "")
    if not m or m.group(1) not in STRATEGIES or not m.group(4):
        return None
    return float(m.group(4))


def percentile_name(metric_ms: str, p: int) -> str:
    """Column name of percentile ``p`` of a per-request metric: ``ttft_ms`` -> ``ttft_ms_p50``."""
    return f"{metric_ms}_p{p}"


# --- Prometheus (vLLM-like names, exported through ray.serve.metrics) ---------
PROM_PREFIX = "specload_"
PROM_SPEC_NUM_DRAFTS = "spec_decode_num_drafts"
PROM_SPEC_NUM_DRAFT_TOKENS = "spec_decode_num_draft_tokens"
PROM_SPEC_NUM_ACCEPTED_TOKENS = "spec_decode_num_accepted_tokens"
PROM_SPEC_NUM_ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
PROM_BATCH_SIZE = "batch_size"
PROM_VERIFICATION_TOKENS = "verification_tokens_per_step"
PROM_STEP_TIME_MS = "step_time_ms"
PROM_QUEUE_DEPTH = "num_requests_waiting"
PROM_DEGRADED_REQUESTS = "degraded_requests"   # counter, label ``reason`` (DEGRADE_REASONS)
# vLLM's names (vllm:request_success, vllm:generation_tokens): requests finished and output tokens
# generated, so a scraper reconciles "requests the server saw" with the client's rows
PROM_REQUEST_SUCCESS = "request_success"
PROM_GENERATION_TOKENS = "generation_tokens"


# --- a target's own Prometheus metrics (``--server-metrics``, server_metrics.parquet) ---
# What a real engine publishes (docs/design.md "Real engines: what they publish"),
# mapped onto specload's names in ONE table per engine kind. The load generator scrapes
# the target's ``/metrics`` while each cell runs (loadgen/run/server_metrics.py); the
# analysis reads the per-cell deltas like it reads the step log (analysis/data/server.py).
ENGINE_VLLM = "vllm"
ENGINE_SGLANG = "sglang"
ENGINE_SPECLOAD = "specload"
ENGINE_KINDS = (ENGINE_VLLM, ENGINE_SGLANG, ENGINE_SPECLOAD)

# canonical series (the ``metric`` column of server_metrics.parquet); counters are deltas
# over a cell, gauges are sampled (mean / max over the cell)
SRV_NUM_DRAFTS = NUM_DRAFTS                          # counter, steps (request-steps that drafted)
SRV_NUM_DRAFT_TOKENS = NUM_DRAFT_TOKENS              # counter, tokens
SRV_NUM_ACCEPTED_TOKENS = NUM_ACCEPTED_TOKENS        # counter, tokens
SRV_NUM_ACCEPTED_PER_POS = NUM_ACCEPTED_TOKENS_PER_POS  # counter per draft position (0-based), tokens
SRV_PROMPT_TOKENS = "prompt_tokens"                  # counter, tokens prefilled
SRV_GENERATION_TOKENS = "generation_tokens"          # counter, output tokens emitted
SRV_REQUESTS_FINISHED = "requests_finished"          # counter, requests (every finish reason)
SRV_PREEMPTIONS = "num_preemptions"                  # counter, preempted requests
SRV_ENGINE_STEPS = "engine_steps"                    # counter, engine iterations (a histogram's count)
SRV_STEP_TOKENS = "step_tokens"                      # counter, tokens over those steps (the histogram's sum)
SRV_STEP_MS = "step_ms"                              # counter, engine step wall time summed, ms (specload only)
SRV_VERIFICATION_TOKENS = "verification_tokens"      # counter, sum(draft len + 1) over steps (specload only)
SRV_DECODE_ROWS = "decode_rows"                      # counter, running requests summed over steps (specload only)
SRV_ITL_SUM_S = "itl_seconds_sum"                    # counter, inter-token latencies summed, s (vLLM histogram)
SRV_ITL_COUNT = "itl_count"                          # counter, inter-token latencies observed (one per request-step)
SRV_RUNNING = "num_requests_running"                 # gauge, requests in the running batch
SRV_WAITING = "num_requests_waiting"                 # gauge, requests queued for a slot
SRV_KV_USAGE = "kv_cache_usage"                      # gauge, fraction 0..1 of the KV cache in use
SRV_ACCEPT_LENGTH = "accept_length"                  # gauge, the engine's own tau (SGLang)
SRV_ACCEPT_RATE = "accept_rate"                      # gauge, the engine's own acceptance rate (SGLang)
SRV_COUNTERS = (SRV_NUM_DRAFTS, SRV_NUM_DRAFT_TOKENS, SRV_NUM_ACCEPTED_TOKENS, SRV_NUM_ACCEPTED_PER_POS,
                SRV_PROMPT_TOKENS, SRV_GENERATION_TOKENS, SRV_REQUESTS_FINISHED, SRV_PREEMPTIONS,
                SRV_ENGINE_STEPS, SRV_STEP_TOKENS, SRV_STEP_MS, SRV_VERIFICATION_TOKENS, SRV_DECODE_ROWS,
                SRV_ITL_SUM_S, SRV_ITL_COUNT)
SRV_GAUGES = (SRV_RUNNING, SRV_WAITING, SRV_KV_USAGE, SRV_ACCEPT_LENGTH, SRV_ACCEPT_RATE)
SRV_POSITION_LABEL = "position"                      # the per-position counter's label (0-based)

# Prometheus sample selectors: counter -> the family's ``_total`` samples (the parser names
# the family without the suffix), gauge -> the value, hist_count / hist_sum -> a histogram's
# ``_count`` / ``_sum``. Samples of every other label (engine, finished_reason, replica) are
# summed; ``position`` is kept.
SERVER_METRIC_NAMES: dict[str, dict[str, tuple[str, str]]] = {
    # vLLM 0.32 (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py)
    ENGINE_VLLM: {
        SRV_NUM_DRAFTS: ("vllm:spec_decode_num_drafts", "counter"),
        SRV_NUM_DRAFT_TOKENS: ("vllm:spec_decode_num_draft_tokens", "counter"),
        SRV_NUM_ACCEPTED_TOKENS: ("vllm:spec_decode_num_accepted_tokens", "counter"),
        SRV_NUM_ACCEPTED_PER_POS: ("vllm:spec_decode_num_accepted_tokens_per_pos", "counter"),
        SRV_PROMPT_TOKENS: ("vllm:prompt_tokens", "counter"),
        SRV_GENERATION_TOKENS: ("vllm:generation_tokens", "counter"),
        SRV_REQUESTS_FINISHED: ("vllm:request_success", "counter"),
        SRV_PREEMPTIONS: ("vllm:num_preemptions", "counter"),
        # tokens per engine step = prompt tokens computed + output tokens emitted in it
        SRV_ENGINE_STEPS: ("vllm:iteration_tokens_total", "hist_count"),
        SRV_STEP_TOKENS: ("vllm:iteration_tokens_total", "hist_sum"),
        # one sample per request per engine step that gave it tokens: the step's wall time as the
        # running requests saw it (idle time between requests is not in it, unlike cell wall / steps)
        SRV_ITL_SUM_S: ("vllm:inter_token_latency_seconds", "hist_sum"),
        SRV_ITL_COUNT: ("vllm:inter_token_latency_seconds", "hist_count"),
        SRV_RUNNING: ("vllm:num_requests_running", "gauge"),
        SRV_WAITING: ("vllm:num_requests_waiting", "gauge"),
        SRV_KV_USAGE: ("vllm:kv_cache_usage_perc", "gauge"),
    },
    # SGLang 0.5 (--enable-metrics)
    ENGINE_SGLANG: {
        SRV_PROMPT_TOKENS: ("sglang:prompt_tokens", "counter"),
        SRV_GENERATION_TOKENS: ("sglang:generation_tokens", "counter"),
        SRV_REQUESTS_FINISHED: ("sglang:num_requests", "counter"),
        SRV_RUNNING: ("sglang:num_running_reqs", "gauge"),
        SRV_WAITING: ("sglang:num_queue_reqs", "gauge"),
        SRV_KV_USAGE: ("sglang:token_usage", "gauge"),
        SRV_ACCEPT_LENGTH: ("sglang:spec_accept_length", "gauge"),
        SRV_ACCEPT_RATE: ("sglang:spec_accept_rate", "gauge"),
    },
    # specload's own replicas (actors/serve/deployments.py via ray.serve.metrics; Ray's
    # metrics agent exports them with its ``ray_`` namespace)
    ENGINE_SPECLOAD: {
        SRV_NUM_DRAFTS: ("ray_" + PROM_PREFIX + PROM_SPEC_NUM_DRAFTS, "counter"),
        SRV_NUM_DRAFT_TOKENS: ("ray_" + PROM_PREFIX + PROM_SPEC_NUM_DRAFT_TOKENS, "counter"),
        SRV_NUM_ACCEPTED_TOKENS: ("ray_" + PROM_PREFIX + PROM_SPEC_NUM_ACCEPTED_TOKENS, "counter"),
        SRV_NUM_ACCEPTED_PER_POS: ("ray_" + PROM_PREFIX + PROM_SPEC_NUM_ACCEPTED_PER_POS, "counter"),
        SRV_ENGINE_STEPS: ("ray_" + PROM_PREFIX + PROM_STEP_TIME_MS, "hist_count"),
        SRV_STEP_MS: ("ray_" + PROM_PREFIX + PROM_STEP_TIME_MS, "hist_sum"),
        SRV_VERIFICATION_TOKENS: ("ray_" + PROM_PREFIX + PROM_VERIFICATION_TOKENS, "hist_sum"),
        SRV_DECODE_ROWS: ("ray_" + PROM_PREFIX + PROM_BATCH_SIZE, "hist_sum"),
        SRV_WAITING: ("ray_" + PROM_PREFIX + PROM_QUEUE_DEPTH, "gauge"),
        SRV_REQUESTS_FINISHED: ("ray_" + PROM_PREFIX + PROM_REQUEST_SUCCESS, "counter"),
        SRV_GENERATION_TOKENS: ("ray_" + PROM_PREFIX + PROM_GENERATION_TOKENS, "counter"),
    },
}
# the label naming the served model: vLLM / SGLang ``model_name`` (vLLM: the FIRST
# --served-model-name, whichever alias a request used); specload's replicas ``strategy``
SERVER_MODEL_LABEL = {ENGINE_VLLM: "model_name", ENGINE_SGLANG: "model_name", ENGINE_SPECLOAD: "strategy"}


def acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float:
    """tau = 1 + accepted / drafts (tokens per verification step); 1.0 with no drafts."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 1.0
