"""``analysis plan --emit-serve-config``: a plan becomes a Serve config that validates and fits the cluster."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from analysis import cli
from analysis.decide.plan import plan
from analysis.decide.serve_plan import DEFAULT_BASE_CONFIG, DEFAULT_CLUSTER_YAML, cluster_fit, planned_replicas
from configs import metric_names as mn
from configs.serve_config import ServeAppConfig
from tests import analysis_synth as syn


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan_serve")
    strats = (syn.AR, dataclasses.replace(syn.DFLASH, draft_ms=0.0), syn.NGRAM)
    return syn.write_run(root / "run", strats=strats)


def _app_args(path) -> dict:
    cfg = yaml.safe_load(path.read_text())
    (app,) = cfg["applications"]
    assert app["import_path"] == "actors.serve.app:build_app"
    return cfg, app["args"]


def test_emit_model_plan(run_dir, tmp_path, capsys):
    out_yaml = tmp_path / "plan.yaml"
    assert cli.main(["plan", str(run_dir), "--qps", "100", "--tier", "high", "--slo-ttft-ms", "500",
                     "--slo-tpot-ms", "1000", "--emit-serve-config", str(out_yaml)]) == 0
    assert "serve deploy" in capsys.readouterr().out
    cfg, args = _app_args(out_yaml)
    app = ServeAppConfig.model_validate(args)
    by_name = {s.name: s for s in app.strategies}
    # replicas = max over output classes of the model plan (its arithmetic: tests/test_replica_model.py)
    expect = plan(run_dir, qps=100, tier="high", slo_ttft_ms=500, slo_tpot_ms=1000)
    want = {}
    for r in expect["model"]:
        if r["replicas"] is not None:
            want[r["strategy"]] = max(want.get(r["strategy"], 0), r["replicas"])
    assert want[mn.AUTOREGRESSIVE] >= 4
    assert {n: s.num_replicas for n, s in by_name.items()} == want
    # resources copied from configs/serve.yaml (CPU box), strategies the run lacks left out
    base = ServeAppConfig.model_validate(yaml.safe_load(DEFAULT_BASE_CONFIG.read_text())
                                         ["applications"][0]["args"])
    base_opts = {s.name: s.ray_actor_options for s in base.strategies}
    for name, s in by_name.items():
        assert s.ray_actor_options == base_opts[name] and s.autoscaling_config is None
    assert mn.DSPARK not in by_name
    assert "left out" in out_yaml.read_text() and mn.DSPARK in out_yaml.read_text()
    # deployable: Ray's own schema for `serve deploy` accepts it
    from ray.serve.schema import ServeDeploySchema
    ServeDeploySchema.model_validate(cfg)


def test_emit_gpu_plan_fits_cluster_yaml(run_dir, tmp_path):
    out_yaml = tmp_path / "gpu.yaml"
    assert cli.main(["plan", str(run_dir), "--qps", "200", "--tier", "low", "--slo-ttft-ms", "1000",
                     "--slo-tpot-ms", "20", "--gpu", "h100", "--model-params", "8e9",
                     "--emit-serve-config", str(out_yaml)]) == 0
    cfg, args = _app_args(out_yaml)
    app = ServeAppConfig.model_validate(args)
    out = plan(run_dir, qps=200, tier="low", slo_ttft_ms=1000, slo_tpot_ms=20, gpu="h100",
               model_params=8e9)
    planned = planned_replicas(out)
    assert planned and all(p["source"] == "gpu_plan" for p in planned.values())
    assert {s.name: s.num_replicas for s in app.strategies} == {k: v["replicas"] for k, v in planned.items()}
    assert all(s.ray_actor_options.num_gpus == 1 and s.engine["device"] == "cuda" for s in app.strategies)
    total_gpus = sum(s.num_replicas for s in app.strategies)
    fit = {r["node_type"]: r for r in cluster_fit(cfg, DEFAULT_CLUSTER_YAML)}
    gpu_per_node = yaml.safe_load(DEFAULT_CLUSTER_YAML.read_text())[
        "available_node_types"]["gpu_worker"]["resources"]["GPU"]
    assert fit["gpu_worker"]["nodes_needed"] == -(-total_gpus // gpu_per_node)
    assert fit["gpu_worker"]["fits"] and fit["gpu_worker"]["nodes_needed"] <= fit["gpu_worker"]["max_workers"]
    assert fit["load_worker"]["nodes_needed"] == 0


def test_emit_errors_name_the_flag(run_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:   # SLOs nobody meets: nothing to deploy
        cli.main(["plan", str(run_dir), "--qps", "10", "--tier", "high", "--slo-ttft-ms", "1",
                  "--slo-tpot-ms", "1", "--emit-serve-config", str(tmp_path / "x.yaml")])
    assert exc.value.code == 2 and "--emit-serve-config" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()
    small = yaml.safe_load(DEFAULT_CLUSTER_YAML.read_text())
    small["available_node_types"]["gpu_worker"]["max_workers"] = 1
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(small))
    assert cli.main(["plan", str(run_dir), "--qps", "2000", "--tier", "low", "--slo-ttft-ms", "1000",
                     "--slo-tpot-ms", "20", "--gpu", "h100", "--model-params", "8e9",
                     "--cluster-yaml", str(tmp_path / "small.yaml"),
                     "--emit-serve-config", str(tmp_path / "big.yaml")]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert "DOES NOT FIT" in (tmp_path / "big.yaml").read_text()
