"""``python -m bench.step_cost`` on a tiny shape (CPU), the preset table, and
``analysis plan --cost-curve`` reading the grid file."""

from __future__ import annotations

import json

import pytest
import torch

from bench.step_cost import main as step_cost_main
from bench.step_cost import SHAPES, shape_config
from actors.engine.model import CausalLM, ModelConfig
from analysis.decide.plan import PointsCurve


def _params(name: str) -> int:
    with torch.device("meta"):
        return CausalLM(ModelConfig.from_hf_dict(shape_config(name))).num_params()


def test_presets_have_the_published_sizes():
    # total parameters (embeddings included, tied ones once) from each model card
    assert _params("qwen3-0.6b") == pytest.approx(0.596e9, rel=0.01)
    assert _params("qwen3-4b") == pytest.approx(4.02e9, rel=0.01)
    assert _params("qwen3-8b") == pytest.approx(8.19e9, rel=0.01)
    assert _params("llama-3-8b") == pytest.approx(8.03e9, rel=0.01)
    assert SHAPES["qwen3-4b"]["num_hidden_layers"] == 36 and SHAPES["qwen3-4b"]["hidden_size"] == 2560
    assert shape_config("embedded")["model_type"] == "qwen3"


def test_cost_curve_tiny_on_cpu_and_plan_reads_it(tmp_path, capsys):
    out = tmp_path / "curve.json"
    rc = step_cost_main(["--shape", "tiny", "--random-weights", "--device", "cpu",
                     "--batches", "1,3", "--tokens-per-row", "1,4", "--contexts", "16,40",
                     "--repeats", "2", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["shape"] == "tiny" and data["device"] == "cpu" and data["random_weights"]
    pts = data["points"]
    assert len(pts) == 2 * 2 * 2
    assert {(p["batch_size"], p["tokens_per_row"], p["context_len"]) for p in pts} == {
        (b, q, c) for b in (1, 3) for q in (1, 4) for c in (16, 40)}
    assert all(p["step_ms"] > 0 and p["batch_tokens"] == p["batch_size"] * p["tokens_per_row"]
               for p in pts)
    curve = PointsCurve.from_file(out)
    assert curve.tokens == (1.0, 3.0, 4.0, 12.0)          # B x q at the largest context
    assert list(curve.ms) == sorted(curve.ms)              # made non-decreasing
    assert float(curve(24.0)) >= curve.ms[-1]


def test_cost_curve_bad_flags_exit_2(tmp_path):
    with pytest.raises(SystemExit) as e:
        step_cost_main(["--shape", "nope", "--random-weights", "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        step_cost_main(["--shape", "tiny", "--random-weights", "--contexts", "5000",
                    "--out", str(tmp_path / "x")])
    assert e.value.code == 2
