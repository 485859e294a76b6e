"""The main job's engine profile (``loadgen.cli.engine_profile``): when it is taken, the real
``python -m actors.profile`` child writing ``RUN_DIR/cost_curve.json`` for the run's embedded
strategies, and a failure that loses nothing."""

from __future__ import annotations

import argparse
import json

from loadgen.cli import engine_profile


def _args(**kw):
    return argparse.Namespace(**{"engine_profile": "auto", "target": "", **kw})


def test_taken_only_for_the_local_service_and_a_finished_run():
    assert engine_profile.wanted(_args(), "finished") is None
    assert "--engine-profile off" in engine_profile.wanted(_args(engine_profile="off"), "finished")
    assert "--target" in engine_profile.wanted(_args(target="http://127.0.0.1:9"), "finished")
    assert "interrupted" in engine_profile.wanted(_args(), "interrupted")


def test_profiles_the_embedded_strategies_and_skips_the_rest(tmp_path):
    said = []
    rec = engine_profile.take(tmp_path, ["autoregressive", "autoregressive-k9"], "", said.append)
    assert rec["error"] is None and rec["file"] == "cost_curve.json", rec
    assert rec["strategies"] == ["autoregressive"] and rec["seconds"] > 0
    prof = json.loads((tmp_path / "cost_curve.json").read_text())
    assert prof["kind"] == "engine_profile" and list(prof["strategies"]) == ["autoregressive"]
    fwd = prof["strategies"]["autoregressive"]["forward"]
    assert {p["batch_size"] for p in fwd} == {1, 2, 4, 8, 16, 32}
    assert all(p["cpu_ms"] > 0 for p in fwd)
    assert "engine profile" in said[0]


def test_a_run_without_profiled_engines_gets_a_reason_and_no_file(tmp_path):
    # vllm-ngram is not in the default configs/serve.yaml: no engine of the run to time
    rec = engine_profile.take(tmp_path, ["vllm-ngram"], "", lambda m: None)
    assert rec["file"] is None and "embedded or vLLM engine" in rec["error"]
    assert not (tmp_path / "cost_curve.json").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [")
    rec = engine_profile.take(tmp_path, ["autoregressive"], str(bad), lambda m: None)
    assert rec["file"] is None and rec["error"].startswith("exit ")
