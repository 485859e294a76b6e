"""Schema of the Serve application's ``args`` (``configs/serve.yaml``), pydantic, extra="forbid".

``actors.serve.app:build_app(args)`` validates its args with ``ServeAppConfig``:

```yaml
args:
  strategies:
    - name: ngram                # the OpenAI `model` field; defaults to engine.strategy
      engine: {strategy: ngram, num_speculative_tokens: 4, max_num_seqs: 32}
      num_replicas: 1            # or autoscaling_config: {min_replicas, max_replicas, ...}
      ray_actor_options: {num_cpus: 0.3}   # num_gpus: 1 (or 0.5) on a GPU cluster
  ingress: {num_replicas: 1, ray_actor_options: {num_cpus: 0.1}}
```

``engine`` holds ``actors.engine.config.EngineConfig`` fields; it is validated by
EngineConfig itself when the app is built (unknown keys are errors there too),
``strategy_options`` included: EngineConfig checks them against the strategy's
own pydantic options model (``Proposer.Options``), so a typo such as
``prompt_lookup_mx`` fails ``serve run`` / ``serve deploy`` / ``cluster up``
at deploy time, naming the strategy and the key, not at replica start. (This
schema sits below the engine in the layer order, so it cannot import the
proposers itself; ``actors.serve.app.build_app`` runs both checks.)
Model paths that are relative are taken relative to the repository root.

max_ongoing_requests: Serve admits at most this many concurrent calls per
replica and queues the rest in the proxy. The engine batches up to
``max_num_seqs`` and queues up to ``max_waiting`` more, answering 429 beyond
that, so a replica must accept ``max_num_seqs + max_waiting`` calls or Serve
caps the batch below the engine's limit (Ray's default of 5 would). ``auto``
(the default) sets ``max_num_seqs + max_waiting + CONTROL_HEADROOM``: the
headroom keeps the replica's small control calls (``info``, ``step_log``)
from queueing behind a full engine. An explicit value below ``max_num_seqs``
is rejected.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs import metric_names as mn

# EngineConfig defaults, repeated here so this schema loads without torch.
ENGINE_DEFAULT_MAX_NUM_SEQS = 32
_ENGINE_DEFAULT_MAX_WAITING = 1024
# The Serve HTTP proxy's environment (it is Ray's, not an application's): the proxy
# talks to ingress replicas over gRPC instead of Ray actor calls. Measured on the
# one-hop route (fake engine, 16 streams): serving CPU per streamed token 0.70 ->
# 0.51 ms (proxy + replica). ``python -m cluster up`` starts its Ray head with it
# (unless already set); on a cluster started elsewhere, set it where `ray start` runs.
# And its request router on the proxy's own event loop (Serve's throughput mode does the
# same), not a loop on a second thread: no cross-thread hand-off per request and per chunk.
# bench_serve, 4 streams x 64 tokens, 12 waves each, the time from a wave's first send to
# its first engine step: 21-22.5 -> 16-18 ms (strategy route, 2-core box).
# Over gRPC, a response the proxy receives from a replica is capped at
# RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH (Ray's default 4 MiB): GET /specload/step_log for
# one 30 s cell of a busy strategy is ~29 MB, and was answered HTTP 500 RESOURCE_EXHAUSTED
# (the load generator then recorded no steps). 256 MiB holds the step-log store's whole ring
# buffer (``step_log_store_capacity``, 100k rows of ~0.7 kB).
PROXY_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
             "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(256 * 1024 * 1024)}
# The replicas' environment (an application's runtime_env; configs/serve.yaml and
# serve-vllm.yaml carry the same, tests/test_serve_config.py checks): gRPC handles between
# ingress and strategy replicas, user code and the request router on the replica's own loop
# (three of Serve's throughput-mode settings; not RAY_SERVE_THROUGHPUT_OPTIMIZED as a
# whole, which also turns on direct ingress and its replica ports from 30000 up).
# Ray Serve's direct ingress (one of its throughput-mode settings), on by default: ``python
# -m cluster up`` starts its Ray head with it (``--no-direct-ingress``: without). Every
# strategy replica also answers HTTP on a port of its own (Serve allocates them from 30000
# up, on the HTTP options' host: 127.0.0.1 in configs/serve.yaml), with no Serve proxy in
# the path: no proxy CPU per streamed chunk, no call back to the proxy for the request
# body. The proxy's routes stay. ``GET /specload/routes`` lists those listeners
# (``direct``) and ``python -m loadgen``'s default route loads them, falling back to the
# proxy's route for a user whose listener refuses or drops its connection (a replaced
# replica's new port).
# bench_serve, 64 tokens, medians of 3, quiet 2-core box, 2026-12-03: served / direct
# 0.976 (4 streams) and 0.980 (16) against 0.861 / 0.899 through the proxy in the same
# run. A replica's graceful stop waits Serve's direct-ingress draining period (for
# external load balancers, 30 s by default); here it is 1 s, as the proxy's routes
# (Serve's router) and the load generator's fallback need none.
DIRECT_INGRESS_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                      "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
REPLICA_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
               "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
               "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
CONTROL_HEADROOM = 4   # extra Serve slots for info / step_log calls on a full replica
DEFAULT_ENGINE_FACTORY = "actors.serve.engine_core:make_llm_engine"  # (engine dict) -> LLMEngine
# engine_process "auto": its own process from this many cores. On the 2-core dev box, side by
# side with the 50 ms stream window (bench_serve, 64 tokens, medians of 3, two runs each):
# served/direct 0.87-0.91 (4 streams) / 0.90 (16) in its own process against 0.75-0.80 /
# 0.73-0.75 on a thread of the replica (the GIL, not only the cores, was the limit)
ENGINE_PROCESS_MIN_CPUS = 2
# A strategy's streamed deltas: one per this many ms (Ray Serve LLM's stream batching,
# ``stream_batching_interval_ms``, default 50 there). Each chunk costs the replica, the Serve
# proxy and the client CPU; the load generator's ITL stays per token (``token_ts``).
DEFAULT_STREAM_INTERVAL_MS = 50.0
STEP_FLUSH_S = 0.5   # a replica pushes its new step rows to the step-log store this often, seconds


def resolve_engine_process(value: bool | str) -> bool:
    """``engine_process`` of a strategy entry -> whether the engine runs in its own process
    (``"auto"``: when this machine gives the process at least ENGINE_PROCESS_MIN_CPUS cores)."""
    if value == "auto":
        import os

        return len(os.sched_getaffinity(0)) >= ENGINE_PROCESS_MIN_CPUS
    return bool(value)


# --- dynamic speculation: k per batch size (vLLM PR #32374) ------------------------
SPEC_SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
SpecSchedule = tuple[tuple[int, int, int], ...]   # sorted (first batch size, last, k)


def parse_spec_schedule(value: Any, max_k: int | None = None, why: str = "",
                        key: str = SPEC_SCHEDULE_KEY) -> SpecSchedule:
    """Validate a batch-size -> k map and return it as sorted ``(lo, hi, k)`` ranges.

    ``value``: vLLM's ``speculative_config.num_speculative_tokens_per_batch_size``
    (PR #32374): a dict of inclusive batch-size ranges to k, e.g.
    ``{"1-16": 3, "64-128": 2, "256-4096": 0}`` ("8" alone means "8-8"), or the
    later vLLM list form ``[[1, 16, 3], [64, 128, 2]]``. k = 0 turns speculation
    off for the steps whose batch size falls in that range (SmartSpec, arXiv
    2406.14066: the best k falls as the batch grows).

    vLLM's rule for batch sizes no range covers, mirrored by ``spec_schedule_k``:
    a gap takes the k of the nearest range below it, a size past the last range
    the last range's k; the first range must start at 1 (vLLM refuses a
    schedule that does not, so every batch size has a defined k).

    max_k: the most draft tokens per step the engine allows (``num_speculative_tokens``,
    capped by a drafter's block size); ``why`` names where it comes from. vLLM
    clamps a larger k silently; here it is an error.

    Raises ValueError naming ``key`` and the offending range: a range that is
    not ``"a-b"`` with integers 1 <= a <= b, overlapping ranges, a first range
    not starting at 1, an empty map, or k not an integer in ``0..max_k``.
    """
    out = []
    for where, lo, hi, k in _spec_schedule_items(value, key):
        if not 1 <= lo <= hi:
            raise _schedule_error(key, where, f"{lo}-{hi}", "a range a-b with 1 <= a <= b")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0 or (
                max_k is not None and k > max_k):
            top = f"0..{max_k}" if max_k is not None else ">= 0"
            raise _schedule_error(key, where, k, f"k an integer in {top}{f' ({why})' if why else ''}",
                                  f"lower k to {top} (0 turns speculation off for those batch sizes)")
        out.append((lo, hi, k))
    out.sort()
    for (lo0, hi0, _), (lo1, hi1, _) in zip(out, out[1:]):
        if lo1 <= hi0:
            raise _schedule_error(key, "", f"{lo0}-{hi0} and {lo1}-{hi1}", "non-overlapping ranges")
    if out[0][0] != 1:
        raise _schedule_error(key, "", f"first range {out[0][0]}-{out[0][1]}",
                              "the first range to start at batch size 1 (as vLLM requires: every "
                              "batch size then has a defined k)")
    return tuple(out)


def _schedule_error(key: str, what: str, got: Any, expected: str, fix: str = "") -> ValueError:
    """``parse_spec_schedule``'s error: ``<key><what>: expected ...; got ...[; fix: ...]``."""
    return ValueError(f"{key}{what}: expected {expected}; got {got!r}"
                      + (f"; fix: {fix}" if fix else ""))


def _spec_schedule_items(value: Any, key: str) -> list[tuple[str, int, int, Any]]:
    """A schedule's ranges as (where, first batch size, last, k), unchecked beyond their
    form: the dict form's ``"a-b"`` / ``"a"`` keys parsed, the list form's triples taken.
    Raises ValueError (``_schedule_error``) for an empty map or list, a key that is not
    a range of integers, a list entry that is not three integers, or another type."""
    if isinstance(value, dict):
        if not value:
            raise _schedule_error(key, "", value, "a non-empty map such as {'1-16': 3, "
                                  "'17-4096': 0} (null turns the schedule off)")
        items = []
        for rng, k in value.items():
            lo_s, sep, hi_s = str(rng).strip().partition("-")
            try:
                lo, hi = int(lo_s), int(hi_s if sep else lo_s)
            except ValueError:
                raise _schedule_error(key, f"[{rng!r}]", rng, "a batch-size range 'a-b' of "
                                      "integers, e.g. '1-16'") from None
            items.append((f"[{rng!r}]", lo, hi, k))
        return items
    if isinstance(value, (list, tuple)):
        if not value:
            raise _schedule_error(key, "", value, "a non-empty list such as [[1, 16, 3], "
                                  "[17, 4096, 0]] (null turns the schedule off)")
        items = []
        for i, e in enumerate(value):
            if not isinstance(e, (list, tuple)) or len(e) != 3 or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in e[:2]):
                raise _schedule_error(key, f"[{i}]", e, "[first batch size, last batch size, "
                                      "k] integers")
            items.append((f"[{i}]", e[0], e[1], e[2]))
        return items
    raise _schedule_error(key, "", value, "a map {'a-b': k} of batch-size ranges to k, or null")


def spec_schedule_k(schedule: SpecSchedule, batch_size: int) -> int:
    """k for a step of ``batch_size`` requests (vLLM PR #32374's lookup): the k of
    the last range starting at or below ``batch_size``, so a gap between ranges
    inherits the range below it and sizes past the last range take its k."""
    k = schedule[0][2]
    for lo, _, rk in schedule:
        if lo > batch_size:
            break
        k = rk
    return k


# --- forced acceptance / block verification (vLLM 0.32's speculative_config fields) ----
REJECTION_SAMPLE_METHODS = ("standard", "synthetic", "block")
REJECTION_SAMPLE_KEYS = ("rejection_sample_method", "synthetic_acceptance_length",
                         "synthetic_acceptance_rates")


def acceptance_length_to_rates(length: float, k: int) -> list[float]:
    """vLLM's ``SpeculativeConfig._acceptance_length_to_rates``: a mean acceptance
    length ``length`` (tokens per verify step, the target's own counted) -> per-position
    *unconditional* acceptance rates [k] by the minimum-variance schedule: the
    ``length - 1`` expected accepted drafts are spent on the earliest positions
    (3.5 at k=4 -> [1, 1, 0.5, 0])."""
    num_drafts = length - 1
    num_full = int(num_drafts)
    return ([1.0] * num_full + [num_drafts - num_full] + [0.0] * (k - num_full - 1))[:k]


def unconditional_to_conditional_rates(rates: list[float]) -> list[float]:
    """vLLM's ``unconditional_to_conditional_rates``: c_i = r_i / r_{i-1} (r_{-1} = 1;
    0 after a position of rate 0): the accept probability of position i given all
    earlier drafts were accepted."""
    return [p / q if q > 0.0 else 0.0 for p, q in zip(rates, [1.0, *rates[:-1]])]


def resolve_rejection_sample(engine: dict, k: int | None, key: str = "engine"
                             ) -> list[float] | None:
    """Check an ``engine:`` block's ``rejection_sample_method`` /
    ``synthetic_acceptance_length`` / ``synthetic_acceptance_rates`` (vLLM 0.32's
    ``SpeculativeConfig`` semantics and checks) and return the per-position
    unconditional acceptance rates [k] of a synthetic deployment (None otherwise).

    k: the deployment's draft length (``num_speculative_tokens``, resolved); None when
    it is not known here (left to the strategy's default): the checks that need k
    (length in [1, k+1], k rates) then wait for ``EngineConfig``. Raises ValueError
    naming ``<key>.<field>``: an unknown method; synthetic (or block) on
    autoregressive or with k = 0; synthetic without exactly one of length and rates;
    a length outside [1, k+1]; rates not k long, outside [0, 1] or rising; a length
    or rates given with a method other than synthetic.
    """
    method = engine.get("rejection_sample_method", "standard")
    if method is None:
        method = "standard"
    length = engine.get("synthetic_acceptance_length")
    rates = engine.get("synthetic_acceptance_rates")
    if method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"{key}.rejection_sample_method: {method!r} is unknown; expected one "
                         f"of {list(REJECTION_SAMPLE_METHODS)}")
    if method != "synthetic":
        if length is not None or rates is not None:
            raise ValueError(f"{key}.synthetic_acceptance_rates / synthetic_acceptance_length "
                             "are only valid with rejection_sample_method='synthetic' (got "
                             f"rejection_sample_method={method!r})")
    strategy = engine.get("strategy")
    if method != "standard" and strategy == mn.AUTOREGRESSIVE:
        raise ValueError(f"{key}.rejection_sample_method: {method!r} needs a speculative "
                         "strategy (autoregressive verifies no drafts); use 'standard'")
    if method != "standard" and k == 0:
        raise ValueError(f"{key}.rejection_sample_method: {method!r} needs draft tokens "
                         "(num_speculative_tokens is 0)")
    if method != "synthetic":
        return None
    if (rates is None) == (length is None):
        raise ValueError(f"{key}: rejection_sample_method='synthetic' requires exactly one of "
                         "synthetic_acceptance_rates or synthetic_acceptance_length (got "
                         f"{'both' if rates is not None else 'neither'})")
    if rates is not None:
        rates = _checked_synthetic_rates(rates, k, key)
        return rates if k is not None else None
    if not isinstance(length, (int, float)) or isinstance(length, bool):
        raise ValueError(f"{key}.synthetic_acceptance_length must be a number, got {length!r}")
    top = f"{k + 1}" if k is not None else "k+1"
    if not 1.0 <= float(length) <= (float(k + 1) if k is not None else float("inf")):
        raise ValueError(f"{key}.synthetic_acceptance_length must be in [1, {top}] "
                         f"(num_speculative_tokens {k} + 1), got {length}")
    return acceptance_length_to_rates(float(length), k) if k is not None else None


def _checked_synthetic_rates(rates: Any, k: int | None, key: str) -> list[float]:
    """``synthetic_acceptance_rates`` as floats [k], checked as vLLM 0.32 does: a list of
    numbers, k long (when k is known), each in [0, 1], non-increasing (unconditional
    per-position rates). Raises ValueError naming ``<key>.synthetic_acceptance_rates``."""
    if not isinstance(rates, (list, tuple)) or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) for r in rates):
        raise ValueError(f"{key}.synthetic_acceptance_rates must be a list of numbers, "
                         f"got {rates!r}")
    rates = [float(r) for r in rates]
    if k is not None and len(rates) != k:
        raise ValueError(f"{key}.synthetic_acceptance_rates must have length {k} "
                         f"(num_speculative_tokens), got {rates}")
    if not all(0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"{key}.synthetic_acceptance_rates entries must be in [0, 1], "
                         f"got {rates}")
    if any(rates[i] > rates[i - 1] for i in range(1, len(rates))):
        raise ValueError(f"{key}.synthetic_acceptance_rates must be non-increasing "
                         f"(unconditional per-position rates), got {rates}")
    return rates


class AutoscalingConfig(BaseModel):
    """Subset of Serve's autoscaling_config (same names, same meaning)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(32.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)

    @model_validator(mode="after")
    def _check(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling_config.max_replicas ({self.max_replicas}) must be >= "
                             f"min_replicas ({self.min_replicas})")
        return self


class RayActorOptions(BaseModel):
    """Resources of one replica: fractional num_cpus on a CPU box, num_gpus (1 or a
    fraction) on a GPU cluster; ``resources`` for custom node labels."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(0.3, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory: int | None = Field(None, ge=0, description="bytes")
    resources: dict[str, float] = Field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None

    def serve_options(self, **override: Any) -> dict[str, Any]:
        """The ``ray_actor_options`` dict for ``Deployment.options`` (unset fields and an empty
        ``resources`` left out; ``override`` replaces fields, e.g. ``num_cpus=0``)."""
        opts = {**self.model_dump(exclude_none=True), **override}
        if not opts.get("resources"):
            opts.pop("resources", None)
        return opts


class StrategyEntry(BaseModel):
    """One strategy deployment: engine settings plus Serve scaling and resources."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    engine: dict[str, Any] = Field(default_factory=dict)
    num_replicas: int | None = Field(None, ge=1)
    autoscaling_config: AutoscalingConfig | None = None
    max_ongoing_requests: int | Literal["auto"] = "auto"
    ray_actor_options: RayActorOptions = Field(default_factory=RayActorOptions)
    step_log_capacity: int = Field(8192, ge=0, description="rows kept per replica")
    # Serve calls the replica's check_health every period; 3 failures in a row (a
    # dead engine loop) and Serve replaces the replica: ~6 s here, not Ray's ~30 s.
    stream_interval: int = Field(1, ge=1, le=4096, description=(
        "tokens per streamed chunk (vLLM's stream_interval); 1 = every engine step. "
        "A request may override it with the stream_interval body field"))
    stream_interval_ms: float | None = Field(DEFAULT_STREAM_INTERVAL_MS, gt=0, le=60_000,
                                             description=(
        "ms per streamed chunk (Ray Serve LLM's stream batching): the tokens an engine emits "
        "within one window leave as one chunk; the first token and the last are never held. "
        "With stream_interval > 1: a chunk at whichever comes first. null: no window (one "
        "chunk per engine step at stream_interval 1, vLLM's streaming). A request overrides "
        "both with its stream_interval / stream_interval_ms body fields"))
    engine_process: bool | Literal["auto"] = Field("auto", description=(
        "run the engine step in its own process (vLLM V1's engine-core process), so the "
        "replica's HTTP and streaming work do not share a GIL with it; false: on a thread "
        "of the replica. auto: its own process when the replica's machine has at least "
        "ENGINE_PROCESS_MIN_CPUS (2) cores: a replica held to one core keeps it on a thread"))
    health_check_period_s: float = Field(2.0, gt=0, description="seconds")
    health_check_timeout_s: float = Field(10.0, gt=0, description="seconds")

    @model_validator(mode="after")
    def _check(self):
        strategy = self.engine.get("strategy")
        if not strategy:
            raise ValueError("engine.strategy is required in every strategy entry "
                             f"(one of {list(mn.STRATEGIES)})")
        if self.name is None:
            self.name = str(strategy)
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError(f"strategy {self.name!r}: give num_replicas or "
                             "autoscaling_config, not both")
        if self.engine.get(SPEC_SCHEDULE_KEY) is not None:   # EngineConfig checks it again,
            k = self.engine.get("num_speculative_tokens")    # with the strategy's own max
            parse_spec_schedule(self.engine[SPEC_SCHEDULE_KEY], k if isinstance(k, int) else None,
                                "engine.num_speculative_tokens" if isinstance(k, int) else "",
                                key=f"strategy {self.name!r}: engine.{SPEC_SCHEDULE_KEY}")
        if any(self.engine.get(x) is not None for x in REJECTION_SAMPLE_KEYS):
            k = self.engine.get("num_speculative_tokens")   # EngineConfig checks again with
            resolve_rejection_sample(                       # the strategy's default k
                self.engine, k if isinstance(k, int) and not isinstance(k, bool) else None,
                key=f"strategy {self.name!r}: engine")
        seqs = int(self.engine.get("max_num_seqs", ENGINE_DEFAULT_MAX_NUM_SEQS))
        if self.max_ongoing_requests != "auto" and self.max_ongoing_requests < seqs:
            raise ValueError(
                f"strategy {self.name!r}: max_ongoing_requests={self.max_ongoing_requests} is "
                f"below engine.max_num_seqs={seqs}; Serve would cap the batch. Use 'auto' "
                f"(= max_num_seqs + max_waiting) or a value >= {seqs}")
        return self

    def resolved_max_ongoing_requests(self) -> int:
        """max_num_seqs + max_waiting + CONTROL_HEADROOM when 'auto' (module docstring)."""
        if self.max_ongoing_requests != "auto":
            return int(self.max_ongoing_requests)
        return (int(self.engine.get("max_num_seqs", ENGINE_DEFAULT_MAX_NUM_SEQS))
                + int(self.engine.get("max_waiting", _ENGINE_DEFAULT_MAX_WAITING))
                + CONTROL_HEADROOM)


class IngressOptions(BaseModel):
    """The OpenAI HTTP front (one FastAPI deployment routing by ``model``)."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int | Literal["auto"] = "auto"
    ray_actor_options: RayActorOptions = Field(
        default_factory=lambda: RayActorOptions(num_cpus=0.1), description=(
            "also places the app-wide step-log store (with num_cpus 0): on a multi-node "
            "cluster, a custom resource only the head has keeps the whole front there"))
    retry_after_s: int = Field(1, ge=0, description="Retry-After header on 429")
    api_key: str | None = Field(None, min_length=1, description=(
        "require 'Authorization: Bearer <key>' on every route but /health (401 otherwise); "
        "default: $SPECLOAD_API_KEY in the ingress replica's environment, else open. Prefer the "
        "environment variable: a key written here is in the config file in clear"))


class ServeAppConfig(BaseModel):
    """``args`` of the ``actors.serve.app:build_app`` application."""

    model_config = ConfigDict(extra="forbid")

    strategies: list[StrategyEntry] = Field(min_length=1)
    ingress: IngressOptions = Field(default_factory=IngressOptions)
    skip_missing_models: bool = True
    engine_factory: str = DEFAULT_ENGINE_FACTORY
    step_log_store_capacity: int = Field(100_000, ge=0, description="rows kept app-wide")
    strategy_apps: dict[str, str] = Field(default_factory=dict, description=(
        "strategy name -> the Serve application it runs as (its one-hop route, "
        "<route_prefix>/strategies/<name>); the ingress reaches those by application. "
        "Set by actors.serve.app.split_application (python -m cluster up), not by hand"))

    @model_validator(mode="after")
    def _unique(self):
        names = [s.name for s in self.strategies]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"strategy names must be unique; duplicated: {sorted(dup)}")
        return self


def configured_strategy_names(path: str | None = None) -> list[str]:
    """Names (the OpenAI ``model`` field) of every strategy a Serve config deploys.

    ``path`` defaults to ``configs/serve.yaml``. Only applications built by
    ``actors.serve.app:build_app`` count. Raises ValueError when the file does
    not validate (``ServeAppConfig``).
    """
    from pathlib import Path

    import yaml

    from configs.paths import CONFIGS_DIR

    doc = yaml.safe_load(Path(path or CONFIGS_DIR / "serve.yaml").read_text()) or {}
    names: list[str] = []
    for app in doc.get("applications") or []:
        if app.get("import_path") == "actors.serve.app:build_app":
            names += [str(e.name) for e in ServeAppConfig.model_validate(app.get("args") or {}).strategies]
    return names


# --- variants: one deployment per (strategy, k, candidates) -------------------------
# ``python -m loadgen --k 2,4,7 --top-k-candidates 4,16`` deploys each speculative strategy
# as several deployments of one strategy, named ``metric_names.variant_name`` (``dflash2-k4``,
# ``dflash2-k4-c16``); each is its own cell in the report.
MAX_K = 64   # EngineConfig's bound on num_speculative_tokens
MAX_CANDIDATES = 256   # DFlashOptions.top_k's bound


class VariantError(ValueError):
    """A ``--k`` / ``--top-k-candidates`` value no deployment can take; the message names the flag."""


def drafter_max_k(engine: dict) -> tuple[int, str] | None:
    """(the most draft tokens per step, why) of a block-drafter strategy's engine section:
    its drafter's trained ``block_size`` - 1 (the anchor takes one position;
    ``actors/drafters/config.py`` DrafterConfig), read from ``<drafter>/config.json``
    (``strategy_options.drafter``, else ``draft_model``, else ``models/<strategy>``, relative
    to the repository root). None for other strategies or when the file is absent (the
    strategy is then skipped as missing when the app is built)."""
    import json
    from pathlib import Path

    from configs.paths import MODELS_DIR, REPO_ROOT

    strategy = engine.get("strategy")
    if strategy not in mn.BLOCK_DRAFTER_STRATEGIES:
        return None
    opts = engine.get("strategy_options") or {}
    raw = opts.get("drafter") or engine.get("draft_model")
    path = Path(raw) if raw else MODELS_DIR / str(strategy)
    path = path if path.is_absolute() else REPO_ROOT / path
    try:
        block = int(json.loads((path / "config.json").read_text())["block_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    rel = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    return block - 1, f"its drafter ({rel}) was trained with block_size {block}"


class VariantRecord(TypedDict):
    """What ``variant_config`` says of one deployment of its config (``variants[name]``):
    the entry it came from, the engine's strategy id, k (draft tokens per step; 0 for
    autoregressive, None: the strategy's default), its candidate count, its forced
    acceptance length (None: a real deployment), whether it is synthetic, its engine block."""

    base_strategy: str
    strategy: str
    k: int | None
    top_k_candidates: int | None
    synthetic_acceptance_length: float | None
    synthetic: bool
    engine: dict[str, Any]


def variant_config(cfg: dict, strategies: list[str] | None, ks: list[int] | None,
                   candidates: list[int] | None, acceptance_lengths: list[float] | None = None
                   ) -> tuple[dict, dict[str, VariantRecord]]:
    """A Serve config deploying variants of ``cfg``'s strategies; returns (config, variants).

    ``strategies``: served names to keep (None or []: every entry); the ``autoregressive``
    entry is kept as it is (the speedup baseline; another autoregressive entry, such as
    ``vllm-autoregressive``, only when named), every other kept entry becomes one
    entry per k in ``ks`` (``num_speculative_tokens``; None: as configured) and, for
    ``metric_names.CANDIDATE_STRATEGIES``, per count in ``candidates``
    (``strategy_options.top_k``), named ``variant_name(name, k, c)``, its replica's
    ``num_cpus`` divided among the variants (the box's CPUs stay enough for all of them).
    With ``acceptance_lengths`` every speculative variant is further split per forced
    acceptance length A (``engine.rejection_sample_method: synthetic``,
    ``synthetic_acceptance_length: A``; vLLM's names), named ``variant_name(name, k, c, A)``
    (``draft_model-k4-al2.5``): its drafter and verify forward run for real, only the accept
    decision is set, so its text is not the target's (``synthetic`` in ``variants``).
    ``variants``: served name -> {"base_strategy" (the entry's name), "strategy" (engine id),
    "k", "top_k_candidates", "synthetic_acceptance_length" (None: a real deployment),
    "synthetic", "engine"} for every deployment of the new config.

    Raises VariantError naming ``--strategies`` (a name the config does not deploy),
    ``--k`` (k < 1, above ``MAX_K``, or above a block drafter's
    ``block_size - 1``: ``drafter_max_k``) or ``--top-k-candidates`` (out of 1..MAX_CANDIDATES,
    or no kept strategy has candidates) or ``--acceptance-length`` (A < 1, A > k + 1 for a
    deployment's k, or no kept strategy speculates).
    """
    import copy

    ks, candidates = list(ks or []), list(candidates or [])
    als = [float(a) for a in (acceptance_lengths or [])]
    _check_variant_args(ks, candidates, als)
    out = copy.deepcopy(cfg)
    variants: dict[str, VariantRecord] = {}
    for app in out.get("applications") or []:
        if app.get("import_path") == "actors.serve.app:build_app":
            entries = _vary_app(app, strategies, ks, candidates, als, variants)
            app["args"] = {**(app.get("args") or {}), "strategies": entries}
            ServeAppConfig.model_validate(app["args"])   # names unique, entries valid
    speculating = any(v["strategy"] != mn.AUTOREGRESSIVE for v in variants.values())
    used_candidates = any(v["top_k_candidates"] is not None for v in variants.values())
    if als and not speculating:
        raise VariantError("--acceptance-length: no selected strategy speculates (autoregressive "
                           "has no accept decision to force); add a speculative one to --strategies")
    if candidates and not used_candidates:
        raise VariantError(f"--top-k-candidates: no selected strategy picks among candidates "
                           f"(only {', '.join(mn.CANDIDATE_STRATEGIES)} does); add one to --strategies")
    return out, variants


def _vary_app(app: dict, strategies: list[str] | None, ks: list[int], candidates: list[int],
              als: list[float], variants: dict[str, VariantRecord]) -> list[dict]:
    """The strategy entries of one ``build_app`` application for ``variant_config``: the
    baseline as it is, each kept speculative entry as its variants (records added to
    ``variants``). Raises VariantError naming ``--strategies`` for a name it does not deploy."""
    args = ServeAppConfig.model_validate(app.get("args") or {})
    unknown = [x for x in (strategies or []) if x not in [e.name for e in args.strategies]]
    if unknown:
        raise VariantError(f"--strategies: {unknown} not in the Serve config (it deploys "
                           f"{[e.name for e in args.strategies]})")
    entries: list[dict] = []
    for e in args.strategies:
        strategy = e.engine["strategy"]
        # the baseline (served as "autoregressive") is always kept; another autoregressive
        # deployment (vllm-autoregressive) only when asked for
        baseline = strategy == mn.AUTOREGRESSIVE and e.name == mn.AUTOREGRESSIVE
        if strategies and e.name not in strategies and not baseline:
            continue
        raw = e.model_dump(exclude_none=True)
        raw["engine"] = dict(e.engine)
        if strategy == mn.AUTOREGRESSIVE:
            entries.append(raw)
            variants[str(e.name)] = _variant_record(e.name, strategy, 0, None, None, raw["engine"])
            continue
        cands = candidates if (candidates and strategy in mn.CANDIDATE_STRATEGIES) else [None]
        for v, rec in _speculative_variants(e, raw, ks, cands, als):
            entries.append(v)
            variants[v["name"]] = rec
    return entries


def _check_variant_args(ks: list[int], candidates: list[int], als: list[float]) -> None:
    """``variant_config``'s flag checks that need no config: acceptance lengths in
    [1, k + 1], each k in 1..MAX_K, each candidate count in 1..MAX_CANDIDATES; raises
    VariantError naming the flag."""
    bad = [a for a in als if not a >= 1.0]
    if bad:
        raise VariantError(f"--acceptance-length: {bad} below 1; an acceptance length counts the "
                           "target's own token, so it lies in [1, k + 1]")
    bad = [k for k in ks if als and max(als) > k + 1]
    if bad:
        raise VariantError(f"--acceptance-length: {max(als):g} above k + 1 for k = {bad}; a step "
                           f"of k drafts emits at most k + 1 tokens (use values <= {min(bad) + 1} "
                           "or larger --k)")
    bad = [k for k in ks if not 1 <= k <= MAX_K]
    if bad:
        raise VariantError(f"--k: {bad} out of range; each k (num_speculative_tokens) must be "
                           f"1..{MAX_K} (k = 0 is autoregressive, always run as the baseline)")
    bad = [c for c in candidates if not 1 <= c <= MAX_CANDIDATES]
    if bad:
        raise VariantError(f"--top-k-candidates: {bad} out of range; each must be 1..{MAX_CANDIDATES}")


def _variant_record(base: str, strategy: str, k: int | None, c: int | None, a: float | None,
                    engine: dict[str, Any]) -> VariantRecord:
    """One ``variants`` value of ``variant_config`` (its docstring names the keys)."""
    return {"base_strategy": base, "strategy": strategy, "k": k, "top_k_candidates": c,
            "synthetic_acceptance_length": a, "synthetic": a is not None, "engine": engine}


def _speculative_variants(e: StrategyEntry, raw: dict, ks: list[int], cands: list[int | None],
                          als: list[float]) -> list[tuple[dict, VariantRecord]]:
    """The deployments (entry dict, ``variants`` record) of one speculative strategy entry
    ``e`` (``raw``: its dump): one per k x candidate count x acceptance length, its
    ``num_cpus`` divided among them. Raises VariantError naming ``--acceptance-length``
    (A above k + 1 for the entry's own k) or ``--k`` (above its drafter's limit)."""
    import copy

    strategy = e.engine["strategy"]
    kk = [k if k is not None else e.engine.get("num_speculative_tokens") for k in (ks or [None])]
    over = [k for k in kk if als and isinstance(k, int) and max(als) > k + 1]
    if over:
        raise VariantError(f"--acceptance-length: {max(als):g} above k + 1 for {e.name} "
                           f"(num_speculative_tokens {over[0]}): a step of k drafts emits at "
                           f"most k + 1 tokens; use values <= {over[0] + 1} or set --k")
    limit = drafter_max_k(e.engine)
    over = [k for k in ks if limit and k > limit[0]]
    if over:
        raise VariantError(f"--k: {over} too large for {e.name}: {limit[1]}, so it drafts at "
                           f"most {limit[0]} tokens per step; use --k values <= {limit[0]} "
                           f"(or leave {e.name} out of --strategies)")
    combos = [(k, c, a) for k in (ks or [None]) for c in cands for a in (als or [None])]
    cpus = e.ray_actor_options.num_cpus / len(combos)
    out = []
    for k, c, a in combos:
        v = copy.deepcopy(raw)
        v["name"] = mn.variant_name(str(e.name), k, c, a)
        if k is not None:   # a k variant fixes k: no per-batch-size schedule
            v["engine"]["num_speculative_tokens"] = k
            v["engine"].pop("num_speculative_tokens_per_batch_size", None)
        if c is not None:
            v["engine"]["strategy_options"] = {**v["engine"].get("strategy_options", {}), "top_k": c}
        if a is not None:   # forced acceptance (vLLM's speculative_config names)
            v["engine"]["rejection_sample_method"] = "synthetic"
            v["engine"]["synthetic_acceptance_length"] = a
            v["engine"].pop("synthetic_acceptance_rates", None)
        v["ray_actor_options"] = {**raw.get("ray_actor_options", {}), "num_cpus": round(cpus, 4)}
        out.append((v, _variant_record(e.name, strategy, k if k is not None else
                                       e.engine.get("num_speculative_tokens"), c, a, v["engine"])))
    return out
