"""The prepared device check (``python -m bench.device_check``) on CPU with its tiny shape:
the same code path a GPU loan runs, so it is known to work before device time is spent."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from bench import device_check as gpu_check

ROOT = Path(__file__).resolve().parents[1]

# an import hook that refuses the packages the GPU machine lacks
BLOCK = """
import sys, importlib.abc
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('pydantic', 'ray', 'vllm', 'scipy', 'matplotlib', 'httpx'):
            raise ImportError('blocked: ' + name)
        return None
sys.meta_path.insert(0, _Block())
import runpy
sys.argv = ['bench.device_check'] + sys.argv[1:]
runpy.run_module('bench.device_check', run_name='__main__', alter_sys=True)
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([sys.executable, "-m", "bench.device_check", "--out", str(out),
                           "--device", "cpu", "--tiny"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, json.loads((out / "gpu_check.json").read_text())


def test_engine_identity_every_strategy_and_dtype(tiny_run):
    _, d = tiny_run
    eng = d["sections"]["engine"]
    assert eng["skipped"] == []
    assert sorted(eng["identity"]) == sorted(f"{s}/{t}" for s in gpu_check.STRATEGIES
                                             for t in ("float32", "bfloat16"))
    for key, r in eng["identity"].items():
        assert r["total"] == eng["prompts"] == 2
        assert r["identical"] + r["ties"] + r["mismatches"] == r["total"]
        # the committed models in fp32: every strategy's greedy text is the target's
        if key.endswith("float32"):
            assert r["identical"] == r["total"], (key, r["diverged"])


def test_engine_tokens_per_s(tiny_run):
    _, d = tiny_run
    tps = d["sections"]["engine"]["tokens_per_s"]
    assert set(tps) == set(gpu_check.STRATEGIES)
    for strategy, by_b in tps.items():
        assert set(by_b) == {"1", "2"}
        for r in by_b.values():
            assert r["output_tokens"] == r["requests"] * gpu_check.ENGINE["tiny"]["max_tokens"]
            assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
            assert r["tokens_per_s"] > 0


def test_curve_grid_complete_and_readable_by_the_planner(tiny_run):
    out, d = tiny_run
    grid = gpu_check.GRID["tiny"]
    rec = d["sections"]["curves"]["shapes"]["tiny"]
    assert rec["skipped"] == []
    curve = json.loads(Path(rec["file"]).read_text())
    cells = {(p["batch_size"], p["tokens_per_row"], p["context_len"]) for p in curve["points"]}
    assert cells == {(b, q, c) for b in grid["batches"] for q in grid["tokens_per_row"]
                     for c in grid["contexts"]}
    assert all(p["step_ms"] > 0 and p["cpu_ms"] > 0 for p in curve["points"])
    assert curve["device"] == "cpu" and curve["torch"] and curve["date"]
    vm = rec["verify_multiple"][str(grid["contexts"][0])]
    assert set(vm) == {str(b) for b in grid["batches"]}
    for b, row in vm.items():
        assert row["1"] == 1.0
        p1 = next(p for p in curve["points"] if p["batch_size"] == int(b)
                  and p["tokens_per_row"] == 1)
        p5 = next(p for p in curve["points"] if p["batch_size"] == int(b)
                  and p["tokens_per_row"] == 5)
        assert row["5"] == pytest.approx(p5["cpu_ms"] / p1["cpu_ms"])
    # the planner reads the same file (one format)
    from analysis.decide.plan import PointsCurve
    pc = PointsCurve.from_file(rec["file"])
    assert len(pc.tokens) >= 2 and all(m > 0 for m in pc.ms)


def test_png_written(tiny_run):
    out, d = tiny_run
    png = (out / "verify_multiple.png").read_bytes()
    assert d["png"] == str(out / "verify_multiple.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", png[16:24])
    assert (w, h) == (640, 400)
    # the IDAT decompresses to H rows of 1 + 3W bytes, some not white (lines drawn)
    n = struct.unpack(">I", png[33:37])[0]
    raw = zlib.decompress(png[41:41 + n])
    assert len(raw) == h * (1 + 3 * w)
    assert raw.count(b"\xff") < len(raw) - h


def test_status_done_and_json_strict(tiny_run):
    out, d = tiny_run
    assert d["status"] == "done" and d["env"]["device"] == "cpu"
    json.loads((out / "gpu_check.json").read_text(), parse_constant=lambda c: 1 / 0)


def test_runs_without_pydantic_ray_vllm(tmp_path):
    """What the GPU machine lacks is refused at import: the module and the curves run,
    the engine section is recorded as skipped with its reason."""
    proc = subprocess.run([sys.executable, "-c", BLOCK, "--out", str(tmp_path), "--device", "cpu",
                           "--tiny"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "pydantic" in d["sections"]["engine"]["skipped"]
    assert d["sections"]["curves"]["shapes"]["tiny"]["points"] == 9


def test_bad_flags_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path), "--sections", "engine,bogus"])
    assert e.value.code == 2
    assert "--sections" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path), "--budget-s", "0"])
    assert e.value.code == 2


def test_summary_restates_the_sections(tiny_run):
    _, d = tiny_run
    s = d["summary"]
    r = d["sections"]["engine"]["identity"]["dflash/float32"]
    assert s["identity"]["dflash/float32"] == f"{r['identical']}/{r['ties']}/{r['mismatches']} of 2"
    vm = d["sections"]["curves"]["shapes"]["tiny"]["verify_multiple"]["64"]
    assert s["verify5_multiple"]["tiny"]["64"] == {b: row["5"] for b, row in vm.items()}
