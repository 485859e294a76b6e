"""Engine configuration (pydantic, unknown keys are errors).

One ``EngineConfig`` per deployment; ``strategy`` selects the proposer and
``strategy_options`` holds that proposer's own knobs (validated by the
proposer's options model, see ``actors.engine.strategies``). The same dict
drops into a Ray Serve ``user_config`` / deployment arg and into tier files.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from configs.paths import MODELS_DIR
from configs.serve_config import SpecSchedule, parse_spec_schedule, resolve_rejection_sample

DEFAULT_TARGET = MODELS_DIR / "target"
DEFAULT_DRAFT = MODELS_DIR / "draft"


class EngineConfig(BaseModel):
    """Settings of one engine (one replica).

    max_num_seqs: cap on running requests (KV slots). max_num_batched_tokens:
    per-step token budget shared by prefill chunks and verification tokens
    (vLLM's name). max_model_len: prompt + output tokens per request.
    num_speculative_tokens: k, the most draft tokens per request per step (None: the
    strategy's default: 0 autoregressive, 4 draft_model / ngram, 7 for the DFlash family).
    max_waiting: queue length beyond which ``add_request`` raises QueueFullError.
    torch_threads: intra-op threads for the process that hosts the engine; set
    once by that process (the Serve replica, or a CLI's ``main``), never by the
    engine itself. served_model_name: the OpenAI ``model`` name this engine is
    served under (None: the strategy id); step-log rows carry it beside the
    strategy so a deployment named differently from its strategy keeps its own log.

    num_speculative_tokens_per_batch_size: dynamic speculation (vLLM PR #32374's
    name and semantics; SmartSpec, arXiv 2406.14066, for why k should fall with
    load): inclusive batch-size ranges -> k, e.g. ``{"1-16": 3, "64-128": 2,
    "256-4096": 0}``; each step takes k from its batch size (the requests running
    once the step's admissions are in), 0 = no drafts that step. A gap between
    ranges inherits the k of the range below it, sizes past the last range the
    last k, and the first range must start at 1 (vLLM's rule;
    ``configs.serve_config.parse_spec_schedule``). Every k must be in
    0..num_speculative_tokens (the strategy's default when that is None), and
    within a block drafter's block size - 1 (DFlash family): ValueError naming
    the key otherwise. None (default): k = num_speculative_tokens every step.
    draft_deadline_ms: a propose call that returns later than this (ms, wall
    time, checked when it returns: a Python call cannot be interrupted) degrades
    its requests to autoregressive decoding for the rest of their life (a batched
    call over the deadline is retried request by request first, so only the
    requests slow on their own are degraded). None (default): no deadline.

    backend: "embedded" (default, specload's engine) or "vllm": vLLM's V1 engine in
    the replica's engine process, run by ``vllm_python`` (vLLM's own venv; default
    ``$SPECLOAD_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``), see
    ``actors.engine.vllm_backend``. The strategy's settings map to vLLM's
    (num_speculative_tokens, draft_model, the ngram window); ``speculative_config``
    (vLLM's dict) is passed through, merged over the mapped one: the way to serve
    methods specload does not host (eagle, eagle3, mtp, dflash; ``strategy`` is then
    that method's label); ``engine_kwargs`` go to ``vllm.EngineArgs`` as they are
    (keys checked against vLLM's EngineArgs when the app is built). Both are errors
    with backend embedded; the embedded-only knobs
    (``draft_deadline_ms``) is an error with backend vllm. Errors name the key.
    dflash / dflash2 / dspark on backend vllm take ``draft_model``: a drafter in
    vLLM's layout (``python -m train.export_vllm``; vLLM methods dflash / dflash /
    dspark). ``num_speculative_tokens_per_batch_size`` goes to vLLM's
    ``speculative_config`` field of that name (vLLM's list form).

    enable_adaptive_verification: vLLM 0.32's ``speculative_config`` field
    (verification budget sized from per-request confidence; vLLM supports it for
    dspark only): backend vllm, strategy dspark. specload's embedded dspark has its
    own confidence-scheduled verification, ``strategy_options: {scheduler: true}``
    (DSpark Sec. 4); on backend embedded this field is an error pointing there.

    rejection_sample_method (vLLM 0.32's ``speculative_config`` field and semantics):
    "standard" (default: greedy prefix match / speculative-sampling rejection),
    "synthetic" (forced acceptance: the drafter and the verify forward run for real,
    only the accept decision is drawn from a set schedule; the output is then NOT the
    target's text, see ``synthetic``) or "block" (block verification, Sun et al. 2024,
    lossless). synthetic_acceptance_length: mean tokens per verify step, the target's
    own counted, in [1, k+1] (the minimum-variance schedule); synthetic_acceptance_rates:
    [k] per-position unconditional rates in [0, 1], non-increasing; exactly one of the
    two with synthetic, neither otherwise. Non-standard methods are refused on
    autoregressive (``configs.serve_config.resolve_rejection_sample``; errors name the
    field). On backend vllm the three pass through into vLLM's ``speculative_config``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: str = "autoregressive"
    model: str = str(DEFAULT_TARGET)
    draft_model: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_num_seqs: int = Field(32, ge=1, le=4096)
    max_num_batched_tokens: int = Field(2048, ge=16)
    max_model_len: int | None = Field(None, ge=16)
    num_speculative_tokens: int | None = Field(None, ge=0, le=64)  # None: the proposer's default
    max_waiting: int = Field(1024, ge=0)
    torch_threads: int | None = Field(None, ge=1)
    replica_id: str = "0"
    served_model_name: str | None = None
    strategy_options: dict[str, Any] = Field(default_factory=dict)
    num_speculative_tokens_per_batch_size: Any = None   # {"a-b": k} or [[a, b, k]]; None: off
    draft_deadline_ms: float | None = Field(None, gt=0)
    # prefix caching (vLLM's enable_prefix_caching, on there by default): prompt K/V kept
    # in blocks of 16 tokens after a request leaves, reused by prompts that start the
    # same (actors.engine.prefix_cache); at most prefix_cache_tokens tokens (LRU). Off
    # for the DFlash family (its drafter needs the target's hidden states of every token).
    enable_prefix_caching: bool = False
    prefix_cache_tokens: int = Field(65536, ge=16)
    # vLLM's flag: False runs the target's (and draft model's) forward through
    # torch.compile for decode / verify batches (ModelRunner.compile: ~1 min of compiling
    # at load on a small CPU, less once inductor's cache on disk is warm). specload's
    # default is eager (vLLM's is compiled): tests and short runs start in seconds.
    enforce_eager: bool = True
    backend: Literal["embedded", "vllm"] = "embedded"
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    speculative_config: dict[str, Any] | None = None
    vllm_python: str | None = None
    rejection_sample_method: str = "standard"     # standard | synthetic | block (vLLM's)
    synthetic_acceptance_length: float | None = None
    synthetic_acceptance_rates: list[float] | None = None
    enable_adaptive_verification: bool = False     # vLLM's; backend vllm, dspark only

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        from actors.engine.strategies import PROPOSERS, get_proposer_class

        if self.backend == "embedded":
            for key in ("engine_kwargs", "speculative_config", "vllm_python"):
                if getattr(self, key):
                    raise ValueError(f"{key}: only for backend vllm (this engine's backend "
                                     "is embedded)")
            if self.enable_adaptive_verification:
                raise ValueError("enable_adaptive_verification: vLLM's field (backend vllm, "
                                 "dspark); the embedded dspark's confidence-scheduled "
                                 "verification is strategy_options: {scheduler: true}")
        else:
            from actors.engine.vllm_backend import BLOCK_DRAFTER_METHODS, vllm_engine_args

            mapped = ("ngram", "draft_model", *BLOCK_DRAFTER_METHODS)
            if self.speculative_config is not None and not self.speculative_config.get(
                    "method") and self.strategy not in mapped:
                raise ValueError("speculative_config.method is required (vLLM's method, "
                                 "e.g. eagle3, mtp, dflash)")
            if self.strategy not in PROPOSERS:
                if not self.speculative_config:
                    raise ValueError(
                        f"strategy {self.strategy!r} on backend vllm: give "
                        "speculative_config (vLLM's); specload maps autoregressive, ngram, "
                        "draft_model, dflash, dflash2 and dspark itself")
                self._rejection_rates()           # raises naming the field
                vllm_engine_args(self.model_dump())   # raises naming the key
                return self     # a vLLM-only method: its label, vLLM validates the rest
            self._rejection_rates()               # raises naming the field
            vllm_engine_args(self.model_dump())   # raises naming the key
            if self.strategy in BLOCK_DRAFTER_METHODS:
                return self     # vLLM's drafter and options: vLLM validates the rest
        if self.strategy not in PROPOSERS:
            raise ValueError(f"strategy {self.strategy!r} is unknown; expected one of "
                             f"{sorted(PROPOSERS)}")
        # The proposer's own pydantic options model (unknown keys are errors), so a
        # typo in configs/serve.yaml fails when the app is built (build_app), not
        # when a replica starts.
        cls = get_proposer_class(self.strategy)
        try:
            cls.Options(**self.strategy_options)
        except ValidationError as e:
            raise ValueError(f"strategy_options for {self.strategy}: {e}") from None
        if self.num_speculative_tokens_per_batch_size is not None and self.backend == "embedded":
            self.spec_schedule()   # raises naming the key (backend vllm: vllm_engine_args)
        self._rejection_rates()    # raises naming the field
        return self

    def resolved_num_speculative_tokens(self) -> int | None:
        """k: ``num_speculative_tokens``, else the strategy's default (for a vLLM-only
        method: its ``speculative_config.num_speculative_tokens``, else None: vLLM's
        own default, unknown here)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        from actors.engine.strategies import PROPOSERS, get_proposer_class

        if self.strategy in PROPOSERS and not (self.backend == "vllm" and self.speculative_config):
            return get_proposer_class(self.strategy).default_num_speculative_tokens
        k = (self.speculative_config or {}).get("num_speculative_tokens")
        return int(k) if k is not None else None

    def _rejection_rates(self) -> list[float] | None:
        return resolve_rejection_sample(
            {"strategy": self.strategy, "rejection_sample_method": self.rejection_sample_method,
             "synthetic_acceptance_length": self.synthetic_acceptance_length,
             "synthetic_acceptance_rates": self.synthetic_acceptance_rates},
            self.resolved_num_speculative_tokens(), key="engine")

    @property
    def synthetic(self) -> bool:
        """True for forced acceptance (``rejection_sample_method: synthetic``): the
        deployment's text is the drafter's accepted drafts plus target tokens, not the
        target's own output; step-log rows and the engine's facts carry ``synthetic``
        so a consistency check skips it."""
        return self.rejection_sample_method == "synthetic"

    def synthetic_rates(self) -> list[float] | None:
        """Per-position unconditional acceptance rates [k] of a synthetic engine (the
        minimum-variance schedule of ``synthetic_acceptance_length``, or the given
        rates); None unless synthetic."""
        return self._rejection_rates()

    def resolved_vllm_python(self) -> str:
        """The interpreter of vLLM's venv (``vllm_python``, else the default)."""
        from actors.engine.vllm_backend import default_vllm_python

        return self.vllm_python or default_vllm_python()

    def spec_schedule(self) -> SpecSchedule | None:
        """``num_speculative_tokens_per_batch_size`` as sorted (lo, hi, k) ranges, or None.

        Raises ValueError (naming the key and the range) when it is malformed or a
        k exceeds what this strategy can verify (see the class docstring).
        """
        if self.num_speculative_tokens_per_batch_size is None:
            return None
        from actors.engine.strategies import get_proposer_class

        cls = get_proposer_class(self.strategy)
        k = self.num_speculative_tokens
        max_k = cls.default_num_speculative_tokens if k is None else k
        why = (f"num_speculative_tokens={k}" if k is not None else
               f"num_speculative_tokens is unset: {self.strategy}'s default "
               f"{cls.default_num_speculative_tokens}")
        limit = cls.draft_tokens_limit(self.draft_model, self.strategy_options_model())
        if limit is not None and limit[0] < max_k:
            max_k, why = limit
        return parse_spec_schedule(self.num_speculative_tokens_per_batch_size, max_k, why)

    def strategy_options_model(self):
        """The validated options of this strategy (its proposer's ``Options`` model)."""
        from actors.engine.strategies import get_proposer_class

        return get_proposer_class(self.strategy).Options(**self.strategy_options)

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device() == "cuda" else torch.float32
        return getattr(torch, self.dtype)
