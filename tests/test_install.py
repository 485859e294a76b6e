"""A non-editable ``pip install .`` runs the main job from any directory, without the checkout.

Copies what the package needs (pyproject, packages, models/, data/prompts/) to a
temporary folder, builds its wheel and installs it with ``pip install --no-deps``
into a fresh venv
(``--system-site-packages`` only to reuse the already installed dependencies:
torch, ray, locust, pandas), then, from an empty directory and with no
PYTHONPATH, runs the main job ``python -m loadgen --tier low --output all --report`` cut
short (``--duration 2``, two strategies, its own local service on a free port).
It checks that every specload module and the embedded models come from the
venv, never from this checkout or the shared editable install, then what a user
reads (Parquet rows, the step log, the report and the recommendation), and stops
the service it started whatever happens.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from configs.net import free_port

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "analysis", "cluster", "configs", "corpus", "loadgen", "train")
pytestmark = pytest.mark.slow


def _copy_source(dst: Path) -> None:
    """The files a wheel is built from; no .git, caches, results or build leftovers."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    for pkg in PACKAGES + ("models",):
        shutil.copytree(REPO / pkg, dst / pkg, ignore=skip)
    shutil.copytree(REPO / "data" / "prompts", dst / "data" / "prompts")


def _clean_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RAY_ADDRESS", "SPECLOAD_HOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def test_pip_install_runs_loadgen_report_from_any_directory(tmp_path):
    src, venv, work = tmp_path / "src", tmp_path / "venv", tmp_path / "work"
    src.mkdir()
    work.mkdir()
    _copy_source(src)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True,
                   timeout=120)
    py = str(venv / "bin" / "python")
    env = _clean_env(venv)
    # `pip install .`, non-editable, in two steps: the wheel is built by this interpreter's
    # setuptools (the venv's seeded one may be too old for PEP 517 wheels), then the venv's
    # pip installs it; no dependency resolution, no network, nothing written to the checkout
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "--quiet", "-w", str(tmp_path / "dist"), str(src)],
                           cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stdout[-2000:] + wheel.stderr[-2000:]
    whl = next((tmp_path / "dist").glob("specload-*.whl"))
    pip = subprocess.run([py, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                          "--quiet", str(whl)], cwd=work, env=env, capture_output=True, text=True,
                         timeout=300)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    shutil.rmtree(src)   # nothing may be read from the copy either

    probe = subprocess.run(
        [py, "-c", "import actors.drafters, analysis, cluster, configs.paths as p, loadgen, train;"
                   "print(p.__file__); print(actors.drafters.__file__); print(p.REPO_ROOT)"],
        cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    paths_file, drafters_file, root = probe.stdout.split()
    site = str(venv / "lib")
    assert paths_file.startswith(site) and drafters_file.startswith(site), probe.stdout
    assert Path(root) == venv / "share" / "specload", probe.stdout  # the installed data home
    assert (Path(root) / "models" / "target" / "model.safetensors").is_file()

    # the service: two strategies, models named relative to the data home, none skipped
    cfg = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    args = cfg["applications"][0]["args"]
    args["strategies"] = [s for s in args["strategies"]
                          if s["engine"]["strategy"] in ("autoregressive", "ngram")]
    args["skip_missing_models"] = False
    assert all(s["engine"]["model"] == "models/target" for s in args["strategies"])
    (work / "serve.yaml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    try:
        run = subprocess.run(
            [py, "-m", "loadgen", "--tier", "low", "--output", "all", "--report", "--duration", "2",
             "--strategies", "autoregressive,ngram", "--local-port", str(port),
             "--local-config", "serve.yaml", "--results", "results"],
            cwd=work, env=env, capture_output=True, text=True, timeout=480)
    finally:
        subprocess.run([py, "-m", "cluster", "down", "--port", str(port)], cwd=work, env=env,
                       capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = Path(next(ln.split("results: ", 1)[1] for ln in run.stdout.splitlines()
                        if ln.startswith("results: ")))
    if not run_dir.is_absolute():
        run_dir = work / run_dir
    import pandas as pd

    # what a user of the main job reads: rows, the step log, the report, the recommendation
    rows = pd.read_parquet(run_dir / "requests.parquet")
    assert set(rows["strategy"]) == {"autoregressive", "ngram"}
    assert set(rows["output_class"]) == {"short", "long"}
    ok = rows[rows["status"] == "ok"]
    assert set(ok["strategy"]) == {"autoregressive", "ngram"} and len(ok) >= 4
    assert (ok["output_tokens"] > 0).all()
    assert (ok["ttft_ms"] > 0).all() and (ok["e2e_ms"] >= ok["ttft_ms"]).all()
    # the server's speculative stats reached the client rows
    assert ok[ok["strategy"] == "ngram"]["num_draft_tokens"].sum() > 0
    # the local service deploys the one-hop layout with Serve's direct ingress, and --route
    # auto measured each strategy on its replica's own listener (127.0.0.1, no Serve proxy)
    routes = json.loads((run_dir / "manifest.json").read_text())["routes"]
    assert set(routes) == {"autoregressive", "ngram"}
    for s, r in routes.items():
        assert r["route"] == "direct", routes
        assert re.fullmatch(rf"http://127\.0\.0\.1:\d+/strategies/{s}", r["base_url"]), routes
        assert not r["base_url"].startswith(f"http://127.0.0.1:{port}/"), routes   # not the proxy
    assert set(rows["route"]) == {"direct"}
    assert "autoregressive: direct" in (run_dir / "report" / "report.md").read_text()
    steps = pd.read_parquet(run_dir / "steps.parquet")
    assert len(steps) > 0 and set(steps["strategy"]) == {"autoregressive", "ngram"}
    # the engine profile the capacity model calibrates: taken after the cells, beside the run
    man = json.loads((run_dir / "manifest.json").read_text())
    assert man["engine_profile"]["file"] == "cost_curve.json", man["engine_profile"]
    assert sorted(man["engine_profile"]["strategies"]) == ["autoregressive", "ngram"]
    prof = json.loads((run_dir / "cost_curve.json").read_text())
    assert prof["kind"] == "engine_profile" and set(prof["strategies"]) == {"autoregressive", "ngram"}
    rec = json.loads((run_dir / "report" / "recommendation.json").read_text())
    assert set(rec["low"]) == {"short", "long"}
    assert rec["schema_version"] == 4
    low = rec["low"]["short"]
    assert low["strategy"] in {"autoregressive", "ngram"} or (
        low["strategy"] == "tie" and set(low["tied"]) == {"autoregressive", "ngram"})
    html = (run_dir / "report" / "report.html").read_text()
    assert 'id="recommendation"' in html and "data:image/png;base64," in html
    assert "recommendation per tier" in run.stdout
