"""vLLM's engine behind specload's engine API (``engine.backend: vllm``).

vLLM's pins clash with specload's environment, so vLLM lives in a venv of its own
(``vllm_python``: ``$SPECLOAD_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``).
The replica's engine process (``actors.serve.engine_core.EngineProcess``) is started
with that interpreter and builds the engine with ``make_vllm_engine``; the replica,
its routes, validation, errors, 429s, step log, memory report and Prometheus series
are the embedded engine's, unchanged.

``VllmEngine`` wraps vLLM V1's synchronous ``LLMEngine`` (in process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so one ``step()`` is one engine-core step,
schedule + forward + sample, here) in specload's sync engine API: ``add_request``,
``abort_request``, ``step``, ``has_unfinished_requests``, ``num_waiting``,
``num_running``, ``max_model_len``, ``on_step``, ``memory``, ``reset_peak_memory``.

- strategy -> ``speculative_config`` (``vllm_engine_args``): autoregressive none,
  ngram ``{"method": "ngram", num_speculative_tokens: k, prompt_lookup_min/max}``,
  draft_model ``{"method": "draft_model", "model": draft_model, ...}``, dflash /
  dflash2 ``{"method": "dflash", "model": draft_model, ...}`` and dspark
  ``{"method": "dspark", ...}`` (``draft_model``: a drafter in vLLM's layout, e.g.
  ``python -m train.export_vllm``'s output or a published z-lab DFlash checkpoint);
  ``num_speculative_tokens_per_batch_size`` and ``enable_adaptive_verification``
  (vLLM's names, dspark only for the latter) go into the ``speculative_config``; an
  explicit ``speculative_config`` is passed through (merged over the mapped one),
  which is how methods specload does not host (eagle, eagle3, mtp) are served.
  ``engine_kwargs`` go to ``vllm.EngineArgs`` as they are.
- specload ``SamplingParams`` -> ``vllm.SamplingParams`` (``vllm_sampling_kwargs``).
- one step-log row per engine step (``step_row``), the embedded engine's columns,
  from vLLM's own per-step stats (a ``StatLoggerBase`` given to the engine:
  ``SchedulerStats.iteration_details`` for prefill / generation tokens and the
  decode batch, ``spec_decoding_stats`` for drafts and accepted tokens) plus the
  outputs of the step and its wall time.

This module's top level imports only the standard library: the mapping functions
are used (and unit tested) in specload's environment too; vLLM is imported inside
``make_vllm_engine`` / ``VllmEngine``, in the vLLM venv.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from actors.engine.types import MemoryReport, RequestOutput, SamplingParams, SyncEngine
from configs.results_schema import StepRow

ENV_VLLM_PYTHON = "SPECLOAD_VLLM_PYTHON"
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
VLLM_FACTORY = "actors.engine.vllm_backend:make_vllm_engine"
# Environment of the vLLM engine process (CPU build; harmless on CUDA)
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            # vLLM's ngram proposer runs numba; numba's default pool (one thread per core)
            # contends with the engine's own thread: ngram, 32 requests x 64 tokens, batch 4,
            # 2 cores: 14.6-16.8 s -> 3.5 s, step p90 52-160 -> 12 ms with one thread
            "NUMBA_NUM_THREADS": "1"}
# EngineConfig fields specload maps to vLLM itself: engine_kwargs may not set these
MAPPED_KEYS = {"model": "model", "dtype": "dtype", "max_num_seqs": "max_num_seqs",
               "max_num_batched_tokens": "max_num_batched_tokens",
               "max_model_len": "max_model_len", "speculative_config": "speculative_config",
               "device": "device", "served_model_name": "served_model_name",
               "enable_prefix_caching": "enable_prefix_caching"}
# specload strategy -> vLLM 0.32 speculative_config "method" (vLLM's DFlash 2 is method
# dflash with a DFlash2DraftModel checkpoint: the architecture picks the model class)
SPEC_METHODS = {"ngram": "ngram", "draft_model": "draft_model", "dflash": "dflash",
                "dflash2": "dflash", "dspark": "dspark"}
# strategies whose vLLM drafter is a checkpoint in vLLM's layout (engine.draft_model)
BLOCK_DRAFTER_METHODS = ("dflash", "dflash2", "dspark")


def check_vllm_drafter_dir(path: str) -> None:
    """Raise ValueError (naming ``draft_model``) when ``path`` holds a drafter in specload's
    own layout (its config.json has specload's ``method`` / ``target_layer_ids`` keys and no
    ``architectures``): vLLM cannot load it; ``python -m train.export_vllm`` converts it.
    A path that is not a local directory (a hub id) is left to vLLM."""
    import json

    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return
    try:
        d = json.loads(cfg.read_text())
    except ValueError:
        return
    if "architectures" not in d and "method" in d and "target_layer_ids" in d:
        raise ValueError(
            f"draft_model: {path} is a specload drafter (its own layout); vLLM loads "
            f"{d['method']} drafters in its DFlash layout: `python -m train.export_vllm "
            f"{path} OUT` writes one (or refuses, naming the part vLLM cannot express)")


def default_vllm_python() -> str:
    """``$SPECLOAD_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python``."""
    return os.environ.get(ENV_VLLM_PYTHON) or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")


def vllm_env(base: dict | None = None) -> dict:
    """The environment of a process run by the vLLM venv's python: ``base`` (default
    this process's) without PYTHONPATH / VIRTUAL_ENV (the main env's site-packages
    must not leak into vLLM's venv), plus ``VLLM_ENV``, and PYTHONPATH = the
    repository root only (specload's own light modules)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    for k, v in VLLM_ENV.items():
        env.setdefault(k, v)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


_ENGINE_ARG_NAMES: dict[str, frozenset[str]] = {}


def vllm_engine_arg_names(python: str, timeout_s: float = 120.0) -> frozenset[str]:
    """The field names of ``vllm.EngineArgs`` in the venv of ``python`` (a subprocess,
    about 5 s on 2 cores; cached per interpreter). Raises ValueError naming
    ``vllm_python`` when that interpreter is missing or cannot import vLLM."""
    import json
    import subprocess

    if python in _ENGINE_ARG_NAMES:
        return _ENGINE_ARG_NAMES[python]
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise ValueError(f"vllm_python: {python} is not an executable (the vLLM venv; set "
                         f"engine.vllm_python or ${ENV_VLLM_PYTHON})")
    code = ("import dataclasses, json; from vllm.engine.arg_utils import EngineArgs; "
            "print(json.dumps([f.name for f in dataclasses.fields(EngineArgs)]))")
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                       env=vllm_env(), stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise ValueError(f"vllm_python: {python} cannot import vllm: {p.stderr[-500:]}")
    names = frozenset(json.loads(p.stdout.strip().splitlines()[-1]))
    _ENGINE_ARG_NAMES[python] = names
    return names


def check_engine_kwargs(engine_kwargs: dict, python: str) -> None:
    """Raises ValueError naming ``engine_kwargs.<key>`` for a key ``vllm.EngineArgs``
    does not have (checked in the vLLM venv of ``python``)."""
    if not engine_kwargs:
        return
    names = vllm_engine_arg_names(python)
    bad = sorted(k for k in engine_kwargs if k not in names)
    if bad:
        import difflib

        hints = {k: difflib.get_close_matches(k, names, 1) for k in bad}
        raise ValueError("engine_kwargs: " + "; ".join(
            f"engine_kwargs.{k} is not a vllm.EngineArgs field"
            + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in bad))


def vllm_engine_args(cfg: dict, cuda: bool = False) -> dict:
    """``vllm.EngineArgs`` keywords for an ``EngineConfig`` dict (``model_dump()``);
    ``cuda``: whether the engine's machine has CUDA (dtype and device "auto" resolve
    as the embedded engine's: bfloat16 on CUDA, float32 on CPU).

    Raises ValueError naming the key: ``engine_kwargs`` setting a key specload maps
    itself (``MAPPED_KEYS``: use the engine field), a speculative strategy vLLM
    cannot run from specload's settings without a ``speculative_config``, draft_model
    without ``draft_model``, dflash / dflash2 / dspark without a vLLM-layout
    ``draft_model`` (``check_vllm_drafter_dir``), a malformed
    ``num_speculative_tokens_per_batch_size`` (``parse_spec_schedule``; it is passed
    as vLLM's list form ``[[lo, hi, k], ...]``), ``enable_adaptive_verification`` on a
    method other than dspark (vLLM 0.32 supports it for dspark only), or
    ``draft_deadline_ms`` (an embedded-engine feature).
    """
    strategy = cfg.get("strategy", "autoregressive")
    kwargs = dict(cfg.get("engine_kwargs") or {})
    for key in kwargs:
        if key in MAPPED_KEYS:
            raise ValueError(f"engine_kwargs.{key}: set by specload from engine.{key}; "
                             f"set engine.{key} instead")
    if cfg.get("draft_deadline_ms") is not None:
        raise ValueError("draft_deadline_ms: an embedded-engine feature; backend vllm does "
                         "not take it (leave it unset)")
    k = cfg.get("num_speculative_tokens")
    spec = _speculative_config(cfg, strategy, k)
    if spec is not None:
        _add_speculative_extras(cfg, spec, strategy)
    else:
        _check_no_speculation(cfg, strategy, k)
    dtype, device = cfg.get("dtype", "auto"), cfg.get("device", "auto")
    on_cuda = device == "cuda" or (device == "auto" and cuda)
    out: dict[str, Any] = {
        "model": cfg["model"],
        "dtype": dtype if dtype != "auto" else ("bfloat16" if on_cuda else "float32"),
        "max_num_seqs": cfg.get("max_num_seqs", 32),
        "max_num_batched_tokens": max(int(cfg.get("max_num_batched_tokens", 2048)),
                                      int(cfg.get("max_model_len") or 0)),
        "speculative_config": spec, "disable_log_stats": False,
        "enable_logging_iteration_details": True,   # per-step prefill / decode tokens
        "per_request_spec_decode_metrics": "summary" if spec else "none",
        "served_model_name": cfg.get("served_model_name") or strategy,
        "seed": 0,
        # the engine field, as the embedded engine reads it (vLLM's own default is on)
        "enable_prefix_caching": bool(cfg.get("enable_prefix_caching", False)),
    }
    if cfg.get("max_model_len"):
        out["max_model_len"] = cfg["max_model_len"]
    # (vLLM picks its device from the build it is: CPU or CUDA; engine.device only
    # resolves dtype "auto" here)
    out.update(kwargs)
    return out


def _speculative_config(cfg: dict, strategy: str, k: int | None) -> dict | None:
    """vLLM's ``speculative_config`` for specload's strategy (``vllm_engine_args``'s
    docstring: ngram, draft_model, the block drafters), an explicit
    ``engine.speculative_config`` merged over it; None for autoregressive. Raises
    ValueError naming ``draft_model`` or ``speculative_config`` when vLLM cannot run the
    strategy from these settings."""
    opts = cfg.get("strategy_options") or {}
    spec: dict | None = None
    if strategy == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4 if k is None else k,
                "prompt_lookup_min": int(opts.get("prompt_lookup_min", 2)),
                "prompt_lookup_max": int(opts.get("prompt_lookup_max", 4))}
    elif strategy == "draft_model":
        if not cfg.get("draft_model") and not (cfg.get("speculative_config") or {}).get("model"):
            raise ValueError("draft_model: backend vllm's draft_model strategy needs "
                             "engine.draft_model (the draft model's directory)")
        spec = {"method": "draft_model", "model": cfg.get("draft_model"),
                "num_speculative_tokens": 4 if k is None else k}
    elif strategy in BLOCK_DRAFTER_METHODS and (
            cfg.get("draft_model") or not cfg.get("speculative_config")):
        if not cfg.get("draft_model"):
            raise ValueError(
                f"draft_model: backend vllm's {strategy} needs engine.draft_model, a drafter "
                f"in vLLM's layout (`python -m train.export_vllm {strategy} OUT` for specload's, "
                "or a published checkpoint, e.g. z-lab/Qwen3-4B-DFlash-b16 for a Qwen3-4B target)")
        check_vllm_drafter_dir(cfg["draft_model"])
        spec = {"method": SPEC_METHODS[strategy], "model": cfg["draft_model"],
                "num_speculative_tokens": 7 if k is None else k}
    elif strategy != "autoregressive" and not cfg.get("speculative_config"):
        raise ValueError(f"speculative_config: strategy {strategy!r} on backend vllm needs "
                         "engine.speculative_config (vLLM's, e.g. {method: eagle3, model: ..., "
                         "num_speculative_tokens: 3}); specload maps autoregressive, ngram, "
                         "draft_model, dflash, dflash2 and dspark")
    if cfg.get("speculative_config"):
        spec = {**(spec or {}), **cfg["speculative_config"]}
        if k is not None:
            spec.setdefault("num_speculative_tokens", k)
    return spec


def _check_no_speculation(cfg: dict, strategy: str, k: int | None) -> None:
    """An autoregressive deployment (no ``speculative_config``) must set none of the
    speculative fields: raises ValueError naming ``num_speculative_tokens_per_batch_size``,
    ``enable_adaptive_verification``, ``num_speculative_tokens`` (> 0) or
    ``rejection_sample_method`` (forced acceptance), in that order."""
    from configs.serve_config import SPEC_SCHEDULE_KEY

    if cfg.get(SPEC_SCHEDULE_KEY) is not None:
        raise ValueError(f"{SPEC_SCHEDULE_KEY}: needs a speculative strategy "
                         "(autoregressive drafts nothing)")
    if cfg.get("enable_adaptive_verification"):
        raise ValueError("enable_adaptive_verification: vLLM 0.32 supports it for "
                         f"speculative method dspark only (got {strategy!r})")
    if strategy == "autoregressive" and k:
        raise ValueError("num_speculative_tokens: autoregressive takes no drafts (0 or unset)")
    method = cfg.get("rejection_sample_method") or "standard"
    if method != "standard" or cfg.get("synthetic_acceptance_length") is not None \
            or cfg.get("synthetic_acceptance_rates") is not None:
        raise ValueError(f"rejection_sample_method: {method!r} needs a speculative "
                         "strategy (autoregressive verifies nothing)")


def _add_speculative_extras(cfg: dict, spec: dict, strategy: str) -> None:
    """Put the engine fields vLLM takes inside ``speculative_config`` into ``spec`` (in
    place): ``num_speculative_tokens_per_batch_size`` (checked, vLLM's list form),
    ``enable_adaptive_verification`` (dspark only) and the forced-acceptance fields
    (``rejection_sample_method``, ``synthetic_acceptance_length`` / ``_rates``, passed
    through). Raises ValueError naming the field."""
    sched = cfg.get("num_speculative_tokens_per_batch_size")
    if sched is not None:
        from configs.serve_config import SPEC_SCHEDULE_KEY, parse_spec_schedule

        max_k = spec.get("num_speculative_tokens")
        ranges = parse_spec_schedule(sched, max_k, f"num_speculative_tokens={max_k}"
                                     if max_k is not None else "")
        spec[SPEC_SCHEDULE_KEY] = [list(r) for r in ranges]   # vLLM's list form
    if cfg.get("enable_adaptive_verification"):
        if spec.get("method") != "dspark":
            raise ValueError("enable_adaptive_verification: vLLM 0.32 supports it for "
                             "speculative method dspark only (got "
                             f"{spec.get('method') or strategy!r})")
        spec["enable_adaptive_verification"] = True
    method = cfg.get("rejection_sample_method") or "standard"
    if method != "standard" or cfg.get("synthetic_acceptance_length") is not None \
            or cfg.get("synthetic_acceptance_rates") is not None:
        # vLLM 0.32's speculative_config fields, passed through as they are
        spec["rejection_sample_method"] = method
        for key in ("synthetic_acceptance_length", "synthetic_acceptance_rates"):
            if cfg.get(key) is not None:
                spec[key] = cfg[key]


def vllm_sampling_kwargs(params: SamplingParams, max_tokens: int) -> dict:
    """``vllm.SamplingParams`` keywords for a specload ``SamplingParams`` (output
    as deltas; ``max_tokens`` already resolved: None means the rest of the context)."""
    return {"max_tokens": max_tokens, "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": params.top_p, "top_k": 0 if params.top_k in (0, -1) else params.top_k,
            "seed": params.seed, "stop": list(params.stop) or None,
            "ignore_eos": params.ignore_eos, "min_tokens": params.min_tokens,
            "logprobs": params.logprobs, "skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens,
            "stop_token_ids": list(params.stop_token_ids) or None,
            "include_stop_str_in_output": params.include_stop_str_in_output}


def step_row(*, strategy: str, model: str, replica: str, step_ms: float, cpu_ms: float,
             details: Any, spec: Any, num_waiting: int, emitted: int, prefill_emitted: int,
             batch_size: int, k: int, context_before: int = 0,
             dynamic_k: bool = False) -> StepRow:
    """One step-log row (``configs.metric_names.STEP_LOG_COLUMNS``) from vLLM's stats.

    details: ``SchedulerIterationDetails`` (num_ctx_tokens = prompt tokens this step,
    num_generation_tokens = verification tokens, sum(drafts + 1) over the decode
    batch), or None; spec: the step's ``SpecDecodingStats`` or None. emitted: tokens
    the step's decodes delivered (after stop cuts); prefill_emitted: first tokens of
    requests whose prompt finished this step; batch_size: decoding requests that
    emitted. accepted_tokens is vLLM's count (before stop / max_tokens cuts, which the
    embedded engine applies), capped at emitted - batch_size. vLLM runs the drafter
    inside its model step and times no phase apart: draft_ms is 0 and verify_ms is the
    step's wall time (drafting, forward, sampling), its generation tokens' share of it
    in a step that also prefills (vLLM's ``details.elapsed_ms`` only times the wait
    for an already finished forward in process). padded_tokens =
    verification tokens (vLLM's batch is ragged, unpadded); context_tokens = the KV
    length the decode rows attend: ``context_before`` (sum over the decoding requests
    of prompt + output tokens before the step) + the step's draft tokens, as the
    embedded engine counts it.

    num_speculative_tokens is the k vLLM drafted this step: its draft tokens per drafting
    request (``SpecDecodingStats.num_draft_tokens / num_drafts``, rounded: a dynamic k,
    ``num_speculative_tokens_per_batch_size``, is visible only there); ``k`` (the
    configured one) when no request drafted, or None then with ``dynamic_k`` (no k
    observed, and the configured one is only the largest).
    """
    from configs import metric_names as M

    drafts = int(getattr(spec, "num_draft_tokens", 0) or 0)
    n_drafts = int(getattr(spec, "num_drafts", 0) or 0)
    k_step = round(drafts / n_drafts) if n_drafts and drafts else (None if dynamic_k else int(k))
    accepted = int(getattr(spec, "num_accepted_tokens", 0) or 0)
    accepted = max(0, min(accepted, emitted - batch_size)) if spec is not None else 0
    gen = int(getattr(details, "num_generation_tokens", 0) or 0)
    ctx = int(getattr(details, "num_ctx_tokens", 0) or 0)
    verify_ms = float(step_ms) * gen / (gen + ctx) if batch_size and gen + ctx else 0.0
    return {
        M.STEP_TS: time.time(), M.STEP_STRATEGY: strategy, M.STEP_MODEL: model,
        M.STEP_REPLICA: replica, M.STEP_BATCH_SIZE: int(batch_size),
        M.STEP_PREFILL_TOKENS: ctx, M.STEP_VERIFICATION_TOKENS: gen,
        M.STEP_DRAFT_TOKENS: drafts, M.STEP_ACCEPTED_TOKENS: accepted,
        M.STEP_EMITTED_TOKENS: int(emitted), M.STEP_PREFILL_EMITTED_TOKENS: int(prefill_emitted),
        M.STEP_MS: float(step_ms), M.STEP_DRAFT_MS: 0.0, M.STEP_VERIFY_MS: verify_ms,
        M.STEP_QUEUE_DEPTH: int(num_waiting), M.STEP_PADDED_TOKENS: gen,
        M.STEP_CONTEXT_TOKENS: int(context_before) + drafts if batch_size else 0,
        M.STEP_CPU_MS: float(cpu_ms), M.STEP_VERIFY_CPU_MS: 0.0, M.STEP_NUM_SPEC_TOKENS: k_step,
        M.STEP_SPECULATION_OFF: "", M.STEP_DEGRADED_REQUESTS: 0,
        M.STEP_K_BATCH_SIZE: None,   # vLLM does not say which batch size its k lookup used
        M.STEP_FORWARD_PATH: M.FORWARD_PATH_VLLM,
        M.STEP_DRAFT_PATH: M.FORWARD_PATH_VLLM if n_drafts else ""}


def checkpoint_bytes(model_dir: str | None, element_size: int) -> int:
    """Bytes of a checkpoint's tensors (``*.safetensors`` headers: shapes, each tensor
    once, tied embeddings stored once) at ``element_size`` bytes per element; 0 when
    unreadable."""
    import json
    import math
    import struct

    total = 0
    for f in sorted(Path(model_dir or "/nonexistent").glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return 0
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total * element_size


def kv_bytes_per_token(model_dir: str | None, element_size: int) -> int:
    """K and V bytes per token of a model (its ``config.json``: layers x KV heads x
    head dim x 2 x element size); 0 when unreadable."""
    import json

    try:
        c = json.loads((Path(model_dir or "/nonexistent") / "config.json").read_text())
        heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
        head = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        return 2 * int(c["num_hidden_layers"]) * heads * head * element_size
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 0


def spec_stats_from_vllm(metrics: Any, num_steps: int, queue_ms: float = 0.0):
    """specload ``SpecStats`` from vLLM's per-request ``RequestSpecDecodeMetrics``
    (histogram[j] = verify steps that accepted j drafts; num_draft_tokens)."""
    from actors.engine.types import SpecStats

    s = SpecStats(num_steps=num_steps, queue_ms=queue_ms)
    if metrics is None:
        return s
    hist = list(getattr(metrics, "histogram", None) or [])
    s.num_drafts = int(sum(hist))
    s.num_draft_tokens = int(getattr(metrics, "num_draft_tokens", 0) or 0)
    s.num_accepted_tokens = int(sum(j * n for j, n in enumerate(hist)))
    s.num_accepted_tokens_per_pos = [int(sum(hist[i + 1:])) for i in range(max(0, len(hist) - 1))]
    return s


def rejection_method_refused(method: str, exc: BaseException) -> ValueError:
    """The deploy error when this vLLM build refuses ``rejection_sample_method`` (or its
    synthetic fields): names the field and carries vLLM's own reason (a plain
    ValueError: it crosses from the engine process to the replica pickled)."""
    reason = f"{type(exc).__name__}: {exc}".strip()
    return ValueError(f"engine.rejection_sample_method: {method!r} is refused by this vLLM "
                      f"build: {reason}")


PROBE_MAX_STEPS = 64   # steps a probe request may take (it needs a handful)


def probe_rejection_sampler(llm: Any, method: str, prompt_ids: tuple[int, ...] = (1, 2, 3, 4),
                            max_steps: int = PROBE_MAX_STEPS,
                            sampling_params: Callable[..., Any] | None = None) -> None:
    """Run two short requests (greedy and sampled: vLLM has a kernel for each) through a
    vLLM ``LLMEngine`` (``add_request`` / ``step`` / ``has_unfinished_requests``) until
    they finish, so a build that takes ``rejection_sample_method`` at construction but
    cannot run it fails here. Raises ValueError (``rejection_method_refused``) with vLLM's exception as
    the reason, or when the requests are not done within ``max_steps`` steps (a
    hang-like engine: bounded, never waits forever). sampling_params: the
    ``vllm.SamplingParams`` class (tests pass a stand-in)."""
    if sampling_params is None:
        from vllm import SamplingParams as sampling_params

    try:
        for i, temp in enumerate((0.0, 1.0)):
            llm.add_request(f"specload-probe-{i}", {"prompt_token_ids": list(prompt_ids)},
                            sampling_params(max_tokens=8, temperature=temp, seed=0,
                                            ignore_eos=True))
        for _ in range(max_steps):
            if not llm.has_unfinished_requests():
                return
            llm.step()
    except Exception as exc:  # noqa: BLE001 - vLLM's own reason, re-raised with the field
        raise rejection_method_refused(method, exc) from None
    raise rejection_method_refused(method, TimeoutError(
        f"probe requests unfinished after {max_steps} engine steps"))


# ------------------------------------------------------------- in the vLLM venv
def make_vllm_engine(engine_config: dict) -> "VllmEngine":
    """Engine factory (``EngineProcess`` runs it in the vLLM venv's python):
    ``engine_config`` is an ``EngineConfig.model_dump()``."""
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # one step() = one core step, here
    return VllmEngine(engine_config)


class VllmEngine:
    """vLLM V1 ``LLMEngine`` with specload's sync engine API (module docstring).

    Raises InvalidRequest (param "prompt") from ``add_request`` for an empty or
    too-long prompt or out-of-vocabulary token ids, QueueFull beyond ``max_waiting``.
    """

    def __init__(self, cfg: dict, on_step: Callable[[StepRow], None] | None = None):
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine as VLLMEngine
        from vllm.v1.metrics.loggers import StatLoggerBase

        self.config = cfg
        self.on_step = on_step
        self.strategy = cfg.get("strategy", "autoregressive")
        self.served_model_name = cfg.get("served_model_name") or self.strategy
        self.replica_id = str(cfg.get("replica_id", "0"))
        self.max_waiting, self.max_num_seqs = (int(cfg.get("max_waiting", 1024)),
                                               int(cfg.get("max_num_seqs", 32)))
        self._stats = stats = []   # scheduler stats, one per engine step

        class _StepStats(StatLoggerBase):   # vLLM calls record() once per engine step
            def __init__(self, vllm_config, engine_index=0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx=0):
                stats.append(scheduler_stats)

            def log_engine_initialized(self):
                pass

        import torch

        args = vllm_engine_args(cfg, cuda=torch.cuda.is_available())
        self.engine_args = args
        t0 = time.perf_counter()
        method = (args.get("speculative_config") or {}).get("rejection_sample_method",
                                                             "standard")
        try:
            self.llm = VLLMEngine.from_engine_args(EngineArgs(**args),
                                                   stat_loggers=[_StepStats])
        except Exception as exc:
            if method == "standard":
                raise
            raise rejection_method_refused(method, exc) from None
        if method != "standard":
            # a build may accept the field and fail only in its sampling kernel (the CPU
            # build asserts "Synthetic acceptance not supported with CPU sampling" at the
            # first verify step): try it now, so the deploy fails with vLLM's reason
            probe_rejection_sampler(self.llm, method)
        self.load_s = time.perf_counter() - t0
        vc = self.llm.vllm_config
        self.max_model_len = int(vc.model_config.max_model_len)
        self.vocab_size = int(vc.model_config.get_vocab_size())
        spec = vc.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens) if spec else 0
        self.tokenizer = self.llm.get_tokenizer()
        try:
            self._core = self.llm.engine_core.engine_core      # InprocClient -> EngineCore
            self._scheduler = self._core.scheduler
        except AttributeError:
            self._core = self._scheduler = None
        self.requests: dict[str, dict] = {}     # specload id -> state
        self._kv_peak_usage = 0.0
        self._kv_usage = 0.0
        self._memory_static = self._static_memory()

    # -- request lifecycle -------------------------------------------------------
    def _counts(self) -> tuple[int, int]:
        if self._scheduler is not None:
            try:
                running, waiting = self._scheduler.get_request_counts()
                return int(running), int(waiting)
            except Exception:  # noqa: BLE001 - an internal API; fall back below
                pass
        started = sum(1 for r in self.requests.values() if r["n_out"] > 0)
        return started, len(self.requests) - started

    @property
    def num_waiting(self) -> int:
        return self._counts()[1]

    @property
    def num_running(self) -> int:
        return self._counts()[0]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams) -> int:
        """Queue a request; returns its prompt length in tokens (module docstring)."""
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        from actors.engine.errors import InvalidRequest, QueueFull, check_prompt_ids, queue_full

        if request_id in self.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must be a non-empty string", param="prompt")
            if len(prompt) > 64 * self.max_model_len:    # far over the context: no tokenizing
                raise InvalidRequest(f"prompt is {len(prompt)} characters; max_model_len is "
                                     f"{self.max_model_len} tokens", param="prompt",
                                     code="context_length_exceeded")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        check_prompt_ids(ids, self.vocab_size, self.max_model_len,
                         check_vocab=not isinstance(prompt, str))
        running, waiting = self._counts()
        if queue_full(waiting, running, self.max_num_seqs, self.max_waiting):
            raise QueueFull(f"{self.num_waiting} requests are waiting "
                            f"(max_waiting={self.max_waiting})")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        sp = VSP(**vllm_sampling_kwargs(params, max_tokens))
        sp.output_kind = RequestOutputKind.DELTA
        try:
            self.llm.add_request(request_id, {"prompt_token_ids": ids}, sp)
        except ValueError as exc:   # vLLM's own input validation
            raise InvalidRequest(str(exc), param="prompt") from None
        self.requests[request_id] = {"n_prompt": len(ids), "n_out": 0, "steps": 0,
                                     "arrival": time.time(), "first": None, "text_len": 0,
                                     "params": params}
        return len(ids)

    def abort_request(self, request_id: str) -> None:
        """Drop a request (its KV blocks are freed); unknown ids are ignored."""
        if self.requests.pop(request_id, None) is None:
            return
        self.llm.abort_request([request_id])

    # -- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One vLLM engine step; returns specload ``RequestOutput`` deltas (one chunk
        per engine step) and appends one step-log row via ``on_step``."""
        t0, c0, w0 = time.perf_counter(), time.thread_time(), time.time()
        self._stats.clear()
        outs = self.llm.step()
        now = time.time()
        results = []
        emitted = prefill_emitted = batch = context_before = 0
        for o in outs:
            st = self.requests.get(o.request_id)
            if st is None:   # aborted meanwhile
                continue
            c = o.outputs[0]
            new = list(c.token_ids)
            if new:
                if st["n_out"] == 0:
                    prefill_emitted += 1
                    emitted += len(new) - 1      # a prefill step emits one token
                    st["first"] = w0     # the step that scheduled its prompt began
                else:
                    batch += 1
                    emitted += len(new)
                    context_before += st["n_prompt"] + st["n_out"]
                    st["steps"] += 1
            st["n_out"] += len(new)
            finished = bool(o.finished)
            reason = c.finish_reason if finished else None
            if reason not in (None, "stop", "length", "abort"):
                reason = "stop"
            stats = spec_stats_from_vllm(getattr(c, "spec_decode_metrics", None), st["steps"],
                                         ((st["first"] or now) - st["arrival"]) * 1e3)
            results.append(RequestOutput(
                request_id=o.request_id, new_token_ids=new, new_text=c.text or "",
                finished=finished, finish_reason=reason, num_prompt_tokens=st["n_prompt"],
                num_output_tokens=st["n_out"], stats=stats, token_ts=[now] * len(new),
                logprobs=self._logprobs(c, st) if st["params"].logprobs is not None else None,
                stop_reason=getattr(c, "stop_reason", None) if finished else None))
            if finished:
                self.requests.pop(o.request_id, None)
        sched = self._stats[-1] if self._stats else None
        if sched is not None:
            self._kv_usage = float(getattr(sched, "kv_cache_usage", 0.0) or 0.0)
            self._kv_peak_usage = max(self._kv_peak_usage, self._kv_usage)
        details = getattr(sched, "iteration_details", None)
        if self.on_step is not None and (details is not None or outs):
            self.on_step(step_row(
                strategy=self.strategy, model=self.served_model_name, replica=self.replica_id,
                step_ms=(time.perf_counter() - t0) * 1e3, cpu_ms=(time.thread_time() - c0) * 1e3,
                details=details, spec=getattr(sched, "spec_decoding_stats", None),
                num_waiting=self.num_waiting, emitted=emitted, prefill_emitted=prefill_emitted,
                batch_size=batch, k=self.num_speculative_tokens, context_before=context_before,
                dynamic_k=self.config.get("num_speculative_tokens_per_batch_size") is not None))
        return results

    def _logprobs(self, c: Any, st: dict) -> list:
        """specload ``TokenLogprob`` per new token from vLLM's logprobs (top N by rank)."""
        from actors.engine.types import TokenLogprob

        out = []
        lps = c.logprobs or []
        for tid, d in zip(c.token_ids, lps[-len(c.token_ids):] if c.token_ids else []):
            def text(t, lp):
                s = lp.decoded_token if lp is not None and lp.decoded_token is not None else \
                    self.tokenizer.decode([t])
                return s
            own = d.get(tid)
            tok = text(tid, own)
            top = sorted(((t, lp) for t, lp in d.items() if lp.rank is not None and
                          (t != tid or (lp.rank <= st["params"].logprobs))),
                         key=lambda x: x[1].rank)[:st["params"].logprobs]
            out.append(TokenLogprob(int(tid), tok, tok.encode("utf-8", "replace"),
                                    float(own.logprob) if own is not None else 0.0,
                                    tuple((int(t), text(t, lp), text(t, lp).encode("utf-8", "replace"),
                                           float(lp.logprob)) for t, lp in top),
                                    st["text_len"]))
            st["text_len"] += len(tok)
        return out

    # -- memory --------------------------------------------------------------------
    def _static_memory(self) -> MemoryReport:
        vc = self.llm.vllm_config
        mc, cc = vc.model_config, vc.cache_config
        dtype = str(mc.dtype).replace("torch.", "")
        esize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
        blocks, bs = int(cc.num_gpu_blocks or 0), int(cc.block_size)
        target_tok = kv_bytes_per_token(self.config.get("model"), esize)
        spec = vc.speculative_config
        draft_dir = None
        if spec is not None and getattr(spec, "method", None) == "draft_model":
            draft_dir = self.config.get("draft_model") or getattr(spec, "model", None)
        draft_tok = kv_bytes_per_token(draft_dir, esize) if draft_dir else 0
        return {"strategy": self.strategy, "replica": self.replica_id,
                "device": str(vc.device_config.device), "dtype": dtype,
                "max_num_seqs": int(vc.scheduler_config.max_num_seqs),
                "max_model_len": self.max_model_len,
                "num_speculative_tokens": self.num_speculative_tokens,
                "backend": "vllm", "kv_block_size": bs, "kv_num_blocks": blocks,
                # vLLM's CPU backend repacks linear weights outside the modules'
                # parameters, so weights are the checkpoint's tensors at the serving dtype
                "target_weight_bytes": checkpoint_bytes(self.config.get("model"), esize),
                "target_fused_weight_bytes": 0,
                # vLLM's one block pool holds every KV layer, a draft model's included:
                # each model's share is blocks x block size x its bytes per token
                "target_kv_allocated_bytes": blocks * bs * target_tok,
                "target_kv_bytes_per_token": target_tok,
                "draft_weight_bytes": checkpoint_bytes(draft_dir, esize) if draft_dir else 0,
                "draft_fused_weight_bytes": 0,
                "draft_kv_allocated_bytes": blocks * bs * draft_tok,
                "draft_kv_bytes_per_token": draft_tok}

    def memory(self) -> MemoryReport:
        """The embedded engine's memory report, from vLLM: weights (the checkpoints'
        tensors at the serving dtype), KV allocated (vLLM's block pool, split between
        the target's and a draft model's layers), KV used now and at peak (vLLM's
        ``kv_cache_usage`` after each step, as tokens) and the process's RSS."""
        from actors.engine import memory as mem

        out = dict(self._memory_static)
        cap = out["kv_num_blocks"] * out["kv_block_size"]
        t_now, t_peak = int(round(self._kv_usage * cap)), int(round(self._kv_peak_usage * cap))
        d = 1 if out["draft_kv_bytes_per_token"] else 0    # a draft model's layers: same blocks
        out.update(target_kv_tokens_used=t_now, target_kv_peak_tokens=t_peak,
                   target_kv_peak_used_bytes=t_peak * out["target_kv_bytes_per_token"],
                   draft_kv_tokens_used=t_now * d, draft_kv_peak_tokens=t_peak * d,
                   draft_kv_peak_used_bytes=t_peak * d * out["draft_kv_bytes_per_token"])
        out.update(mem.process_memory(out["device"]))
        return out

    def reset_peak_memory(self) -> None:
        self._kv_peak_usage = self._kv_usage


def run_requests(engine: SyncEngine, requests: list, batch_size: int = 1) -> dict[str, dict]:
    """``actors.engine.llm_engine.run_requests`` for any engine of this API (tests,
    offline use): id -> {token_ids, text, finish_reason, stats}."""
    pending = list(requests)
    results: dict[str, dict] = {}
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.requests) < batch_size:
            rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
            results[rid] = {"token_ids": [], "text": "", "finish_reason": None, "stats": None}
        for out in engine.step():
            res = results[out.request_id]
            res["token_ids"].extend(out.new_token_ids)
            res["text"] += out.new_text
            if out.finished:
                res["finish_reason"] = out.finish_reason
                res["stats"] = out.stats
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m actors.engine.vllm_backend`` in the vLLM venv (offline runs, tests, the
    engine profile): reads ``{"config": EngineConfig dict, "requests": [[id, prompt,
    SamplingParams fields]], "batch_size": n}`` as JSON on stdin, writes ``{"results": {id:
    {token_ids, text, finish_reason, stats}}, "steps": [step rows], "memory": {...},
    "load_s"}`` as JSON on stdout (the last line). With ``"phases": [{"requests": [...],
    "batch_size": n}, ...]`` instead of ``requests``, the phases run one after another on the
    one engine (loaded once) and ``"phases"`` holds each one's ``{"steps", "run_s"}``."""
    import json
    import sys

    from actors.engine.types import SamplingParams

    import torch

    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(int(spec["config"].get("torch_threads") or 1))   # as a replica's
    engine = make_vllm_engine(spec["config"])
    rows: list[dict] = []
    engine.on_step = rows.append
    phases = spec.get("phases") or [{"requests": spec.get("requests") or [],
                                     "batch_size": spec.get("batch_size", 1)}]
    results: dict = {}
    done = []
    for ph in phases:
        rows.clear()
        reqs = [(rid, p, SamplingParams(**sp)) for rid, p, sp in ph["requests"]]
        t0 = time.perf_counter()
        results.update(run_requests(engine, reqs, int(ph.get("batch_size", 1))))
        done.append({"steps": list(rows), "run_s": time.perf_counter() - t0})
    out = {"results": {k: {**v, "stats": v["stats"].to_dict() if v["stats"] else None}
                       for k, v in results.items()},
           "steps": [r for ph in done for r in ph["steps"]], "memory": engine.memory(),
           "load_s": engine.load_s, "run_s": sum(ph["run_s"] for ph in done)}
    if spec.get("phases"):
        out["phases"] = done
    sys.stdout.write("\n" + json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
