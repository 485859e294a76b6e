"""Build the specload Serve application(s) from ``configs/serve.yaml`` args.

``import_path: actors.serve.app:build_app`` (``serve run`` / ``serve deploy``).
The graph: ``OpenAIIngress`` (HTTP, ``model`` field) -> one ``StrategyServer``
deployment per strategy (``strategy-<name>``) -> its engine; every strategy
replica also pushes its step rows to one ``StepLogStore``.

One-hop layout (``split_application``; ``python -m cluster up`` deploys it):
each strategy is its own Serve application (``<app>-strategy-<name>``) whose
ingress is its ``StrategyServer``, at ``<route_prefix>/strategies/<name>``, so
the HTTP proxy streams from the strategy replica with no second Ray hop per
chunk; the ``build_app`` application keeps the ingress (``/v1/...`` with the
``model`` field, reaching the same replicas by application) and the step-log
store. ``serve run configs/serve.yaml`` as written is the one-application
layout: the model-field routes only.

Strategies are skipped, with a logged warning, when the proposer registry
does not list them or a model directory they name is missing (no
``model.safetensors`` / ``config.json``), so the same YAML serves whatever
models have been trained so far. Relative model paths resolve against the
repository root.
"""

from __future__ import annotations

import logging
import os
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


def _registry() -> dict:
    try:
        from actors.engine.strategies import PROPOSERS
    except ImportError:
        return {}
    return PROPOSERS


def missing_reason(entry: StrategyEntry, check_registry: bool = True) -> str | None:
    """Why this strategy cannot be served here (None if it can)."""
    strategy = entry.engine["strategy"]
    if entry.engine.get("backend") == "vllm":
        from actors.engine.vllm_backend import default_vllm_python

        python = entry.engine.get("vllm_python") or default_vllm_python()
        if not (Path(python).is_file() and os.access(python, os.X_OK)):
            return (f"backend vllm: its python {python} does not exist (the vLLM venv: "
                    "engine.vllm_python, $SPECLOAD_VLLM_PYTHON or <repo>/.venv-vllm; "
                    "docs/serving.md)")
        if entry.engine.get("speculative_config") and strategy not in _registry():
            check_registry = False    # a vLLM-only method (eagle3, mtp, ...): its label
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


STRATEGY_DEPLOYMENT = "strategy-{}"     # a strategy's StrategyServer deployment
STORE_DEPLOYMENT = "step-log-store"
APP_IMPORT_PATH = "actors.serve.app:build_app"
STRATEGY_APP_IMPORT_PATH = "actors.serve.app:build_strategy_app"


def strategy_app_name(app_name: str, strategy: str) -> str:
    """Serve application name of ``strategy`` split out of application ``app_name``."""
    return f"{app_name}-{STRATEGY_DEPLOYMENT.format(strategy)}"


def strategy_route(strategy: str) -> str:
    """A strategy's one-hop route relative to the ingress: ``/strategies/<name>``."""
    from actors.serve.openai_api import STRATEGY_ROUTES

    return f"{STRATEGY_ROUTES}/{strategy}"


def _bind_strategy(entry: StrategyEntry, cfg: ServeAppConfig, store: Any):
    """The bound StrategyServer deployment of ``entry`` (engine config validated here,
    in the deployer's terms, not in a replica). Raises ValueError naming the strategy."""
    from actors.serve.deployments import StrategyServer

    engine = resolve_engine_config(entry.engine)
    if cfg.engine_factory == DEFAULT_ENGINE_FACTORY:
        from pydantic import ValidationError

        from actors.engine.config import EngineConfig

        try:   # EngineConfig also validates strategy_options with the proposer's model
            ec = EngineConfig(**engine)
        except ValidationError as exc:
            raise ValueError(f"configs: strategy {entry.name!r} engine section is "
                             f"invalid: {exc}") from None
        if ec.backend == "vllm":   # engine_kwargs against vLLM's EngineArgs, in its venv
            from actors.engine.vllm_backend import check_engine_kwargs

            try:
                check_engine_kwargs(ec.engine_kwargs, ec.resolved_vllm_python())
            except ValueError as exc:
                raise ValueError(f"configs: strategy {entry.name!r} engine section is "
                                 f"invalid: {exc}") from None
    scaling: dict[str, Any] = (
        {"autoscaling_config": entry.autoscaling_config.model_dump(exclude_none=True)}
        if entry.autoscaling_config is not None
        else {"num_replicas": entry.num_replicas or 1})
    return StrategyServer.options(
        name=STRATEGY_DEPLOYMENT.format(entry.name),
        max_ongoing_requests=entry.resolved_max_ongoing_requests(),
        ray_actor_options=entry.ray_actor_options.serve_options(),
        health_check_period_s=entry.health_check_period_s,
        health_check_timeout_s=entry.health_check_timeout_s, **scaling,
    ).bind(entry.name, engine, cfg.engine_factory, store, entry.step_log_capacity,
           entry.stream_interval, cfg.ingress.retry_after_s, cfg.ingress.api_key,
           entry.engine_process, entry.stream_interval_ms)


def build_strategy_app(args: dict[str, Any]):
    """One strategy as its own Serve application (``import_path:
    actors.serve.app:build_strategy_app``; ``split_application`` writes the entry):
    its StrategyServer is the application's ingress and answers the OpenAI routes
    itself. args: ``{"app": ServeAppConfig fields, "strategy": name, "store_app":
    application holding the step-log store, or None}``. Raises ValueError for a
    strategy the app args do not list, or an invalid engine section.
    """
    cfg = ServeAppConfig.model_validate(args["app"])
    entry = next((e for e in cfg.strategies if e.name == args["strategy"]), None)
    if entry is None:
        raise ValueError(f"strategy {args['strategy']!r} is not in the app's strategies "
                         f"{[e.name for e in cfg.strategies]}")
    store = (args["store_app"], STORE_DEPLOYMENT) if args.get("store_app") else None
    return _bind_strategy(entry, cfg, store)


def split_application(app: dict[str, Any]) -> list[dict[str, Any]]:
    """The one-hop layout of one ``build_app`` entry of a Serve config's ``applications``.

    Returns Serve config application entries: one ``build_strategy_app`` application per
    servable strategy (name ``strategy_app_name``, route ``<route_prefix>/strategies/
    <name>``, the entry's runtime_env) and, last, the entry itself with ``strategy_apps``
    set (its ingress reaches them by application). Strategies ``build_app`` would skip
    are left out (it skips them, with its warning). Raises ValueError (pydantic's) on
    invalid args.
    """
    args = dict(app.get("args") or {})
    cfg = ServeAppConfig.model_validate(args)
    real = cfg.engine_factory == DEFAULT_ENGINE_FACTORY
    name = app.get("name", "default")
    prefix = (app.get("route_prefix") or "/").rstrip("/")
    out, apps = [], {}
    for entry in cfg.strategies:
        if cfg.skip_missing_models and missing_reason(entry, check_registry=real):
            continue
        apps[entry.name] = strategy_app_name(name, entry.name)
        sub = {"name": apps[entry.name], "route_prefix": prefix + strategy_route(entry.name),
               "import_path": STRATEGY_APP_IMPORT_PATH,
               "args": {"app": args, "strategy": entry.name, "store_app": name}}
        if app.get("runtime_env"):
            sub["runtime_env"] = app["runtime_env"]
        out.append(sub)
    return out + [dict(app, args=dict(args, strategy_apps=apps))]


def run_applications(args: dict[str, Any], name: str = "specload", route_prefix: str = "/",
                     one_hop: bool = True) -> None:
    """``serve.run`` the application of ``args`` (``ServeAppConfig`` fields) from Python
    (tests, ``bench.serving_overhead``), in the one-hop layout (``split_application``)
    or as one application; returns when every application is running. Raises what
    ``build_app`` / Serve raise."""
    from ray import serve

    entry = {"name": name, "route_prefix": route_prefix, "import_path": APP_IMPORT_PATH,
             "args": args}
    entries = split_application(entry) if one_hop else [entry]
    builders = {APP_IMPORT_PATH: build_app, STRATEGY_APP_IMPORT_PATH: build_strategy_app}
    serve.run_many([serve.RunTarget(builders[e["import_path"]](e["args"]), name=e["name"],
                                    route_prefix=e["route_prefix"]) for e in entries])


def build_app(args: dict[str, Any]):
    """Serve application builder (``import_path: actors.serve.app:build_app``).

    args: ``ServeAppConfig`` fields (validated, unknown keys are errors). Strategies
    named in ``strategy_apps`` (``split_application``) are not part of this application:
    its ingress reaches them by application and lists their one-hop routes. Raises
    ValueError when no strategy is left to serve, or naming a strategy whose engine
    section is invalid.
    """
    from actors.serve.deployments import StepLogStore
    from actors.serve.openai_api import OpenAIIngress

    cfg = ServeAppConfig.model_validate(args)
    real = cfg.engine_factory == DEFAULT_ENGINE_FACTORY
    ing = cfg.ingress
    # the store sits with the ingress (same custom resources), taking no CPU of its own
    front = ing.ray_actor_options.serve_options(
        num_cpus=0, num_gpus=0, resources={k: 0.001 for k in ing.ray_actor_options.resources})
    store = StepLogStore.options(
        name=STORE_DEPLOYMENT, num_replicas=1, max_ongoing_requests=1000,
        ray_actor_options=front).bind(cfg.step_log_store_capacity)
    handles: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for entry in cfg.strategies:
        reason = missing_reason(entry, check_registry=real) if cfg.skip_missing_models else None
        if reason is not None:
            logger.warning("skipping strategy %s: %s", entry.name, reason)
            skipped[entry.name] = reason
            continue
        if entry.name in cfg.strategy_apps:   # its own application (one-hop layout)
            handles[entry.name] = (cfg.strategy_apps[entry.name],
                                   STRATEGY_DEPLOYMENT.format(entry.name))
        else:
            handles[entry.name] = _bind_strategy(entry, cfg, store)
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
    ).bind(handles, store, ing.retry_after_s, ing.api_key,
           {n: strategy_route(n) for n in cfg.strategy_apps if n in handles},
           sorted(e.name for e in cfg.strategies if e.name in handles and e.autoscaling_config))
