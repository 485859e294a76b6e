"""Build the specload Serve application from ``configs/serve.yaml`` args.

``import_path: actors.serve.app:build_app`` (``serve run`` / ``serve deploy``).
The graph: ``OpenAIIngress`` (HTTP) -> one ``StrategyServer`` deployment per
strategy (``strategy-<name>``) -> its engine; every strategy replica also pushes
its step rows to one ``StepLogStore``.

Strategies are skipped, with a logged warning, when the proposer registry
does not list them or a model directory they name is missing (no
``model.safetensors`` / ``config.json``), so the same YAML serves whatever
models have been trained so far. Relative model paths resolve against the
repository root.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from configs.serve_config import DEFAULT_ENGINE_FACTORY, ServeAppConfig, StrategyEntry

logger = logging.getLogger(__name__)   # ray.serve's logger does not propagate

from configs.paths import REPO_ROOT

MODEL_FILES = ("model.safetensors", "config.json", "pytorch_model.bin")
_PATH_KEYS = ("model", "draft_model")


def _resolve(path: str) -> str:
    p = Path(path)
    return str(p if p.is_absolute() else (REPO_ROOT / p))


def _model_paths(engine: dict) -> dict[str, str]:
    """Engine fields that name model directories (incl. strategy_options *_model/*_path)."""
    out = {k: engine[k] for k in _PATH_KEYS if isinstance(engine.get(k), str)}
    for k, v in (engine.get("strategy_options") or {}).items():
        if isinstance(v, str) and (k.endswith("model") or k.endswith("_path")
                                   or k.endswith("_dir")):
            out[f"strategy_options.{k}"] = v
    return out


def resolve_engine_config(engine: dict) -> dict:
    """Copy of ``engine`` with relative model paths made absolute (repo root)."""
    cfg = dict(engine)
    for key in _PATH_KEYS:
        if isinstance(cfg.get(key), str):
            cfg[key] = _resolve(cfg[key])
    if cfg.get("strategy_options"):
        opts = dict(cfg["strategy_options"])
        for k in _model_paths(cfg):
            if k.startswith("strategy_options."):
                name = k.split(".", 1)[1]
                opts[name] = _resolve(opts[name])
        cfg["strategy_options"] = opts
    return cfg


def missing_reason(entry: StrategyEntry, check_registry: bool = True) -> str | None:
    """Why this strategy cannot be served here (None if it can)."""
    strategy = entry.engine["strategy"]
    if check_registry:
        try:
            from actors.engine.strategies import PROPOSERS
        except ImportError as exc:
            return f"strategy table not importable ({exc})"
        if strategy not in PROPOSERS:
            return f"strategy {strategy!r} is not in the strategy table (configs.metric_names.PROPOSER_CLASSES)"
    engine = resolve_engine_config(entry.engine)
    for key, path in _model_paths(engine).items():
        p = Path(path)
        if not p.is_dir() or not any((p / f).exists() for f in MODEL_FILES):
            return f"{key} directory {path} has no model files ({' / '.join(MODEL_FILES)})"
    return None


def build_app(args: dict[str, Any]):
    """Serve application builder (``import_path: actors.serve.app:build_app``).

    args: ``ServeAppConfig`` fields (validated, unknown keys are errors).
    Raises ValueError when no strategy is left to serve.
    """
    from actors.serve.deployments import StepLogStore, StrategyServer
    from actors.serve.openai_api import OpenAIIngress

    cfg = ServeAppConfig.model_validate(args)
    real = cfg.engine_factory == DEFAULT_ENGINE_FACTORY
    ing = cfg.ingress
    # the store sits with the ingress (same custom resources), taking no CPU of its own
    front = ing.ray_actor_options.serve_options(
        num_cpus=0, num_gpus=0, resources={k: 0.001 for k in ing.ray_actor_options.resources})
    store = StepLogStore.options(
        name="step-log-store", num_replicas=1, max_ongoing_requests=1000,
        ray_actor_options=front).bind(cfg.step_log_store_capacity)
    handles: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for entry in cfg.strategies:
        reason = missing_reason(entry, check_registry=real) if cfg.skip_missing_models else None
        if reason is not None:
            logger.warning("skipping strategy %s: %s", entry.name, reason)
            skipped[entry.name] = reason
            continue
        engine = resolve_engine_config(entry.engine)
        if real:   # fail at deploy time, in the deployer's terms, not in a replica
            from pydantic import ValidationError

            from actors.engine.config import EngineConfig

            try:   # EngineConfig also validates strategy_options with the proposer's model
                EngineConfig(**engine)
            except ValidationError as exc:
                raise ValueError(f"configs: strategy {entry.name!r} engine section is "
                                 f"invalid: {exc}") from None
        opts = entry.ray_actor_options.serve_options()
        scaling: dict[str, Any] = (
            {"autoscaling_config": entry.autoscaling_config.model_dump(exclude_none=True)}
            if entry.autoscaling_config is not None
            else {"num_replicas": entry.num_replicas or 1})
        handles[entry.name] = StrategyServer.options(
            name=f"strategy-{entry.name}", max_ongoing_requests=entry.resolved_max_ongoing_requests(),
            ray_actor_options=opts, health_check_period_s=entry.health_check_period_s,
            health_check_timeout_s=entry.health_check_timeout_s, **scaling,
        ).bind(entry.name, engine, cfg.engine_factory, store, entry.step_log_capacity,
               entry.stream_interval)
    if not handles:
        raise ValueError(f"no strategy can be served; skipped: {skipped}. Train the models "
                         "(see README) or fix the model paths in configs/serve.yaml")
    max_ongoing = (ing.max_ongoing_requests if ing.max_ongoing_requests != "auto" else
                   sum(e.resolved_max_ongoing_requests() * (e.num_replicas or (
                       e.autoscaling_config.max_replicas if e.autoscaling_config else 1))
                       for e in cfg.strategies if e.name in handles))
    # The ingress relays every strategy's requests, so it must admit their sum.
    return OpenAIIngress.options(
        name="openai-ingress", num_replicas=ing.num_replicas,
        max_ongoing_requests=max(1, max_ongoing // ing.num_replicas + 1),
        ray_actor_options=ing.ray_actor_options.serve_options(),
    ).bind(handles, store, ing.retry_after_s, ing.api_key)
