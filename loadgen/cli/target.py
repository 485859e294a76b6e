"""The target of a load run: credentials, which strategies it serves and the route each
one's load takes (its own one-hop route or the ``model`` field), the local service when
no ``--target`` is given."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from configs import metric_names as M
from loadgen.run import service

ROUTE_AUTO = "auto"
ROUTE_STRATEGY, ROUTE_MODEL_FIELD = M.ROUTE_STRATEGY, M.ROUTE_MODEL_FIELD
ROUTE_DIRECT = M.ROUTE_DIRECT   # the strategy route on its replica's own listener (Serve's direct ingress)


def parse_header(text: str) -> tuple[str, str]:
    """``'K: V'`` or ``'K:V'`` -> (K, V); ValueError naming ``--header`` when malformed."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip() or any(c.isspace() for c in name.strip()):
        raise ValueError(f"--header expects 'Name: value', got {text.split(':')[0]!r}...")
    return name.strip(), value.strip()


@dataclasses.dataclass(frozen=True)
class Auth:
    """Credentials and TLS choice for every call to the target (load, model list, step log)."""

    headers: dict[str, str]
    insecure: bool = False

    def __repr__(self) -> str:  # never print credentials, even in a traceback
        return f"Auth(headers=<{len(self.headers)} redacted>, insecure={self.insecure})"


def auth_from_args(args: argparse.Namespace) -> Auth:
    """Headers from ``--header`` and ``--api-key`` / ``$OPENAI_API_KEY`` (Authorization: Bearer);
    without ``--target``, ``$SPECLOAD_API_KEY`` (the key the local service requires) as a last resort."""
    headers = dict(parse_header(h) for h in args.header or [])
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if not key and not args.target:   # the local service's own key, if it was given one
        key = os.environ.get("SPECLOAD_API_KEY")
    if key and not any(k.lower() == "authorization" for k in headers):
        headers["Authorization"] = f"Bearer {key}"
    return Auth(headers, bool(args.insecure))


def discover_strategies(args: argparse.Namespace, target: str, auth: Auth, console: Any = None) -> list[str]:
    """Strategies to drive. Without --strategies / --model they come from the target's
    ``/v1/models`` (discovery; a failure names the URL). With them, discovery is
    skipped when the target answers without a model list (a server or gateway
    without ``/v1/models``) and only used, when it has one, to catch a misspelt
    name; an unreachable target still fails here, before any cell runs."""
    asked = ([s.strip() for s in args.strategies.split(",") if s.strip()] if args.strategies
             else [args.model] if args.model else [])
    if asked:
        try:
            models = service.list_models(target, headers=auth.headers, insecure=auth.insecure)
        except service.DiscoveryUnavailable as err:   # unreachable still fails
            if console is not None:
                console.print(f"[yellow]{err.reason}; using {asked} as given[/]", highlight=False)
            return asked
    else:
        models = service.list_models(target, headers=auth.headers, insecure=auth.insecure)
    unknown = [s for s in asked if models and s not in models and not args.model]
    if args.model and models and args.model not in models:
        unknown = [args.model]
    if unknown:
        flag = "--model" if args.model else "--strategies"
        raise service.ServiceError(f"{flag}: {', '.join(map(repr, unknown))} not served by "
                                   f"{target}; it serves {models}")
    if asked:
        return asked
    if not models:
        raise service.ServiceError(f"{target}/v1/models lists no models; pass --strategies")
    return canonical_order(models)


def canonical_order(names: list[str]) -> list[str]:
    """Served names in the canonical strategy order (``metric_names.STRATEGIES``, the
    baseline first), any other name after them in its given order."""
    known = [s for s in M.STRATEGIES if s in names]
    return known + [m for m in names if m not in known]


def choose_routes(route: str, strategies: list[str], routes: dict[str, str],
                  model_override: str = "",
                  direct: dict[str, list[str]] | None = None) -> dict[str, str | None]:
    """Strategy -> path of the one-hop route its load takes (relative to the target; on the
    direct route an absolute URL: the replica's own listener + that path), or None for the
    model-field route. ``route``: the ``--route`` value; ``routes``: what the target lists
    (``service.strategy_routes``), ``direct``: its replicas' own listeners
    (``service.direct_listeners``).

    ``auto`` (the default) takes, per strategy, the direct route when the strategy has
    its one-hop route and exactly one replica listener (Ray Serve's direct ingress, on in
    ``cluster up`` by default), else its one-hop route through the Serve proxy, else the
    model field. A strategy with several replicas keeps the proxy's route: Serve's router
    spreads a strategy's load over its replicas only there. A ``--model`` override always
    takes the model-field route (its name need not be a strategy's). Raises ServiceError
    naming ``--route`` when ``strategy`` or ``direct`` is asked for and a strategy has no
    such route, or (``direct``) not exactly one listener."""
    if model_override and route in (ROUTE_DIRECT, ROUTE_STRATEGY):
        raise service.ServiceError(
            f"--route {route} and --model do not combine: a --model override names the model "
            "on the model-field route (<target>/v1/...); drop --model or use --route auto")
    if route == ROUTE_DIRECT:
        direct = direct or {}
        bad = {s: direct.get(s, []) for s in strategies
               if s not in routes or len(direct.get(s, [])) != 1}
        if bad:
            raise service.ServiceError(
                f"--route direct: each strategy needs its one-hop route and one replica "
                f"listener (GET /specload/routes direct: {direct or 'none'}; not so for "
                f"{sorted(bad)}); start the "
                "service with `python -m cluster up` (direct ingress on), one replica per "
                "strategy and no autoscaling_config, or use --route strategy")
        return {s: direct[s][0] + routes[s] for s in strategies}
    if route == ROUTE_STRATEGY:
        missing = [s for s in strategies if s not in routes]
        if missing:
            raise service.ServiceError(
                f"--route strategy: the target lists no one-hop route for {missing} "
                f"(GET /specload/routes: {routes or 'none'}); "
                "use --route auto or model-field")
    if route == ROUTE_MODEL_FIELD or model_override:
        return {s: None for s in strategies}
    if route == ROUTE_AUTO:   # a strategy's one replica listener, else its proxy route, else the model field
        direct = direct or {}
        return {s: direct[s][0] + routes[s] if s in routes and len(direct.get(s, [])) == 1
                else routes.get(s) for s in strategies}
    return {s: routes.get(s) for s in strategies}


def route_name(prefix: str | None) -> str:
    """The ``--route`` kind of one ``choose_routes`` value."""
    if not prefix:
        return ROUTE_MODEL_FIELD
    return ROUTE_DIRECT if prefix.startswith(("http://", "https://")) else ROUTE_STRATEGY


def route_names(prefixes: dict[str, str | None]) -> str:
    return ", ".join(sorted({route_name(p) for p in prefixes.values()}))


def route_url(target: str, path: str | None) -> str:
    """Base URL of a strategy's load: ``target`` + its one-hop route path, the replica
    listener's URL itself (``--route direct``), or ``target``."""
    if path and path.startswith(("http://", "https://")):
        return path
    return target + path if path else target


def connect(args: argparse.Namespace, console: Any, local: dict[str, Any]) -> tuple[str, list[str], Auth]:
    """The target's base URL (starting or reusing the local service without --target) and
    the strategies to run; raises service.ServiceError."""
    auth = auth_from_args(args)
    if args.target:   # with or without /v1, with or without a trailing slash
        target = service.normalize_base_url(args.target)
    else:
        console.print("starting or reusing the local service (python -m cluster up) ...", highlight=False)
        target = service.start_local_service(
            port=args.local_port, config=args.local_config or None,
            direct_ingress=args.route in (ROUTE_AUTO, ROUTE_DIRECT),
            on_line=lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True))
        local["url"] = target
    try:
        strategies = discover_strategies(args, target, auth, console)
    except service.ServiceError as err:
        if args.target or not any(f"HTTP {c}" in str(err) for c in (401, 403)):
            raise
        raise service.ServiceError(   # the local service reads its key from SPECLOAD_API_KEY
            f"{err}; the local service requires the key it was started with: "
            "export SPECLOAD_API_KEY=KEY (what `cluster up` read) or pass --api-key KEY") from None
    if args.sweep and M.AUTOREGRESSIVE not in strategies:
        strategies = [M.AUTOREGRESSIVE] + strategies   # the sweep's speedup reference
    return target, strategies, auth


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What the target told about itself (``discover``): its base URL, the
    strategies to drive (served names, baseline first) and their routes. ``prefixes`` /
    ``fallbacks`` are ``loadgen.cli.target.choose_routes`` values as pairs."""

    target: str
    strategies: tuple[str, ...]
    prefixes: tuple[tuple[str, str | None], ...] = ()
    fallbacks: tuple[tuple[str, str], ...] = ()
    resolved: bool = True   # False: --dry-run without --target (no service started)


def local_discovery(args: argparse.Namespace) -> Discovery:
    """The local service's strategies as ``connect`` would find them, without starting it:
    ``--strategies`` (variants resolved), else every deployment of the Serve config in the
    canonical order; routes unresolved."""
    from configs.serve_config import configured_strategy_names

    asked = [s.strip() for s in args.strategies.split(",") if s.strip()]
    names = asked or canonical_order(configured_strategy_names(args.local_config or None))
    if args.sweep and M.AUTOREGRESSIVE not in names:
        names = [M.AUTOREGRESSIVE] + names
    return Discovery(f"http://127.0.0.1:{args.local_port}", tuple(names), resolved=False)


def discover(args: argparse.Namespace, console: Any, local: dict[str, Any]) -> tuple[Discovery, Auth]:
    """Connect (``loadgen.cli.target.connect``: the local service started or reused without
    ``--target``), list the strategies, choose each one's route (``choose_routes``) and
    check that the replica listeners answer from here (those that do not take the proxy's
    route, or fail under ``--route direct``). Raises service.ServiceError."""
    target, strategies, auth = connect(args, console, local)
    routes = ({} if args.route == ROUTE_MODEL_FIELD else
              service.strategy_routes(target, headers=auth.headers, insecure=auth.insecure))
    direct = (service.direct_listeners(target, headers=auth.headers, insecure=auth.insecure)
              if args.route == ROUTE_DIRECT or (args.route == ROUTE_AUTO and routes
                                                and not args.model) else None)
    prefixes = choose_routes(args.route, strategies, routes, args.model, direct)
    dead = [s for s, p in prefixes.items() if not reachable(p, auth)]
    if dead and args.route == ROUTE_DIRECT:
        raise service.ServiceError(
            f"--route direct: the replica listener of {dead} does not answer from here "
            f"({', '.join(prefixes[s] + '/health' for s in dead)}); use --route strategy")
    if dead:
        console.print(f"the replica listeners of {dead} do not answer from here: their load "
                      "takes the Serve proxy's route", highlight=False)
        prefixes.update({s: routes[s] for s in dead})
    fallbacks = {s: routes[s] for s, p in prefixes.items() if route_name(p) == ROUTE_DIRECT}
    return Discovery(target, tuple(strategies), tuple(prefixes.items()), tuple(fallbacks.items())), auth


def target_hint(args: argparse.Namespace, err: Exception, variants: dict) -> str:
    """The clause after a target error: how to get past a reused local service."""
    if variants and "not served" in str(err):
        return ("; --k/--top-k-candidates: the variants are not deployed there" +
                ("" if args.target else " (a running local service was reused: stop it with "
                 "`python -m cluster down` or pick another --local-port)"))
    if args.route == ROUTE_DIRECT and not args.target and "--route direct" in str(err):
        return ("; a running local service was reused: stop it with `python -m cluster down` "
                "or pick another --local-port")
    return ""


def reachable(prefix: str | None, auth: Auth) -> bool:
    """A route prefix the load can take from here: any but a replica listener that does not
    answer ``/health`` (one on another node's loopback, or behind a firewall)."""
    return route_name(prefix) != ROUTE_DIRECT or service.answers(
        f"{prefix}/health", headers=auth.headers, insecure=auth.insecure)
