"""Check a Serve config the way the deployment will, before anything starts.

Used by ``python -m cluster up`` (``cluster.local.load_config``) and by the load generator's
``--local-config`` check (through ``loadgen.run.service``), so a typo in a strategy's engine
section fails in the command that was given the file, not inside a Ray replica.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def _first_error(err: Any) -> str:
    """``loc: msg`` of a pydantic ValidationError's first error (and how many more)."""
    errors = err.errors()
    if not errors:
        return str(err)
    e = errors[0]
    loc = ".".join(str(x) for x in e.get("loc", ())) or "<root>"
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    # a nested ValidationError (strategy_options) arrives as multi-line text: keep one line
    lines = [ln.strip() for ln in str(e.get("msg")).splitlines()
             if ln.strip() and not ln.strip().startswith("For further information")]
    msg = re.sub(r"\s*\[type=[^\]]*\]", "", " ".join(lines))
    return f"{loc}: {msg}{more}"


def check_serve_config(path: str | Any) -> dict:
    """Read and validate a Serve config the way the deployment will, before anything starts.

    Checks: the file is readable YAML with ``applications``; every
    ``actors.serve.app:build_app`` application's ``args`` against
    ``configs.serve_config.ServeAppConfig``; and, with the real engine factory, every
    strategy's ``engine`` section against ``actors.engine.config.EngineConfig`` (which
    also validates ``strategy_options`` against the strategy's own options model).
    Returns the parsed config (a dict). Raises ValueError naming the file, the
    application / strategy and the first pydantic error.
    """
    import yaml
    from pydantic import ValidationError

    from actors.engine.config import EngineConfig
    from actors.serve.app import APP_IMPORT_PATH, resolve_engine_config
    from configs.serve_config import DEFAULT_ENGINE_FACTORY, ServeAppConfig

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p} is a directory, not a Serve config file")
    try:
        cfg = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ValueError(f"cannot read {p}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{p} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("applications"), list):
        raise ValueError(f"{p}: expected a Serve config with an 'applications' list, got "
                         f"{type(cfg).__name__}")
    for i, app in enumerate(cfg["applications"]):
        if not isinstance(app, dict):
            raise ValueError(f"{p}: applications[{i}] is not a mapping")
        if app.get("import_path") != APP_IMPORT_PATH:
            continue
        where = f"{p}: application {app.get('name', i)!r}"
        try:
            args = ServeAppConfig.model_validate(app.get("args") or {})
        except ValidationError as err:
            raise ValueError(f"{where}: args.{_first_error(err)}") from None
        if args.engine_factory != DEFAULT_ENGINE_FACTORY:
            continue
        for entry in args.strategies:
            try:
                EngineConfig(**resolve_engine_config(entry.engine))
            except ValidationError as err:
                raise ValueError(f"{where}: strategy {entry.name!r} engine.{_first_error(err)}") from None
    return cfg
