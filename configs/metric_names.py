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

# --- strategies --------------------------------------------------------------
AUTOREGRESSIVE = "autoregressive"
DRAFT_MODEL = "draft_model"
NGRAM = "ngram"
DFLASH = "dflash"
DFLASH2 = "dflash2"
DSPARK = "dspark"
STRATEGIES = (AUTOREGRESSIVE, DRAFT_MODEL, NGRAM, DFLASH, DFLASH2, DSPARK)  # canonical order, baseline first
BLOCK_DRAFTER_STRATEGIES = (DFLASH, DFLASH2, DSPARK)   # the parallel (block) drafter family

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
STEP_LOG_COLUMNS = (STEP_TS, STEP_STRATEGY, STEP_MODEL, STEP_REPLICA, STEP_BATCH_SIZE, STEP_PREFILL_TOKENS,
                    STEP_VERIFICATION_TOKENS, STEP_DRAFT_TOKENS, STEP_ACCEPTED_TOKENS,
                    STEP_EMITTED_TOKENS, STEP_PREFILL_EMITTED_TOKENS, STEP_MS, STEP_DRAFT_MS,
                    STEP_VERIFY_MS, STEP_QUEUE_DEPTH, STEP_PADDED_TOKENS, STEP_CONTEXT_TOKENS,
                    STEP_CPU_MS, STEP_VERIFY_CPU_MS, STEP_NUM_SPEC_TOKENS, STEP_SPECULATION_OFF,
                    STEP_DEGRADED_REQUESTS)

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
CELL_ITL_MS_P50 = "itl_ms_p50"                 # median over requests of their median ITL
CELL_SEND_LAG_MS_P99 = "send_lag_ms_p99"       # open loop: actual - scheduled send time, ms
CELL_CPU_MEAN_PERCENT = "cpu_mean_percent"     # the load generator's own CPU, % of one core
CELL_CPU_MAX_PERCENT = "cpu_max_percent"


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


def acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float:
    """tau = 1 + accepted / drafts (tokens per verification step); 1.0 with no drafts."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 1.0
