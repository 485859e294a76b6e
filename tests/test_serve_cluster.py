"""Cluster files and bring-up: YAML validation (fast) and a real `ray up` on loopback (slow).

The slow test needs root SSH key auth to 127.0.0.1 (``.ci/setup_ssh.sh``). It
is skipped when that is missing unless ``SPECLOAD_REQUIRE_SSH=1`` (CI sets it,
so a broken setup fails instead of skipping). Caution: ``ray down`` runs
``ray stop`` on the head, which stops every Ray process on this machine.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from configs.net import free_ports

REPO = Path(__file__).resolve().parent.parent
SSH_KEY = Path.home() / ".ssh" / "specload_local_ed25519"


def _ray_validate(path: Path) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = prepare_config(copy.deepcopy(yaml.safe_load(path.read_text())))
    validate_config(cfg)
    return cfg


def test_cluster_yaml_validates():
    cfg = _ray_validate(REPO / "cluster" / "cluster.yaml")
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert any(t["resources"].get("GPU", 0) >= 1 for t in types.values())
    assert any("specload" in c and "pip install" in c for c in cfg["setup_commands"])


def test_local_yaml_validates():
    raw = yaml.safe_load((REPO / "cluster" / "local.yaml").read_text())
    assert raw["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    assert raw["auth"]["ssh_user"] == "root" and raw["auth"]["ssh_private_key"]
    _ray_validate(REPO / "cluster" / "local.yaml")


def test_rayservice_manifest_holds_a_valid_app():
    from configs.serve_config import ServeAppConfig

    doc = yaml.safe_load((REPO / "cluster" / "rayservice.yaml").read_text())
    assert doc["kind"] == "RayService" and doc["apiVersion"].startswith("ray.io/")
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    app = serve_cfg["applications"][0]
    assert app["import_path"] == "actors.serve.app:build_app"
    cfg = ServeAppConfig.model_validate(app["args"])
    assert all(s.ray_actor_options.num_gpus >= 1 for s in cfg.strategies)
    workers = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert any("nvidia.com/gpu" in w["template"]["spec"]["containers"][0]["resources"]["limits"]
               for w in workers)


def test_cluster_cli_state_dir_is_private(tmp_path, monkeypatch):
    from cluster import local

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert local.state_file(8123) == tmp_path / "specload" / "cluster-8123.json"
    assert local.down(8123) is False           # nothing recorded: nothing stopped
    a, b, c = local.free_ports(3)
    assert len({a, b, c}) == 3


def _ssh_ok() -> bool:
    if not SSH_KEY.exists():
        return False
    r = subprocess.run(["ssh", "-i", str(SSH_KEY), "-o", "BatchMode=yes", "-o",
                        "StrictHostKeyChecking=no", "-o", "ConnectTimeout=5",
                        "root@127.0.0.1", "true"], capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.slow
def test_ray_up_local_loopback(tmp_path):
    """ray up -y cluster/local.yaml on 127.0.0.1, deploy, one completion, ray down -y."""
    httpx = pytest.importorskip("httpx")
    if not _ssh_ok():
        if os.environ.get("SPECLOAD_REQUIRE_SSH") == "1":
            pytest.fail("root SSH to 127.0.0.1 with ~/.ssh/specload_local_ed25519 failed; "
                        "run .ci/setup_ssh.sh")
        pytest.skip("no root SSH to 127.0.0.1. To run it: .ci/setup_ssh.sh; CAUTION: this test "
                    "ends with `ray down`, which stops EVERY Ray process on the machine "
                    "(other users' clusters included): run it only on a machine of your own")
    gcs, dash, client_port, agent_http, agent_grpc, rt_agent, http_port = free_ports(7)
    remote_dir = f"/tmp/specload-rayup-{uuid.uuid4().hex[:8]}"
    py_bin = str(Path(sys.executable).parent)
    cfg = yaml.safe_load((REPO / "cluster" / "local.yaml").read_text())
    # Same cluster, made collision-free: unique name, a temp copy of the repo,
    # free ports, and this interpreter's bin dir on PATH (CI venvs).
    cfg["cluster_name"] = f"specload-test-{uuid.uuid4().hex[:8]}"
    cfg["auth"]["ssh_private_key"] = str(SSH_KEY)
    cfg["file_mounts"] = {remote_dir: str(REPO)}
    env = f"export PATH={py_bin}:$PATH; export PYTHONPATH={remote_dir};"
    cfg["head_start_ray_commands"] = [
        f"{env} ray start --head --port={gcs} --node-ip-address=127.0.0.1 "
        f"--dashboard-host=127.0.0.1 --dashboard-port={dash} "
        f"--ray-client-server-port={client_port} --dashboard-agent-listen-port={agent_http} "
        f"--dashboard-agent-grpc-port={agent_grpc} --runtime-env-agent-port={rt_agent} "
        "--autoscaling-config=~/ray_bootstrap_config.yaml --disable-usage-stats"]
    cfg_path = tmp_path / "local.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    # the service deployed over there: configs/serve.yaml with its autoregressive entry only
    # (this test is about ray up / exec / down; every strategy's deploy is tested elsewhere)
    serve_cfg = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    app_args = serve_cfg["applications"][0]["args"]
    app_args["strategies"] = [s for s in app_args["strategies"]
                              if s["engine"]["strategy"] == "autoregressive"][:1]
    serve_path = tmp_path / "serve.yaml"
    serve_path.write_text(yaml.safe_dump(serve_cfg))
    _ray_validate(cfg_path)
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]

    # Ray's own default here, as on the SSH side (tests/conftest.py keeps single-node test
    # clusters on 127.0.0.1 with RAY_SINGLE_NODE_LOOPBACK_ENV; `ray up` runs its commands over SSH)
    from configs.net import RAY_SINGLE_NODE_LOOPBACK_ENV

    ray_env = {k: v for k, v in os.environ.items() if k not in RAY_SINGLE_NODE_LOOPBACK_ENV}

    def run(args, timeout):
        r = subprocess.run(ray_cli + args, cwd=REPO, capture_output=True, text=True,
                           timeout=timeout, env=ray_env)
        assert r.returncode == 0, f"{args[0]} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        return r

    try:
        run(["up", "-y", "--no-config-cache", str(cfg_path)], 900)
        # the repo's files went over, its local venvs and .gitignore'd paths did not
        # (.ci/run keeps the vLLM venv, 3.5 GB, in the checkout as .venv-vllm)
        assert (Path(remote_dir) / "models" / "target" / "config.json").is_file()
        synced = {p.name for p in Path(remote_dir).iterdir()}
        assert not synced & {".venv-vllm", ".venv", "results", ".git"}, sorted(synced)
        up = run(["exec", str(cfg_path),
                  f"{env} cd {remote_dir} && python -m cluster up --address 127.0.0.1:{gcs} "
                  f"--dashboard http://127.0.0.1:{dash} --port {http_port} --timeout 600 "
                  f"--config {serve_path}"], 900)
        url = f"http://127.0.0.1:{http_port}"
        assert url in [line.strip() for line in up.stdout.splitlines()], up.stdout[-2000:]
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "autoregressive", "prompt": "def main():", "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        subprocess.run(ray_cli + ["down", "-y", str(cfg_path)], cwd=REPO,
                       capture_output=True, timeout=300, env=ray_env)
        subprocess.run(["rm", "-rf", remote_dir], check=False)
