"""Bad command-line input: exit 2, one error line naming the flag, no traceback, nothing started.

Covers ``python -m loadgen``, ``python -m analysis``, ``python -m cluster up/down`` and
``python -m bench.serving_overhead``: non-finite and out-of-range numbers, ports, path flags
(missing, a directory for a file, a file for a directory, a missing parent), run ids that
exist or escape ``--results``, and Serve configs that fail validation (checked before Ray
starts). Most cases call the parser in-process; a few run the real command as a subprocess
to prove no traceback reaches the user.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from configs.paths import CONFIGS_DIR

REPO = Path(__file__).resolve().parent.parent


def _exit2(capsys, fn, argv: list[str], flag: str) -> str:
    """Run ``fn(argv)``; assert SystemExit 2 and ``flag`` on the last stderr line."""
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert flag in last, err
    assert "Traceback" not in err
    return last


def _run(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


# ----------------------------------------------------------------- loadgen

@pytest.mark.parametrize("extra, flag, text", [
    (["--duration", "inf"], "--duration", "finite"),
    (["--duration", "nan"], "--duration", "finite"),
    (["--duration", "0"], "--duration", "> 0"),
    (["--warmup-s", "nan"], "--warmup-s", "finite"),
    (["--warmup-s", "-1"], "--warmup-s", ">= 0"),
    (["--retry-backoff-s", "inf"], "--retry-backoff-s", "finite"),
    (["--max-prompt-chars", "-5"], "--max-prompt-chars", ">= 1"),
    (["--max-prompt-chars", "0"], "--max-prompt-chars", ">= 1"),
    (["--local-port", "70000"], "--local-port", "<= 65535"),
    (["--local-port", "0"], "--local-port", ">= 1"),
    (["--workers", "-1"], "--workers", ">= 0"),
    (["--repeats", "0"], "--repeats", ">= 1"),
    (["--sweep", "--sweep-factor", "nan"], "--sweep-factor", "finite"),
    (["--tiers-file", "/"], "--tiers-file", "directory"),
    (["--tiers-file", "/nonexistent/tiers.yaml"], "--tiers-file", "does not exist"),
    (["--local-config", "/nonexistent.yaml"], "--local-config", "does not exist"),
    (["--local-config", "/"], "--local-config", "directory"),
    (["--run-id", "../../x"], "--run-id", "plain name"),
    (["--run-id", "a/b"], "--run-id", "plain name"),
    (["--strategies", ""], "--strategies", "expected comma-separated"),
    (["--strategies", "ngram,,dflash"], "--strategies", "expected comma-separated"),
    (["--strategies", "ngram,autoregressive,ngram"], "--strategies", "ngram named twice"),
    (["--consistency-dtype", "fp8"], "--consistency-dtype", "invalid choice"),
    (["--consistency-tie-tolerance", "-1"], "--consistency-tie-tolerance", ">= 0"),
    (["--route", "direct", "--model", "x"], "--route direct", "do not combine"),   # before any start
    (["--route", "strategy", "--model", "x"], "--route strategy", "do not combine"),
])
def test_loadgen_bad_flag(capsys, extra, flag, text):
    from loadgen.cli.args import parse_args

    last = _exit2(capsys, parse_args, ["--tier", "low", *extra], flag)
    assert text in last, last


def test_loadgen_results_is_a_file(capsys, tmp_path):
    from loadgen.cli.args import parse_args

    f = tmp_path / "afile"
    f.write_text("x")
    assert "file" in _exit2(capsys, parse_args, ["--tier", "low", "--results", str(f)], "--results")
    _exit2(capsys, parse_args, ["--tier", "low", "--results", str(f / "sub")], "--results")


def test_loadgen_run_id_exists(capsys, tmp_path):
    """A second run with the same --run-id is refused before it connects, and the first
    run's directory is untouched."""
    from loadgen.cli.args import parse_args

    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "manifest.json").write_text("{}")
    last = _exit2(capsys, parse_args, ["--tier", "low", "--results", str(tmp_path), "--run-id", "r1"],
                  "--run-id")
    assert "exists" in last
    assert (tmp_path / "r1" / "manifest.json").read_text() == "{}"
    args = parse_args(["--tier", "low", "--results", str(tmp_path), "--run-id", "r2"])
    assert args.run_id == "r2" and args.duration is None and args.local_port == 8000


def test_loadgen_subprocess_profile_and_tier_dir(tmp_path):
    """End to end: a directory as --tiers-file (was IsADirectoryError) and an unknown
    --profile (was a quoted KeyError text) exit 2 naming the flag, before any connection."""
    p = _run("loadgen", "--tier", "low", "--tiers-file", "/", "--results", str(tmp_path / "r"))
    assert p.returncode == 2 and "--tiers-file" in p.stderr and "Traceback" not in p.stderr
    p = _run("loadgen", "--tier", "low", "--profile", "bogus", "--target", "http://127.0.0.1:9",
             "--results", str(tmp_path / "r"))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "python -m loadgen: error: --profile: profile 'bogus' not in tier file" in p.stderr
    assert '"' not in p.stderr
    assert "Traceback" not in p.stdout + p.stderr and not (tmp_path / "r").exists()


# ---------------------------------------------------------------- analysis

def _analysis(argv):
    from analysis.cli import main

    return main(argv)


def test_analysis_bad_flags(capsys, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    run = tmp_path / "run"   # a run directory is only read after the flags pass
    run.mkdir()
    _exit2(capsys, _analysis, ["report", str(run), "--warmup-s", "nan"], "--warmup-s")
    _exit2(capsys, _analysis, ["report", str(run), "--slo-ttft-ms", "inf"], "--slo-ttft-ms")
    _exit2(capsys, _analysis, ["report", str(run), "--out", str(f)], "--out")
    assert "does not exist" in _exit2(capsys, _analysis,
                                      ["report", str(run), "--baseline", "/nonexistent"], "--baseline")
    base = ["plan", str(run), "--qps", "1", "--tier", "low"]
    _exit2(capsys, _analysis, base + ["--cost-curve", "/nonexistent.json"], "--cost-curve")
    assert "does not exist" in _exit2(
        capsys, _analysis, base + ["--emit-serve-config", str(tmp_path / "no" / "plan.yaml")],
        "--emit-serve-config")
    assert not (tmp_path / "no").exists()
    _exit2(capsys, _analysis, ["plan", str(run), "--qps", "nan", "--tier", "low"], "--qps")
    _exit2(capsys, _analysis, ["plan", str(run), "--qps", "1", "--tier", "low", "--max-num-seqs",
                               "0"], "--max-num-seqs")
    _exit2(capsys, _analysis, ["plan", str(run), "--qps", "1", "--tier", "low", "--max-waiting",
                               "-1"], "--max-waiting")
    _exit2(capsys, _analysis, ["backtest", str(run), "--holdout", "0"], "--holdout")


def test_analysis_plan_missing_dir_first(capsys):
    """The missing RESULTS_DIR is the only output (no SLO-defaults line before it)."""
    assert _analysis(["plan", "/nonexistent/dir", "--qps", "1", "--tier", "low"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "/nonexistent/dir does not exist" in cap.err


# ----------------------------------------------------------------- cluster

def _cluster(argv):
    from cluster.__main__ import main

    return main(argv)


def _typo_config(tmp_path: Path) -> Path:
    """configs/serve.yaml with a misspelt ngram option (prompt_lookup_mx)."""
    cfg = yaml.safe_load((CONFIGS_DIR / "serve.yaml").read_text())
    for app in cfg["applications"]:
        for e in (app.get("args") or {}).get("strategies", []):
            if e["engine"]["strategy"] == "ngram":
                e["engine"]["strategy_options"] = {"prompt_lookup_mx": 3}
    out = tmp_path / "typo.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def test_cluster_bad_flags(capsys, tmp_path):
    from configs.net import free_port

    port = str(free_port())
    _exit2(capsys, _cluster, ["up", "--port", "70000"], "--port")
    _exit2(capsys, _cluster, ["down", "--port", "0"], "--port")
    _exit2(capsys, _cluster, ["up", "--timeout", "inf"], "--timeout")
    _exit2(capsys, _cluster, ["up", "--direct-ingress", "--no-direct-ingress", "--port", port],
           "--direct-ingress/--no-direct-ingress")
    _exit2(capsys, _cluster, ["up", "--config", "/nonexistent.yaml", "--port", port], "--config")
    _exit2(capsys, _cluster, ["up", "--config", str(tmp_path), "--port", port], "--config")
    bad = tmp_path / "bad.yaml"
    bad.write_text("strategies: []\n")
    _exit2(capsys, _cluster, ["up", "--config", str(bad), "--port", port], "--config")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({"applications": [{
        "name": "x", "import_path": "actors.serve.app:build_app",
        "args": {"strategies": [{"strategy": "ngram"}]}}]}))
    assert "Extra inputs" in _exit2(capsys, _cluster, ["up", "--config", str(wrong), "--port", port],
                                    "--config")


def test_cluster_up_typo_in_strategy_options_before_ray(tmp_path):
    """Subprocess: the strategy_options typo fails in seconds, before any Ray head starts
    (no 'starting a Ray head' line), naming --config, the strategy and the key."""
    from configs.net import free_port

    p = _run("cluster", "up", "--config", str(_typo_config(tmp_path)), "--port", str(free_port()))
    assert p.returncode == 2, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert "--config" in last and "'ngram'" in last and "prompt_lookup_mx" in last, last
    assert "Traceback" not in p.stderr and "Ray head" not in p.stderr


def test_cluster_up_port_in_use(capsys):
    """A port held by a server that is not specload: refused before Ray starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        last = _exit2(capsys, _cluster, ["up", "--port", str(port)], "--port")
    assert "in use" in last and str(port) in last
    assert f"pid {os.getpid()}" in last, last   # the message names the foreign listener


# ------------------------------------------------------------- bench_serve

@pytest.mark.parametrize("argv, flag", [
    (["--strategy", "bogus"], "--strategy"),
    (["--torch-threads", "0"], "--torch-threads"),
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens"),
    (["--num-cpus", "0"], "--num-cpus"),
    (["--json", "/nonexistent/out.json"], "--json"),
])
def test_bench_serve_bad_flag(capsys, argv, flag):
    from bench.serving_overhead import main

    _exit2(capsys, main, argv, flag)


@pytest.mark.slow
def test_cluster_up_failure_after_ray_started_stops_its_head(tmp_path):
    """A failure after `up` started its own Ray head (here: not ready within --timeout 1 s)
    exits non-zero and stops that head (its pid gone, its state file removed). Real Ray."""
    import re

    from configs.net import free_port

    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_RUNTIME_DIR=str(tmp_path))
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "cluster", "up", "--port", str(port), "--timeout", "1",
                        "--num-cpus", "1"], capture_output=True, text=True, timeout=240, cwd=REPO,
                       env=env)
    assert p.returncode != 0, p.stderr[-2000:]
    assert "not ready after 1s" in p.stderr and "Traceback" not in p.stderr
    assert "stopping the Ray head this command started" in p.stderr, p.stderr[-2000:]
    pid = int(re.search(r"stopping the Ray head \(pid (\d+)\)", p.stderr).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not (tmp_path / "specload" / f"cluster-{port}.json").exists()
