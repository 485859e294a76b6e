"""Local bring-up: ``python -m cluster up`` / ``python -m cluster down``.

``up``:
1. If a specload service already answers on ``http://127.0.0.1:PORT/health``
   it is reused (nothing started, nothing recorded).
2. Otherwise it connects to a Ray cluster given by ``--address`` /
   ``RAY_ADDRESS`` (its dashboard from ``--dashboard`` / ``RAY_DASHBOARD_ADDRESS``),
   or starts its own head: ``ray start --head --block`` as a child process in a
   new session, every listener of it on 127.0.0.1 and every Ray port picked free
   there (``configs.net.loopback_head``; docs/network.md lists them; no collision
   with another Ray on the box), ``PYTHONPATH`` including the repo so replicas
   import ``actors`` (and the gRPC bind preload ``cluster.grpc_bind_preload``)
   without an install, and the Serve proxy's environment
   (``configs.serve_config.PROXY_ENV``: gRPC from the proxy to the replicas).
3. Deploys ``configs/serve.yaml`` (HTTP port overridden by ``--port``) through
   the dashboard's Serve REST API, like ``serve deploy``, in the one-hop layout
   (``one_hop_config``): each strategy its own application at
   ``/strategies/<name>`` whose replica answers HTTP itself, and the ingress
   at ``/`` with the ``model``-field routes, reaching the same replicas.
4. Waits until every servable strategy answers a 1-token completion on both
   routes, records
   what it started in a state file and prints the base URL as its last stdout
   line.

State files live in ``$XDG_RUNTIME_DIR/specload`` (or the temp dir,
``specload-<uid>``), one per HTTP port: ``cluster-<port>.json``. ``down``
deletes the Serve applications and, if ``up`` started the Ray head, sends it
SIGTERM (Ray's own handler stops every process of that head), removes Ray's
current-cluster file when it still names that head (``ray status`` would
otherwise wait for it), then removes the state file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from configs.jsonio import write_json
from configs.net import (RAY_WORKER_PRIORITY_ENV, checkout_first, free_ports, listener_on,  # noqa: F401  (free_ports: tests)
                         loopback_head, port_in_use)
from configs.paths import CONFIGS_DIR
from configs.serve_config import DIRECT_INGRESS_ENV, PROXY_ENV

DEFAULT_CONFIG = CONFIGS_DIR / "serve.yaml"
DEFAULT_PORT = 8000
HOST = "127.0.0.1"


def log(msg: str) -> None:
    """Progress goes to stderr so the base URL stays the last line of stdout."""
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


def state_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(base) / "specload" if base else Path(tempfile.gettempdir()) / f"specload-{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def state_file(port: int) -> Path:
    return state_dir() / f"cluster-{port}.json"


def _get(url: str, timeout_s: float = 3.0):
    import httpx

    return httpx.get(url, timeout=timeout_s)


def service_health(base_url: str) -> dict | None:
    """The /health body if a specload service answers there, else None."""
    try:
        r = _get(base_url + "/health")
        body = r.json()
        return body if r.status_code == 200 and "strategies" in body else None
    except Exception:
        return None


class ConfigError(ValueError):
    """The Serve config (``--config``) cannot be read or does not validate."""


class PortInUse(RuntimeError):
    """The HTTP port (``--port``) is taken by a server that is not a specload service."""


def load_config(path: Path, port: int) -> dict:
    """The Serve deploy config with ``http_options`` pointed at 127.0.0.1:port.

    The whole config is validated first, as the deployment would (the application
    args and every strategy's engine section, ``strategy_options`` included:
    ``cluster.config_check.check_serve_config``), so a typo fails here, before Ray starts.
    Raises ConfigError naming the file and the first error."""
    from cluster.config_check import check_serve_config

    try:
        cfg = check_serve_config(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    http = dict(cfg.get("http_options") or {})
    http.setdefault("host", HOST)
    http["port"] = port
    cfg["http_options"] = http
    return cfg


def expected_strategies(cfg: dict) -> list[str]:
    """Strategies the app will serve (same skip rules as ``build_app``)."""
    from actors.serve.app import missing_reason
    from configs.serve_config import DEFAULT_ENGINE_FACTORY, ServeAppConfig

    names = []
    for app in cfg["applications"]:
        if app.get("import_path") != "actors.serve.app:build_app":
            continue
        args = ServeAppConfig.model_validate(app.get("args") or {})
        real = args.engine_factory == DEFAULT_ENGINE_FACTORY
        for e in args.strategies:
            reason = missing_reason(e, check_registry=real) if args.skip_missing_models else None
            if reason:
                log(f"strategy {e.name} will be skipped: {reason}")
            else:
                names.append(e.name)
    return names


def one_hop_config(cfg: dict) -> dict:
    """``cfg`` with every ``build_app`` application split into one application per
    strategy plus the model-field ingress (``actors.serve.app.split_application``)."""
    from actors.serve.app import APP_IMPORT_PATH, split_application

    apps: list[dict] = []
    for app in cfg["applications"]:
        apps.extend(split_application(app) if app.get("import_path") == APP_IMPORT_PATH else [app])
    return dict(cfg, applications=apps)


def start_head(num_cpus: int | None, direct_ingress: bool = False) -> dict:
    """Start ``ray start --head --block`` in its own session; return its facts.
    ``direct_ingress``: with Ray Serve's direct ingress (``DIRECT_INGRESS_ENV``: each
    strategy replica also answers HTTP on a port of its own, on the HTTP options' host).

    Every listener of the head binds 127.0.0.1 (``configs.net.loopback_head``: the flags and
    environment, in one place; ``tests/test_loopback.py`` audits it). The environment set
    here wins over the caller's for those variables: a loopback head whose node address
    came out as the host's own would listen on it."""
    head = loopback_head()
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
           "--include-dashboard", "true", "--disable-usage-stats", *head.flags]
    if num_cpus is not None:
        cmd += ["--num-cpus", str(num_cpus)]
    env = {**PROXY_ENV, **RAY_WORKER_PRIORITY_ENV, **os.environ, **head.env}   # unless set already
    if direct_ingress:   # Serve's controller and replicas read it from the head's environment
        env.update(DIRECT_INGRESS_ENV)
    env["PYTHONPATH"] = checkout_first(env.get("PYTHONPATH"))
    logf = state_dir() / f"ray-head-{head.ports['port']}.log"
    log(f"starting a Ray head (gcs {head.gcs_address}, dashboard {head.dashboard_url}, every "
        f"listener on {HOST}); log: {logf}")
    with open(logf, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return {"ray_pid": proc.pid, "address": head.gcs_address, "dashboard": head.dashboard_url,
            "metrics_export_port": head.ports["metrics-export-port"], "log": str(logf)}


def use_ray_auth_token() -> None:
    """Talk to the dashboard with Ray's auth token when one exists (~/.ray/auth_token).

    Ray >= 2.5x enables token auth for a new head whenever a token file exists;
    this process must then send it too. Same rule Ray's own CLI applies
    (RAY_AUTH_MODE, when set, wins)."""
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:   # older Ray: no token auth
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _dashboard_up(dashboard: str) -> bool:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    try:
        ServeSubmissionClient(dashboard).get_serve_details()
        return True
    except Exception:
        return False


def wait_dashboard(dashboard: str, pid: int | None, timeout_s: float) -> None:
    use_ray_auth_token()
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pid is not None and not _alive(pid):
            raise SystemExit("the Ray head exited during start-up; see its log above")
        if _dashboard_up(dashboard):
            return
        time.sleep(1)
    raise SystemExit(f"Ray dashboard {dashboard} did not come up within {timeout_s:.0f}s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie child counts as dead
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def deploy(dashboard: str, cfg: dict, retries_s: float = 60) -> None:
    """``serve deploy`` through the dashboard REST API (retried while it warms up)."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
    from ray.serve.schema import ServeDeploySchema

    body = ServeDeploySchema.model_validate(cfg).model_dump(exclude_unset=True)
    t0 = time.monotonic()
    while True:
        try:
            ServeSubmissionClient(dashboard).deploy_applications(body)
            return
        except Exception as exc:
            if time.monotonic() - t0 > retries_s:
                raise SystemExit(f"serve deploy to {dashboard} failed: {exc}") from exc
            time.sleep(2)


def app_errors(dashboard: str) -> str | None:
    """A DEPLOY_FAILED application's message, if any."""
    try:
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        details = ServeSubmissionClient(dashboard).get_serve_details()
    except Exception:
        return None
    for name, app in (details.get("applications") or {}).items():
        if app.get("status") == "DEPLOY_FAILED":
            return f"application {name}: {app.get('message')}"
    return None


def replica_resources(cfg: dict) -> dict[str, dict[str, float]]:
    """What one replica of each deployment asks of a node: {deployment: {resource: amount}}
    (Ray's names: CPU, GPU, memory, custom), from every ``build_app`` application's
    strategies and ingress, and any other application's ``deployments``."""
    from configs.serve_config import ServeAppConfig

    def need(opts: dict, default_cpus: float) -> dict[str, float]:
        out = {"CPU": float(opts.get("num_cpus", default_cpus) or 0.0),
               "GPU": float(opts.get("num_gpus", 0.0) or 0.0),
               "memory": float(opts.get("memory") or 0.0),
               **{k: float(v) for k, v in (opts.get("resources") or {}).items()}}
        return {k: v for k, v in out.items() if v > 0}

    out: dict[str, dict[str, float]] = {}
    for app in cfg.get("applications") or []:
        if app.get("import_path") == "actors.serve.app:build_app":
            args = ServeAppConfig.model_validate(app.get("args") or {})
            for e in args.strategies:
                out[f"strategy-{e.name}"] = need(e.ray_actor_options.serve_options(), 0.3)
            out["ingress"] = need(args.ingress.ray_actor_options.serve_options(), 0.1)
        for d in app.get("deployments") or []:
            if d.get("ray_actor_options"):
                out[f"{app.get('name', 'app')}/{d.get('name')}"] = need(d["ray_actor_options"], 1.0)
    return out


def unschedulable(needs: dict[str, dict[str, float]], nodes: list[dict[str, float]]) -> str | None:
    """Why some deployment can never be placed: no alive node's total resources hold what
    one of its replicas asks (None: every deployment fits some node). ``nodes``: each
    alive node's ``resources_total``."""
    lines = []
    for name, need in needs.items():
        if any(all(node.get(r, 0.0) >= v for r, v in need.items()) for node in nodes):
            continue
        missing = sorted({r for r, v in need.items()
                          if not any(node.get(r, 0.0) >= v for node in nodes)})
        flags = {"GPU": "num_gpus", "CPU": "num_cpus", "memory": "memory"}
        what = ", ".join(f"{flags.get(r, 'resources.' + r)}: {need[r]:g} ({r}: most on a node "
                         f"{max((n.get(r, 0.0) for n in nodes), default=0.0):g})"
                         for r in missing) or f"{need} together on one node"
        lines.append(f"deployment {name} asks {what} per replica")
    if not lines:
        return None
    have = "; ".join(", ".join(f"{k} {v:g}" for k, v in sorted(n.items())
                               if k in ("CPU", "GPU") or not k.startswith(("node:", "memory",
                                                                           "object_store")))
                     for n in nodes)
    return ("no node of this Ray cluster has the resources: " + "; ".join(lines)
            + f". Nodes: [{have}]. Change ray_actor_options in the config (num_gpus: 0 on a "
            "CPU-only cluster) or add a node that has them")


def cluster_nodes(dashboard: str) -> list[dict[str, float]] | None:
    """Each alive node's total resources (Ray's state API through the dashboard); None
    when the API does not answer (the check is then left to Serve)."""
    try:
        from ray.util.state import list_nodes

        nodes = list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")], detail=True,
                           timeout=30)
    except Exception as exc:  # noqa: BLE001 - a cluster without the state API: skip the check
        log(f"could not list the cluster's nodes ({exc!r}); not checking resources")
        return None
    return [dict(getattr(n, "resources_total", None) or {}) for n in nodes]


def has_autoscaler(dashboard: str) -> bool:
    """Whether the cluster has an autoscaler with node types (it may add the node a
    replica needs): the dashboard's autoscaling status lists them under "Worker node
    types:" (a ``ray up`` cluster); a plain ``ray start --head`` lists none. Unreadable:
    assume one (the check then only warns)."""
    import httpx

    try:
        headers: dict = {}
        try:   # a head with token auth (Ray >= 2.5x) refuses the dashboard without it
            from ray._private.authentication.http_token_authentication import (
                get_auth_headers_if_auth_enabled)
            headers = get_auth_headers_if_auth_enabled({}) or {}
        except ImportError:
            pass
        r = httpx.get(dashboard.rstrip("/") + "/api/cluster_status", timeout=10, headers=headers)
        r.raise_for_status()
        status = str((r.json().get("data") or {}).get("autoscalingStatus") or "")
    except Exception:  # noqa: BLE001 - unknown: assume one may exist (warn, never block)
        return True
    types = status.split("Worker node types:", 1)
    return len(types) == 2 and any(line.strip().startswith("- ")
                                   for line in types[1].splitlines())


def check_resources(dashboard: str, cfg: dict, may_autoscale: bool = False) -> None:
    """Fail at once (SystemExit naming the resource) when a deployment asks for what no
    node has: Serve would wait for it forever ("ready 1/2"). Nodes join a starting head a
    moment after its dashboard: an empty list is polled for up to 30 s. ``may_autoscale``
    (an existing cluster with an autoscaler, e.g. ``ray up cluster/cluster.yaml`` whose GPU
    workers start at 0): only a warning, the autoscaler may add such a node."""
    needs = replica_resources(cfg)
    t0 = time.monotonic()
    while True:
        nodes = cluster_nodes(dashboard)
        if nodes is None:
            return
        if nodes or time.monotonic() - t0 > 30:
            break
        time.sleep(1)
    why = unschedulable(needs, nodes)
    if why and may_autoscale:
        log(f"warning: {why}; this cluster has an autoscaler, which may add such a node "
            "(otherwise the deployment waits until --timeout)")
    elif why:
        raise SystemExit(f"cannot deploy: {why}")


def ingress_api_key(cfg: dict) -> str | None:
    """The key the ingress will require: ``ingress.api_key`` of the config, else
    ``$SPECLOAD_API_KEY`` (the Ray head started here passes its environment on)."""
    for app in cfg.get("applications") or []:
        key = ((app.get("args") or {}).get("ingress") or {}).get("api_key")
        if key:
            return str(key)
    return os.environ.get("SPECLOAD_API_KEY") or None


def wait_ready(base_url: str, strategies: list[str], dashboard: str | None,
               timeout_s: float, api_key: str | None = None) -> None:
    """Until every strategy answers a 1-token greedy completion on its model-field route
    and on its own route (when ``GET /specload/routes`` lists one)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    routes: dict | None = None

    pending = list(strategies)
    t0 = time.monotonic()
    last = ""
    log(f"waiting for {len(pending)} deployments to answer (loading models; about 10-60 s each on a CPU)")
    while pending:
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"not ready after {timeout_s:.0f}s: {pending} ({last})")
        if dashboard and (err := app_errors(dashboard)):
            raise SystemExit(f"deploy failed: {err}")
        for name in list(pending):
            try:
                if routes is None:
                    routes = httpx.get(base_url + "/specload/routes", timeout=30,
                                       headers=headers).json()["routes"]
                for prefix in ("", routes.get(name) or ""):
                    r = httpx.post(base_url + prefix + "/v1/completions", timeout=30,
                                   headers=headers, json={"model": name, "prompt": "Hello",
                                                          "max_tokens": 1, "temperature": 0})
                    if r.status_code != 200:
                        break
                if r.status_code == 200:
                    pending.remove(name)
                    log(f"deployment strategy-{name} ready ({len(strategies) - len(pending)}/"
                        f"{len(strategies)}, {time.monotonic() - t0:.0f} s)")
                else:
                    last = f"{name}: HTTP {r.status_code} {r.text[:200]}"
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                last = f"{name}: {exc!r}"
        if pending:
            time.sleep(1)


def _reuse(base_url: str, health: dict, direct_ingress: bool) -> None:
    """Say that the running service at ``base_url`` is reused, with its direct ingress state
    (and that ``--[no-]direct-ingress`` only applies to a head ``up`` starts)."""
    try:
        running = bool(_get(base_url + "/specload/routes").json().get("direct"))
    except Exception:  # noqa: BLE001 - a service without the page: no listeners
        running = False
    log(f"reusing the service at {base_url} (strategies {health['strategies']}; direct "
        f"ingress {'on' if running else 'off'})"
        + ("" if running == direct_ingress else
           f"; --{'' if direct_ingress else 'no-'}direct-ingress applies to a Ray head "
           "`cluster up` starts: `python -m cluster down` first to change it"))


def _connect_ray(state: dict, port: int, address: str | None, dashboard: str | None,
                 num_cpus: int | None, direct_ingress: bool) -> None:
    """Use the Ray cluster at ``address`` (or ``RAY_ADDRESS``), else start a head
    (``start_head``), recorded in the state file at once so ``down`` can clean up; wait for
    its dashboard. ``state`` gets "address", "dashboard" (and the head's facts)."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        dashboard = dashboard or os.environ.get("RAY_DASHBOARD_ADDRESS", f"http://{HOST}:8265")
        state.update(address=address, dashboard=dashboard)
        log(f"using the Ray cluster at {address} (dashboard {dashboard})")
        wait_dashboard(dashboard, None, 60)
        return
    head = start_head(num_cpus, direct_ingress)
    if direct_ingress:
        log("Serve's direct ingress is on: each strategy replica also answers HTTP on a "
            "port of its own (GET /specload/routes lists them as `direct`; off with "
            "--no-direct-ingress)")
    state.update(head, started_ray=True)
    write_json(state_file(port), state)   # so `down` can clean up
    try:
        wait_dashboard(head["dashboard"], head["ray_pid"], 120)
    except SystemExit:
        log(Path(head["log"]).read_text()[-3000:])
        down(port)
        raise


def _deploy_and_wait(state: dict, cfg: dict, base_url: str, strategies: list[str],
                     timeout_s: float) -> None:
    """Check resources, deploy the one-hop config, wait until every strategy answers; a
    failure stops the Ray head this command started (nothing left running) and re-raises."""
    try:
        check_resources(state["dashboard"], cfg, may_autoscale=not state["started_ray"]
                        and has_autoscaler(state["dashboard"]))
        deploy(state["dashboard"], one_hop_config(cfg))
        wait_ready(base_url, strategies, state["dashboard"], timeout_s, ingress_api_key(cfg))
    except BaseException:   # a failed `up` leaves nothing running: stop the head it started
        if state["started_ray"]:
            log("bring-up failed: stopping the Ray head this command started")
            down(state["port"])
        raise


def up(config: Path = DEFAULT_CONFIG, port: int = DEFAULT_PORT, address: str | None = None,
       dashboard: str | None = None, num_cpus: int | None = None,
       timeout_s: float = 600, direct_ingress: bool = True) -> str:
    """Bring the service up (or reuse it); returns the base URL. ``direct_ingress`` (default
    on; ``cluster up --no-direct-ingress``): the head this starts runs Serve's direct ingress
    (``start_head``; on a cluster given by ``address`` set ``DIRECT_INGRESS_ENV`` where
    ``ray start`` runs). Raises ConfigError (``--config``), PortInUse (``--port``), SystemExit
    naming what failed during the bring-up."""
    base_url = f"http://{HOST}:{port}"
    health = service_health(base_url)
    if health is not None:
        _reuse(base_url, health, direct_ingress)
        return base_url
    cfg = load_config(Path(config), port)
    if port_in_use(port, HOST):   # nothing specload answers there, yet the port is taken
        who = listener_on(port)
        raise PortInUse(f"port {port} on {HOST} is in use by another server (not a specload "
                        f"service{': ' + who if who else ''}); pick a free port")
    strategies = expected_strategies(cfg)
    if not strategies:
        raise SystemExit("no strategy in the config can be served here (see warnings above)")
    state: dict = {"port": port, "base_url": base_url, "config": str(config),
                   "started_ray": False}
    _connect_ray(state, port, address, dashboard, num_cpus, direct_ingress)
    write_json(state_file(port), state)
    log(f"deploying {config} on port {port}: {strategies}")
    _deploy_and_wait(state, cfg, base_url, strategies, timeout_s)
    return base_url


def down(port: int = DEFAULT_PORT, timeout_s: float = 60) -> bool:
    """Stop what ``up`` started on this port; False if it had started nothing."""
    path = state_file(port)
    if not path.exists():
        log(f"nothing recorded for port {port} ({path}); nothing to stop")
        return False
    state = json.loads(path.read_text())
    if state.get("dashboard"):
        use_ray_auth_token()
        try:
            from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

            ServeSubmissionClient(state["dashboard"]).delete_applications()
            log("serve applications deleted")
        except Exception as exc:
            log(f"serve shutdown skipped: {exc}")
    pid = state.get("ray_pid")
    if state.get("started_ray") and pid and _alive(pid):
        log(f"stopping the Ray head (pid {pid})")
        os.kill(pid, signal.SIGTERM)
        t0 = time.monotonic()
        while _alive(pid) and time.monotonic() - t0 < timeout_s:
            time.sleep(0.5)
        if _alive(pid):   # its session holds only what it started
            log("the Ray head ignored SIGTERM; killing its process group")
            os.killpg(pid, signal.SIGKILL)
    if state.get("started_ray") and state.get("address"):
        forget_ray_address(state["address"])
    path.unlink(missing_ok=True)
    return True


def ray_address_file() -> Path:
    """Ray's "current cluster" file (``<ray temp dir>/ray_current_cluster``): ``ray start``
    writes the head's GCS address there, and ``ray status`` / ``ray.init("auto")`` read it."""
    try:
        from ray._private.utils import get_ray_address_file

        return Path(get_ray_address_file(None))
    except ImportError:   # Ray's default temp dir
        return Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"


def _same_local_address(named: str, address: str) -> bool:
    """``named`` (from Ray's file) is ``address``: the same port, and a host that is this
    machine (Ray records the host's own address even for a head started with
    ``--node-ip-address 127.0.0.1``, so a loopback address alone never matched)."""
    import socket

    import psutil

    host, _, port = named.rpartition(":")
    want_host, _, want_port = address.rpartition(":")
    if not port or port != want_port:
        return False
    local = {"127.0.0.1", "localhost", "::1", want_host, socket.gethostname()}
    local |= {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    return host in local


def forget_ray_address(address: str) -> bool:
    """Remove Ray's current-cluster file if it still names ``address`` (the head ``up``
    started and ``down`` stopped): left behind, it makes ``ray status`` wait ~35 s for a
    dead head and print a traceback. A file naming another head (another port, or
    another machine) is left alone."""
    f = ray_address_file()
    try:
        if not _same_local_address(f.read_text().strip(), address):
            return False
        f.unlink()
    except OSError:
        return False
    log(f"removed {f} (it named the stopped head {address})")
    return True
