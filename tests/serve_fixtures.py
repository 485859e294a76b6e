"""Helpers for the Serve tests: a local Ray + Serve app on a free loopback port.

The real engine (``actors.engine.llm_engine.LLMEngine`` on ``models/target``) is used
unless ``SPECLOAD_TEST_FAKE_ENGINE`` is "1"; then ``tests.fake_engine`` stands in (same
API, deterministic).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ONE_SLOT = "one-slot"     # a 1-slot, 1-waiting deployment for overload / disconnect tests


def process_running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody reaped yet counts as exited)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def use_real_engine() -> bool:
    """False only when ``SPECLOAD_TEST_FAKE_ENGINE=1`` asks for the fake engine. The engine
    and the embedded weights are committed: a checkout without them is broken, and the
    tests say so (AssertionError) instead of quietly running the fake."""
    if os.environ.get("SPECLOAD_TEST_FAKE_ENGINE") == "1":
        return False
    missing = [str(p) for p in (REPO / "actors" / "engine" / "llm_engine.py",
                                REPO / "models" / "target" / "model.safetensors")
               if not p.exists()]
    assert not missing, f"committed files missing from this checkout: {missing}"
    return True


def app_args(real: bool) -> dict:
    """ServeAppConfig args for the test app: every servable strategy + ONE_SLOT."""
    from configs.serve_config import REPLICA_ENV

    common = {"max_num_seqs": 8, "max_waiting": 32, "torch_threads": 1}
    fake = {} if real else {"max_model_len": 4096, "step_ms": 4}
    strategies = [
        {"engine": {"strategy": "autoregressive", "num_speculative_tokens": 0, **common, **fake},
         "ray_actor_options": {"num_cpus": 0.3}},
        {"engine": {"strategy": "ngram", "num_speculative_tokens": 4, **common, **fake},
         "ray_actor_options": {"num_cpus": 0.3}},
        {"name": ONE_SLOT,
         "engine": {"strategy": "autoregressive", "num_speculative_tokens": 0,
                    "max_num_seqs": 1, "max_waiting": 1, "torch_threads": 1,
                    **({} if real else {"max_model_len": 4096, "step_ms": 10})},
         "ray_actor_options": {"num_cpus": 0.2}},
    ]
    if real and (REPO / "models" / "draft" / "model.safetensors").exists():
        strategies.insert(1, {"engine": {"strategy": "draft_model", "draft_model": "models/draft",
                                         "num_speculative_tokens": 4, **common},
                              "ray_actor_options": {"num_cpus": 0.3}})
    args: dict = {"strategies": strategies,
                  "ingress": {"ray_actor_options": {"num_cpus": 0.1}}}
    # As configs/serve.yaml's runtime_env (configs.serve_config.REPLICA_ENV).
    for opts in [s["ray_actor_options"] for s in strategies] + [
            args["ingress"]["ray_actor_options"]]:
        opts["runtime_env"] = {"env_vars": dict(REPLICA_ENV)}
    if not real:
        args["engine_factory"] = "tests.fake_engine:make_fake_engine"
    return args


def parse_sse(lines) -> list[dict | str]:
    """``data:`` payloads of an SSE body: dicts, and the string "[DONE]"."""
    out: list[dict | str] = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@contextlib.contextmanager
def cluster_up(tmp: Path, strategies: list[dict] | None = None, timeout_s: int = 300):
    """``python -m cluster up`` of ``configs/serve.yaml`` on a free 127.0.0.1 port (its own
    Ray head), with the application's strategy list replaced by ``strategies`` when given;
    yields the base URL and runs ``cluster down`` for that port whatever happens. Start-up
    is tried twice when Ray's raylet times out (a loaded box). Raises AssertionError with
    the command's output when it fails."""
    import yaml

    from configs.net import free_port

    cfg = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    if strategies is not None:
        cfg["applications"][0]["args"]["strategies"] = strategies
    port = free_port()
    cfg["http_options"]["port"] = port
    path = Path(tmp) / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    down = [sys.executable, "-m", "cluster", "down", "--port", str(port)]
    try:
        for _ in range(2):
            up = subprocess.run([sys.executable, "-m", "cluster", "up", "--config", str(path),
                                 "--port", str(port), "--timeout", str(timeout_s)], cwd=REPO,
                                capture_output=True, text=True, timeout=timeout_s + 120)
            if up.returncode == 0 or "timed out during startup" not in up.stderr:
                break
            subprocess.run(down, cwd=REPO, capture_output=True, text=True, timeout=180)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        url = up.stdout.strip().splitlines()[-1]
        assert url == f"http://127.0.0.1:{port}", url
        yield url
    finally:
        subprocess.run(down, cwd=REPO, capture_output=True, text=True, timeout=180)


@contextlib.contextmanager
def local_service(args: dict):
    """A fresh local Ray (``address="local"``: never one a ``cluster up`` left running, 2
    CPUs, metrics exported every second) and ``args`` deployed as the one application
    ``specload`` at ``/`` on a free 127.0.0.1 port, its Serve proxy with ``cluster up``'s
    environment (``PROXY_ENV``: gRPC to the replicas). Yields (base_url, metrics_url); shuts
    Serve and Ray down after."""
    import ray
    from ray import serve

    from actors.serve.app import run_applications
    from configs.net import free_port
    from configs.serve_config import PROXY_ENV

    metrics_port = free_port()
    saved = {k: os.environ.get(k) for k in PROXY_ENV}
    os.environ.update(PROXY_ENV)   # the local Ray's processes (its proxy) inherit it at start
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        run_applications(args, name="specload", route_prefix="/")
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
