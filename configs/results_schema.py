"""The results schema: every column of a run directory's request, step and server-metric rows.

One table per row kind, each column with its name (from ``configs.metric_names``),
its type and its unit. The load generator writes with it
(``loadgen.results.writer``: Parquet schema, row coercion, ``schema_version`` in the
file metadata and the manifest), the analysis reads with it
(``analysis.data.load``: required columns, dtypes, columns added as missing for
older runs or third-party servers), and the live summary table and the report
name their inputs by it.

Identity. A request row's ``strategy`` is the name the load generator sent
as the OpenAI ``model``: the *served model name* of a deployment. A step row
carries both: ``strategy`` (the engine's strategy id, one of
``metric_names.STRATEGIES``) and ``model`` (the served name). Requests and
steps of one deployment join on ``request.strategy == step.model``, so a
deployment named differently from its strategy (say ``dflash-k4``) keeps its
own step log instead of mixing into ``dflash``'s.

Versions (``SCHEMA_VERSION``):
  2: request column ``repeat``; manifest ``schema_version``.
  3: step rows carry ``model``; the version is in the Parquet metadata; the
     never-produced top-k coverage columns are gone.
  4: step columns ``num_speculative_tokens`` (the step's k), ``speculation_off``
     (reasons) and ``degraded_requests``.
  5: request columns ``spec_source``, ``num_spec_tokens``, ``acceptance_histogram``, ``degraded_reason``
     (per-request speculative stats of vLLM / SGLang); ``server_metrics.parquet`` (the
     target's own Prometheus series, sampled during the run: ``SERVER_METRIC_COLUMNS``).
  6: request columns ``sampling`` (the cell's sampling label: ``greedy``, ``t0.7``;
     part of ``metric_names.CELL_KEY``), ``temperature``, ``ignore_eos`` and
     ``min_tokens`` (the output-length settings sent); step rows carry
     ``sampling`` too. Older runs load with the label of their profile's one
     sampling setting (``analysis.data.load``).
  7: request column ``route`` (the HTTP route each request was sent on: the
     load generator's default route is the replica's own listener, with the
     Serve proxy's route as the fallback when a listener refuses or drops a connection).
  8: request column ``category`` (the prompt's traffic class, from the prompts file);
     older runs load with it null.
  9: request columns ``itl_ms_p90``, ``itl_ms_mean``, ``itl_source``, ``tokens_per_chunk``,
     ``multi_token_chunks``, ``chunk_gap_ms_p50``, ``engine_accept_length`` (SGLang's own);
     per-token ITL only where the server gave
     per-chunk token counts; otherwise the chunk gaps, labelled (docs/metrics.md).
  10: step column ``k_batch_size`` (the batch size the step's k was looked up with);
     older runs load with it null.
  11: step column ``forward_path`` (which target forward path the step ran: the stack
     kernel, op by op, compiled, vLLM); older runs load with it null.
  12: step column ``draft_forward_path`` (which drafter forward path the step ran: the
     stack kernel or op by op, for the DFlash family); older runs load with it null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from configs import metric_names as M

SCHEMA_VERSION = 12
PARQUET_VERSION_KEY = b"specload.schema_version"   # Parquet key-value metadata

ColumnType = Literal["string", "int32", "int64", "float64", "list<int64>"]


@dataclass(frozen=True)
class Column:
    """One column: name, type, unit ("" when none) and meaning."""

    name: str
    type: ColumnType
    unit: str = ""
    doc: str = ""
    required: bool = False   # the reader refuses a file without it
    default: Any = None      # the value of a row that lacks it (None: null)

    @property
    def numeric(self) -> bool:
        return self.type in ("int32", "int64", "float64")


def _c(name, type_, unit="", doc="", required=False, default=None) -> Column:
    return Column(name, type_, unit, doc, required, default)


# --- request rows: requests.parquet, one row per request ----------------------
REQUEST_COLUMNS: tuple[Column, ...] = (
    _c(M.REQ_RUN_ID, "string", doc="run id (the run directory's name)"),
    _c(M.REQ_STRATEGY, "string", doc="served model name the request was sent to", required=True),
    _c(M.REQ_TIER, "string", doc="low | mid | high", required=True),
    _c(M.REQ_OUTPUT_CLASS, "string", doc="short | long", required=True),
    _c(M.REQ_DATASET, "string", doc="prompt dataset"),
    _c(M.REQ_PROMPT_ID, "string", doc="prompt id within the dataset"),
    _c(M.REQ_USERS, "int32", "users", "requested concurrency of the cell", required=True),
    _c(M.REQ_ARRIVAL, "string", doc="closed | open"),
    _c(M.REQ_RATE_RPS, "float64", "requests/s", "open-loop arrival rate; null when closed"),
    _c(M.REQ_REQUEST_INDEX, "int64", doc="index into the cell's seeded request plan"),
    _c(M.REQ_MAX_TOKENS, "int32", "tokens", "max_tokens sent"),
    _c(M.REQ_SCHEDULED_TS, "float64", "s (unix)", "when the request was due"),
    _c(M.REQ_SENT_TS, "float64", "s (unix)", "when it was sent"),
    _c(M.REQ_FIRST_TOKEN_TS, "float64", "s (unix)", "first chunk with text"),
    _c(M.REQ_END_TS, "float64", "s (unix)", "end of the stream or the failure", required=True),
    _c(M.REQ_TTFT_MS, "float64", "ms", "scheduled send -> first token"),
    _c(M.REQ_TPOT_MS, "float64", "ms", "(e2e - TTFT) / (output tokens - 1)"),
    _c(M.REQ_ITL_P50_MS, "float64", "ms", "median inter-token latency"),
    _c(M.REQ_ITL_P99_MS, "float64", "ms", "p99 inter-token latency"),
    _c(M.REQ_ITL_P90_MS, "float64", "ms", "p90 inter-token latency, per token; null before schema 9"),
    _c(M.REQ_ITL_MEAN_MS, "float64", "ms", "mean inter-token latency, per token (token-weighted); "
       "null before schema 9"),
    _c(M.REQ_ITL_SOURCE, "string", doc="per_chunk_tokens | engine_steps | chunks_only (no per-chunk "
       "token count: itl_ms_* null, chunk_gap_ms_p50 holds the chunk gaps); null before schema 9"),
    _c(M.REQ_TOKENS_PER_CHUNK, "float64", "tokens", "(output tokens - 1) / (content chunks - 1)"),
    _c(M.REQ_MULTI_TOKEN_CHUNKS, "int32", "chunks", "later content chunks carrying more than one "
       "token (null: counts unknown)"),
    _c(M.REQ_CHUNK_GAP_P50_MS, "float64", "ms", "median gap between content chunks (per chunk)"),
    _c(M.REQ_ENGINE_ACCEPT_LENGTH, "float64", "tokens", "the engine's own accept length as it defines it "
       "(SGLang: completion tokens / spec_verify_ct, the prefill token included); beside tau"),
    _c(M.REQ_E2E_MS, "float64", "ms", "scheduled send -> end"),
    _c(M.REQ_OUTPUT_TOKENS, "int64", "tokens", "output tokens received", required=True),
    _c(M.REQ_PROMPT_TOKENS, "int64", "tokens", "prompt tokens (server's usage)"),
    _c(M.REQ_NUM_CHUNKS, "int32", "chunks", "stream chunks that carried text"),
    _c(M.REQ_FINISH_REASON, "string", doc="server's finish_reason"),
    _c(M.REQ_STATUS, "string", doc=" | ".join(M.REQ_STATUSES)),
    _c(M.REQ_ERROR, "string", doc="error message when status is not ok"),
    _c(M.NUM_DRAFTS, "int64", "steps", "verification steps that carried drafts"),
    _c(M.NUM_DRAFT_TOKENS, "int64", "tokens", "draft tokens proposed"),
    _c(M.NUM_ACCEPTED_TOKENS, "int64", "tokens", "draft tokens accepted"),
    _c(M.NUM_ACCEPTED_TOKENS_PER_POS, "list<int64>", "tokens",
       "accepted count per draft position"),
    _c(M.ACCEPTANCE_LENGTH, "float64", "tokens/step", "1 + accepted / drafts"),
    _c(M.DRAFT_MS, "float64", "ms", "proposer time summed over the request's steps"),
    _c(M.VERIFY_MS, "float64", "ms", "verification time summed over the request's steps"),
    _c(M.QUEUE_MS, "float64", "ms", "arrival -> first scheduled, server side"),
    _c(M.REQ_REPEAT, "int32", doc="0-based repeat of the cell (--repeats)"),
    _c(M.REQ_RETRIES, "int32", doc="re-sends after HTTP 429 (--retry N); 0 without retries", default=0),
    _c(M.REQ_SPEC_SOURCE, "string", doc="who reported the spec stats: specload (spec_decode), vllm "
       "(metrics.speculative_decoding), sglang (meta_info); null: none"),
    _c(M.REQ_NUM_SPEC_TOKENS, "int32", "tokens", "k, draft tokens proposed per step (vLLM)"),
    _c(M.REQ_ACCEPTANCE_HISTOGRAM, "list<int64>", "steps",
       "verification steps by accepted draft tokens 0..k (vLLM)"),
    _c(M.DEGRADED_REASON, "string", doc="specload: why the request's drafter was dropped and it "
       "went on autoregressively (drafter_error | invalid_draft | draft_deadline); '' when it "
       "speculated throughout; null: the server does not say"),
    _c(M.REQ_SAMPLING, "string", doc="the cell's sampling label (configs/tiers.py Sampling.label): "
       "greedy, t0.7, ..."),
    _c(M.REQ_TEMPERATURE, "float64", doc="temperature sent"),
    _c(M.REQ_IGNORE_EOS, "int32", doc="1 when ignore_eos was sent (lengths fixed by max_tokens)"),
    _c(M.REQ_MIN_TOKENS, "int32", "tokens", "min_tokens sent; null when not sent"),
    _c(M.REQ_ROUTE, "string", doc="HTTP route the request was sent on: direct (its replica's own "
       "listener, Serve's direct ingress), strategy (its one-hop route through the Serve proxy; "
       "also a user's requests after its direct listener refused or dropped its connection, "
       "a refused one resent there) or model-field; null: runs "
       "before schema 7"),
    _c(M.REQ_CATEGORY, "string", doc="the prompt's category (traffic class: code, prose, ...; the "
       "prompts JSONL line's `category`); null when the prompt has none or before schema 8 (the "
       "analysis then takes code / prose from the built-in prompt sets' ids)"),
)

# --- step rows: steps.parquet, one row per engine step -----------------------
# The engine's own columns (``metric_names.STEP_LOG_COLUMNS``), then the cell
# labels the load generator adds by step time.
ENGINE_STEP_COLUMNS: tuple[Column, ...] = (
    _c(M.STEP_TS, "float64", "s (unix)", "step end", required=True),
    _c(M.STEP_STRATEGY, "string", doc="engine's strategy id (metric_names.STRATEGIES)",
       required=True),
    _c(M.STEP_MODEL, "string", doc="served model name (joins request.strategy)"),
    _c(M.STEP_REPLICA, "string", doc="replica id"),
    _c(M.STEP_BATCH_SIZE, "int64", "requests", "running requests in the decode forward"),
    _c(M.STEP_PREFILL_TOKENS, "int64", "tokens", "prompt tokens processed"),
    _c(M.STEP_VERIFICATION_TOKENS, "int64", "tokens", "sum over the batch of draft length + 1"),
    _c(M.STEP_DRAFT_TOKENS, "int64", "tokens", "draft tokens proposed"),
    _c(M.STEP_ACCEPTED_TOKENS, "int64", "tokens", "draft tokens accepted"),
    _c(M.STEP_EMITTED_TOKENS, "int64", "tokens", "tokens streamed"),
    _c(M.STEP_PREFILL_EMITTED_TOKENS, "int64", "tokens", "first tokens emitted by prefill (no verification)"),
    _c(M.STEP_MS, "float64", "ms", "step wall time"),
    _c(M.STEP_DRAFT_MS, "float64", "ms", "proposer time"),
    _c(M.STEP_VERIFY_MS, "float64", "ms", "target forward + acceptance"),
    _c(M.STEP_QUEUE_DEPTH, "int64", "requests", "requests waiting for a slot"),
    _c(M.STEP_PADDED_TOKENS, "int64", "tokens", "decode forward: batch x longest row"),
    _c(M.STEP_CONTEXT_TOKENS, "int64", "tokens", "decode forward: KV positions attended"),
    _c(M.STEP_CPU_MS, "float64", "ms", "engine thread CPU time of the step (no waits for a core)"),
    _c(M.STEP_VERIFY_CPU_MS, "float64", "ms", "engine thread CPU time of the verify phase"),
    _c(M.STEP_NUM_SPEC_TOKENS, "int64", "tokens",
       "k of the step (num_speculative_tokens_per_batch_size, else num_speculative_tokens)"),
    _c(M.STEP_SPECULATION_OFF, "string", doc="why decoding requests drafted nothing: "
       "\"\" or ','-joined " + " | ".join(M.SPEC_OFF_REASONS), default=""),
    _c(M.STEP_DEGRADED_REQUESTS, "int64", "requests",
       "requests whose drafter was dropped this step (autoregressive from then on)", default=0),
    _c(M.STEP_K_BATCH_SIZE, "int64", "requests",
       "batch size the step's k was looked up with (num_speculative_tokens_per_batch_size: "
       "running + admitted requests when scheduled); null when k is fixed, and in older runs"),
    _c(M.STEP_FORWARD_PATH, "string", doc="target forward path(s) the step ran, ','-joined in "
       "order: " + " | ".join(M.FORWARD_PATHS) + "; \"\" without a target forward; null before "
       "schema 11"),
    _c(M.STEP_DRAFT_PATH, "string", doc="drafter forward path(s) the step ran (the DFlash "
       "family's drafter), ','-joined in order: stack | ops | vllm; \"\" without a drafter "
       "forward; null before schema 12"),
)
STEP_LABEL_COLUMNS: tuple[Column, ...] = (
    _c(M.REQ_RUN_ID, "string", doc="run id"),
    _c(M.REQ_TIER, "string", doc="cell the step fell in, by time; null between cells"),
    _c(M.REQ_OUTPUT_CLASS, "string", doc="cell's output class"),
    _c(M.REQ_USERS, "int32", "users", "cell's requested concurrency"),
    _c(M.REQ_REPEAT, "int32", doc="cell's repeat"),
    _c(M.REQ_SAMPLING, "string", doc="cell's sampling label"),
)
STEP_COLUMNS: tuple[Column, ...] = ENGINE_STEP_COLUMNS + STEP_LABEL_COLUMNS


# --- typed rows ----------------------------------------------------------------
# The same columns as TypedDicts, for the code that builds rows (the engines' step rows,
# the load generator's request rows) and reads them. Keys are the column names above
# (``tests/test_results_schema.py`` checks they stay equal); values are the column
# types in Python (int32 / int64 -> int, float64 -> float, list<int64> -> list[int]).


class StepRow(TypedDict):
    """One engine step-log row (``ENGINE_STEP_COLUMNS`` = ``metric_names.STEP_LOG_COLUMNS``):
    what ``LLMEngine`` and ``VllmEngine`` hand to ``on_step`` every step (the Serve step
    log adds ``seq``; the load generator adds ``STEP_LABEL_COLUMNS``). Every key is
    always present; ``k_batch_size`` is None when k is fixed (and from vLLM). Units as the
    columns': times in ms, ``ts`` unix seconds, counts in tokens / requests."""

    ts: float
    strategy: str
    model: str
    replica: str
    batch_size: int
    prefill_tokens: int
    verification_tokens: int
    num_draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    prefill_emitted_tokens: int
    step_ms: float
    draft_ms: float
    verify_ms: float
    num_waiting: int
    padded_tokens: int
    context_tokens: int
    cpu_ms: float
    verify_cpu_ms: float
    num_speculative_tokens: int
    speculation_off: str
    degraded_requests: int
    k_batch_size: int | None
    forward_path: str
    draft_forward_path: str


class RequestRow(TypedDict, total=False):
    """One request row of ``requests.parquet`` (``REQUEST_COLUMNS``), as the load generator
    builds it (in parts: timing, identity, spec stats; ``coerce_row`` fills the missing
    columns with their defaults). None where the column is null (a failed request's TTFT,
    a closed loop's rate). Times in ms, ``*_ts`` unix seconds."""

    run_id: str | None
    strategy: str
    tier: str
    output_class: str
    dataset: str | None
    prompt_id: str | None
    users: int
    arrival: str | None
    request_rate_rps: float | None
    request_index: int | None
    max_tokens: int | None
    scheduled_ts: float | None
    sent_ts: float | None
    first_token_ts: float | None
    end_ts: float
    ttft_ms: float | None
    tpot_ms: float | None
    itl_ms_p50: float | None
    itl_ms_p99: float | None
    itl_ms_p90: float | None
    itl_ms_mean: float | None
    itl_source: str | None
    tokens_per_chunk: float | None
    multi_token_chunks: int | None
    chunk_gap_ms_p50: float | None
    engine_accept_length: float | None
    e2e_ms: float | None
    output_tokens: int
    prompt_tokens: int | None
    num_chunks: int | None
    finish_reason: str | None
    status: str | None
    error: str | None
    num_drafts: int | None
    num_draft_tokens: int | None
    num_accepted_tokens: int | None
    num_accepted_tokens_per_pos: list[int] | None
    acceptance_length: float | None
    draft_ms: float | None
    verify_ms: float | None
    queue_ms: float | None
    repeat: int | None
    retries: int | None
    spec_source: str | None
    num_spec_tokens: int | None
    acceptance_histogram: list[int] | None
    degraded_reason: str | None
    sampling: str | None
    temperature: float | None
    ignore_eos: int | None
    min_tokens: int | None
    route: str | None
    category: str | None

# --- server metric rows: server_metrics.parquet, one row per sample of one series ----
# The target's own Prometheus series (configs.metric_names SERVER_METRIC_NAMES), kept for
# the run's served models only, sampled every --server-metrics-interval-s and at each
# cell's start and end (loadgen.run.server_metrics). Long format: a scrape gives one row
# per (model, metric, position). Cell labels by sample time, as for step rows.
SERVER_METRIC_COLUMNS: tuple[Column, ...] = (
    _c(M.REQ_RUN_ID, "string", doc="run id"),
    _c("ts", "float64", "s (unix)", "when the scrape's response arrived", required=True),
    _c("engine", "string", doc=" | ".join(M.ENGINE_KINDS)),
    _c("model", "string", doc="the series' model label value (vLLM model_name, specload strategy)"),
    _c("metric", "string", doc="canonical name: " + ", ".join(M.SRV_COUNTERS + M.SRV_GAUGES),
       required=True),
    _c("kind", "string", doc="counter (cumulative; resets on a restart) | gauge"),
    _c("position", "int32", doc="0-based draft position (per-position counter); null otherwise"),
    _c("value", "float64", doc="the sample's value, in the metric's unit (configs/metric_names.py)",
       required=True),
    _c(M.REQ_STRATEGY, "string", doc="served name of the cell running at ts; null between cells"),
    _c(M.REQ_TIER, "string", doc="cell's tier"),
    _c(M.REQ_OUTPUT_CLASS, "string", doc="cell's output class"),
    _c(M.REQ_USERS, "int32", "users", "cell's requested concurrency"),
    _c(M.REQ_REPEAT, "int32", doc="cell's repeat"),
)


def names(columns: tuple[Column, ...]) -> tuple[str, ...]:
    return tuple(c.name for c in columns)


def required(columns: tuple[Column, ...]) -> tuple[str, ...]:
    return tuple(c.name for c in columns if c.required)


def numeric(columns: tuple[Column, ...]) -> tuple[str, ...]:
    return tuple(c.name for c in columns if c.numeric)


def units(columns: tuple[Column, ...]) -> dict[str, str]:
    """name -> unit, for tables that print units."""
    return {c.name: c.unit for c in columns}


def coerce_row(columns: tuple[Column, ...], row: dict[str, Any]) -> dict[str, Any]:
    """Fit a row to ``columns``: missing / NaN -> the column's default (None unless set), values cast to the column type,
    a value of the wrong kind -> None (a number column) or ``str`` (a string column).
    Keys not in ``columns`` are dropped."""
    out: dict[str, Any] = {}
    for c in columns:
        v = row.get(c.name)
        if v is None or (isinstance(v, float) and v != v):
            out[c.name] = c.default
        elif c.type in ("int32", "int64"):
            out[c.name] = int(v) if isinstance(v, (int, float)) else None
        elif c.type == "float64":
            out[c.name] = float(v) if isinstance(v, (int, float)) else None
        elif c.type == "list<int64>":
            out[c.name] = [int(x) for x in v] if isinstance(v, (list, tuple)) else None
        else:
            out[c.name] = str(v)
    return out


def arrow_schema(columns: tuple[Column, ...]):
    """The ``pyarrow.Schema`` of ``columns``, ``SCHEMA_VERSION`` in its metadata.

    pyarrow is imported here (the ``loadgen`` / ``analysis`` extras), so the
    engine can import this module without it.
    """
    import pyarrow as pa

    types = {"string": pa.string(), "int32": pa.int32(), "int64": pa.int64(),
             "float64": pa.float64(), "list<int64>": pa.list_(pa.int64())}
    return pa.schema([(c.name, types[c.type]) for c in columns],
                     metadata={PARQUET_VERSION_KEY: str(SCHEMA_VERSION).encode()})


def file_version(metadata: dict[bytes, bytes] | None) -> int | None:
    """``SCHEMA_VERSION`` recorded in a Parquet file's key-value metadata (None: older file)."""
    raw = (metadata or {}).get(PARQUET_VERSION_KEY)
    return int(raw) if raw else None
