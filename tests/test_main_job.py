"""End-to-end smoke of the main job on the embedded default: service -> loadgen -> report.

Starts the real service (``python -m cluster up``, two strategies, a free port),
drives it with ``python -m loadgen --report`` for a few seconds per cell, and
checks what a user reads: Parquet rows, the step log, the report and the
recommendation. ``python -m cluster down`` runs in teardown whatever happens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.serve_fixtures import cluster_up

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """configs/serve.yaml's autoregressive and ngram entries, as ``cluster up`` deploys them."""
    app = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())["applications"][0]
    keep = [s for s in app["args"]["strategies"]
            if s["engine"]["strategy"] in ("autoregressive", "ngram")]
    with cluster_up(tmp_path_factory.mktemp("svc"), keep, timeout_s=240) as url:
        yield url


def test_loadgen_to_report(service, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "loadgen", "--tier", "low", "--output", "all", "--target", service,
         "--duration", "2", "--results", str(tmp_path), "--report"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = Path(res.stdout.strip().splitlines()[-1].split("results: ", 1)[1])
    import pandas as pd

    rows = pd.read_parquet(run_dir / "requests.parquet")
    assert set(rows["strategy"]) == {"autoregressive", "ngram"}
    assert set(rows["output_class"]) == {"short", "long"}
    ok = rows[rows["status"] == "ok"]
    assert len(ok) >= 4 and (ok["output_tokens"] > 0).all()
    assert (ok["ttft_ms"] > 0).all() and (ok["e2e_ms"] >= ok["ttft_ms"]).all()
    # the server's speculative stats reached the client rows
    ng = ok[ok["strategy"] == "ngram"]
    assert ng["num_draft_tokens"].sum() > 0
    # cluster up deploys the one-hop layout and --route auto measured each strategy on it
    routes = json.loads((run_dir / "manifest.json").read_text())["routes"]
    assert routes == {s: {"route": "strategy", "base_url": f"{service}/strategies/{s}"}
                      for s in ("autoregressive", "ngram")}
    assert "autoregressive: strategy" in (run_dir / "report" / "report.md").read_text()
    steps = pd.read_parquet(run_dir / "steps.parquet")
    assert len(steps) > 0 and set(steps["strategy"]) == {"autoregressive", "ngram"}
    rec = json.loads((run_dir / "report" / "recommendation.json").read_text())
    assert set(rec["low"]) == {"short", "long"}
    assert rec["schema_version"] == 3
    low = rec["low"]["short"]
    assert low["strategy"] in {"autoregressive", "ngram"} or (
        low["strategy"] == "tie" and set(low["tied"]) == {"autoregressive", "ngram"})
    html = (run_dir / "report" / "report.html").read_text()
    assert 'id="recommendation"' in html and "data:image/png;base64," in html
    assert "recommendation per tier" in res.stdout
