"""configs/serve.yaml and its schema (configs/serve_config.py), build_app's skip rules."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from configs.serve_config import CONTROL_HEADROOM, REPLICA_ENV, ServeAppConfig, StrategyEntry

REPO = Path(__file__).resolve().parent.parent
SERVE_YAML = REPO / "configs" / "serve.yaml"


def _args() -> dict:
    return yaml.safe_load(SERVE_YAML.read_text())["applications"][0]["args"]


@pytest.mark.parametrize("name", ["serve.yaml", "serve-vllm.yaml"])
def test_replica_env_is_the_one_in_configs(name):
    """The deployable configs' replica environment is ``REPLICA_ENV`` (what bench_serve and
    the test services deploy with), router on the replica's loop included."""
    app = yaml.safe_load((REPO / "configs" / name).read_text())["applications"][0]
    assert app["runtime_env"]["env_vars"] == REPLICA_ENV
    assert REPLICA_ENV["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"


def test_serve_yaml_is_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(SERVE_YAML.read_text())
    ServeDeploySchema.model_validate(doc)
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 8000}
    app = doc["applications"][0]
    assert app["import_path"] == "actors.serve.app:build_app"
    cfg = ServeAppConfig.model_validate(app["args"])
    names = [s.name for s in cfg.strategies]
    assert names[:3] == ["autoregressive", "draft_model", "ngram"]
    assert all(0 < s.ray_actor_options.num_cpus < 1 for s in cfg.strategies)
    assert all(s.engine.get("torch_threads") == 1 for s in cfg.strategies)


def test_engine_sections_are_valid_engine_configs():
    from actors.engine.config import EngineConfig
    from actors.engine.strategies import PROPOSERS
    from actors.serve.app import resolve_engine_config

    for s in ServeAppConfig.model_validate(_args()).strategies:
        if s.engine["strategy"] in PROPOSERS:
            cfg = EngineConfig(**resolve_engine_config(s.engine))
            assert Path(cfg.model).is_absolute()


@pytest.mark.parametrize("where", ["top", "strategy", "actor", "ingress", "autoscaling"])
def test_unknown_keys_are_errors(where):
    args = _args()
    if where == "top":
        args["bogus"] = 1
    elif where == "strategy":
        args["strategies"][0]["replicas"] = 2
    elif where == "actor":
        args["strategies"][0]["ray_actor_options"]["gpus"] = 1
    elif where == "ingress":
        args["ingress"]["port"] = 1
    else:
        args["strategies"][2].pop("num_replicas", None)
        args["strategies"][2]["autoscaling_config"] = {
            "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 32, "max": 3}
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        ServeAppConfig.model_validate(args)


def test_max_ongoing_requests_never_caps_the_batch():
    e = StrategyEntry(engine={"strategy": "ngram", "max_num_seqs": 48, "max_waiting": 100})
    assert e.resolved_max_ongoing_requests() == 48 + 100 + CONTROL_HEADROOM
    assert StrategyEntry(engine={"strategy": "ngram"}).resolved_max_ongoing_requests() >= 32
    with pytest.raises(ValidationError, match="max_num_seqs"):
        StrategyEntry(engine={"strategy": "ngram", "max_num_seqs": 48}, max_ongoing_requests=5)
    with pytest.raises(ValidationError, match="not both"):
        StrategyEntry(engine={"strategy": "ngram"}, num_replicas=2,
                      autoscaling_config={"min_replicas": 1, "max_replicas": 2})
    with pytest.raises(ValidationError, match="engine.strategy"):
        StrategyEntry(engine={})
    with pytest.raises(ValidationError, match="unique"):
        ServeAppConfig(strategies=[{"engine": {"strategy": "ngram"}},
                                   {"engine": {"strategy": "ngram"}}])


def test_build_app_skips_missing_models(caplog, tmp_path):
    pytest.importorskip("ray.serve")
    from actors.serve.app import build_app, missing_reason

    assert (REPO / "models" / "target" / "model.safetensors").exists(), "committed weights missing"
    args = {"strategies": [
        {"engine": {"strategy": "ngram", "max_num_seqs": 4}},
        {"engine": {"strategy": "draft_model", "draft_model": str(tmp_path / "none")}},
        {"name": "x", "engine": {"strategy": "no_such_strategy"}},
    ]}
    with caplog.at_level(logging.WARNING, logger="actors.serve.app"):
        app = build_app(args)
    assert app is not None
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "skipping strategy draft_model" in msgs and "skipping strategy x" in msgs
    assert "strategy table" in missing_reason(StrategyEntry(engine={"strategy": "no_such_strategy"}))
    with pytest.raises(ValueError, match="no strategy can be served"):
        build_app({"strategies": args["strategies"][1:]})


def test_routes_mark_the_autoscaling_strategies():
    """The ingress is told which strategies Serve may scale (``autoscaling_config``): GET
    /specload/routes marks them, and the load generator keeps their load on the proxy's
    route (a load pinned to one replica's listener would never reach the replicas added)."""
    pytest.importorskip("ray.serve")
    from actors.serve.app import build_app

    app = build_app({"strategies": [
        {"engine": {"strategy": "ngram", "max_num_seqs": 4}},
        {"engine": {"strategy": "autoregressive", "max_num_seqs": 4},
         "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}],
        "strategy_apps": {"ngram": "a1", "autoregressive": "a2"}})
    routes, autoscaling = app._bound_deployment.init_args[-2:]
    assert routes == {"ngram": "/strategies/ngram", "autoregressive": "/strategies/autoregressive"}
    assert autoscaling == ["autoregressive"]


def test_actor_options_for_serve_drop_unset_and_empty_resources():
    from configs.serve_config import RayActorOptions

    assert RayActorOptions(num_cpus=0.1).serve_options() == {"num_cpus": 0.1, "num_gpus": 0.0}
    pinned = RayActorOptions(num_cpus=0.1, resources={"specload_front": 0.1})
    assert pinned.serve_options()["resources"] == {"specload_front": 0.1}
    # the step-log store's options: with the ingress, no CPU, a sliver of its custom resources
    assert pinned.serve_options(num_cpus=0, resources={"specload_front": 0.001}) == {
        "num_cpus": 0, "num_gpus": 0.0, "resources": {"specload_front": 0.001}}


def test_one_hop_layout_of_the_serve_yaml(tmp_path):
    """``cluster up`` deploys configs/serve.yaml split: one application per servable strategy
    at <route_prefix>/strategies/<name> (a valid Serve config), the ingress application last,
    reaching them by application name; strategies build_app would skip are left out."""
    pytest.importorskip("ray.serve")
    from ray.serve.schema import ServeDeploySchema

    from actors.serve.app import build_strategy_app, strategy_app_name
    from cluster.local import one_hop_config

    doc = yaml.safe_load(SERVE_YAML.read_text())
    doc["applications"][0]["route_prefix"] = "/svc"
    doc["applications"][0]["args"]["strategies"].append(
        {"name": "gone", "engine": {"strategy": "draft_model", "draft_model": str(tmp_path)}})
    split = one_hop_config(doc)
    ServeDeploySchema.model_validate(split)
    *subs, main = split["applications"]
    names = [s.name for s in ServeAppConfig.model_validate(_args()).strategies]
    served = [n for n in names if (REPO / "models" / {"autoregressive": "target", "ngram": "target",
                                                      "draft_model": "draft"}.get(n, n)).is_dir()]
    assert [s["args"]["strategy"] for s in subs] == served   # "gone" has no model: left out
    for s in subs:
        n = s["args"]["strategy"]
        assert s["name"] == strategy_app_name("specload", n) == f"specload-strategy-{n}"
        assert s["route_prefix"] == f"/svc/strategies/{n}"
        assert s["runtime_env"] == main["runtime_env"] and s["args"]["store_app"] == "specload"
    assert main["name"] == "specload" and main["route_prefix"] == "/svc"
    assert main["args"]["strategy_apps"] == {n: strategy_app_name("specload", n) for n in served}
    assert ServeAppConfig.model_validate(main["args"]).strategy_apps == main["args"]["strategy_apps"]
    with pytest.raises(ValueError, match="not in the app's strategies"):
        build_strategy_app({"app": _args(), "strategy": "nope", "store_app": None})


def test_engine_process_auto_follows_the_cores(monkeypatch):
    """engine_process: true / false as given; "auto" (the default) only from
    ENGINE_PROCESS_MIN_CPUS (2) cores: one core keeps the engine on the replica's thread."""
    import os

    from configs import serve_config as sc

    entry = sc.StrategyEntry(engine={"strategy": "ngram"})
    assert entry.engine_process == "auto"
    assert sc.StrategyEntry(engine={"strategy": "ngram"}, engine_process=True).engine_process is True
    with pytest.raises(ValueError):
        sc.StrategyEntry(engine={"strategy": "ngram"}, engine_process="sometimes")
    for cores, want in ((1, False), (2, True), (sc.ENGINE_PROCESS_MIN_CPUS, True), (64, True)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert sc.resolve_engine_process("auto") is want
        assert sc.resolve_engine_process(True) is True and sc.resolve_engine_process(False) is False


def test_stream_interval_ms_defaults_to_the_window_and_is_checked():
    """A strategy's streamed chunks: one per 50 ms window by default (Ray Serve LLM's stream
    batching); null turns the window off; 0, negative and over a minute are refused."""
    from configs import serve_config as sc

    assert sc.StrategyEntry(engine={"strategy": "ngram"}).stream_interval_ms == 50.0
    assert sc.StrategyEntry(engine={"strategy": "ngram"},
                            stream_interval_ms=None).stream_interval_ms is None
    for bad in (0, -5, 60_001):
        with pytest.raises(ValueError, match="stream_interval_ms"):
            sc.StrategyEntry(engine={"strategy": "ngram"}, stream_interval_ms=bad)


def test_direct_ingress_env_turns_it_on_by_serve_s_own_rule():
    """``DIRECT_INGRESS_ENV`` (cluster up --direct-ingress) turns Serve's direct ingress on,
    and ``direct_ingress_enabled`` reads the environment as Ray Serve does (its constants
    module, checked against it here in a fresh interpreter per case)."""
    import subprocess
    import sys

    from actors.serve.openai_api import direct_ingress_enabled
    from configs.serve_config import DIRECT_INGRESS_ENV

    cases = [{}, dict(DIRECT_INGRESS_ENV), {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"},
             {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
             {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"},
             {"RAY_SERVE_ENABLE_HA_PROXY": "1"}]
    keys = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_THROUGHPUT_OPTIMIZED",
            "RAY_SERVE_ENABLE_HA_PROXY")
    base = {k: v for k, v in os.environ.items() if k not in keys}
    ours = [direct_ingress_enabled(c) for c in cases]
    assert ours == [False, True, False, True, False, True]
    code = ("from ray.serve._private import constants as c; "
            "print(int(c.RAY_SERVE_ENABLE_DIRECT_INGRESS))")
    rays = [subprocess.run([sys.executable, "-c", code], env={**base, **c}, capture_output=True,
                           text=True, timeout=120, check=True).stdout.strip() == "1"
            for c in cases]
    assert rays == ours


def test_direct_ingress_urls_from_serve_s_target_groups(monkeypatch):
    """``direct_ingress_urls``: per strategy the HTTP targets of the target group at its
    route prefix, on the HTTP options' host when that is loopback (the listener binds it),
    else the node's address (IPv6 bracketed); gRPC groups and other prefixes left out; {}
    with direct ingress off or a controller that fails."""
    import asyncio
    import types

    import ray.serve.context as serve_context

    from actors.serve import openai_api

    def group(prefix, protocol, *targets):
        return types.SimpleNamespace(route_prefix=prefix, protocol=types.SimpleNamespace(
            value=protocol), targets=[types.SimpleNamespace(ip=ip, port=port)
                                      for ip, port in targets])

    groups = [group("/strategies/ngram", "HTTP", ("10.0.0.2", 30002), ("fd00::5", 30001)),
              group("/strategies/ngram", "gRPC", ("10.0.0.2", 40000)),
              group("/strategies/autoregressive", "HTTP", ("10.0.0.3", 30000)),
              group("/", "HTTP", ("10.0.0.2", 30003))]
    http = {"host": "0.0.0.0"}

    async def ready(value):
        return value

    def remote(get):
        return types.SimpleNamespace(remote=lambda: ready(get()))

    controller = types.SimpleNamespace(get_target_groups=remote(lambda: groups),
                                       get_http_config=remote(
                                           lambda: types.SimpleNamespace(**http)))
    monkeypatch.setattr(serve_context, "_get_global_client",
                        lambda: types.SimpleNamespace(_controller=controller))
    routes = {"ngram": "/strategies/ngram", "autoregressive": "/strategies/autoregressive",
              "dflash": None}
    for k in ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_HA_PROXY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1")
    assert asyncio.run(openai_api.direct_ingress_urls(routes)) == {
        "autoregressive": ["http://10.0.0.3:30000"],
        "ngram": ["http://10.0.0.2:30002", "http://[fd00::5]:30001"]}
    http["host"] = "127.0.0.1"
    assert asyncio.run(openai_api.direct_ingress_urls(routes)) == {
        "autoregressive": ["http://127.0.0.1:30000"],
        "ngram": ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]}
    groups.append(None)   # an entry that is not a target group is skipped
    assert len(asyncio.run(openai_api.direct_ingress_urls(routes))["ngram"]) == 2
    groups.pop()

    def fails():
        raise RuntimeError("controller gone")

    controller.get_target_groups = remote(fails)   # a failing controller: nothing listed
    assert asyncio.run(openai_api.direct_ingress_urls(routes)) == {}
    controller.get_target_groups = remote(lambda: groups)
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "0")
    assert asyncio.run(openai_api.direct_ingress_urls(routes)) == {}
