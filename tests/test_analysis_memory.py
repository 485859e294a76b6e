"""Memory arithmetic against hand-computed cases, and the memory cap in ``analysis plan``."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from analysis import cli
from analysis.data import memory as mem
from analysis.decide.plan import GPUS, plan
from configs import metric_names as mn
from tests import analysis_synth as syn


def test_kv_bytes_per_token_qwen3_4b():
    # 36 layers x 8 KV heads x 128 head dim x 2 (K, V) x 2 bytes (bf16)
    assert mem.kv_bytes_per_token(36, 8, 128, 2) == 147456
    assert mem.SHAPES["qwen3-4b"].kv_bytes_per_token() == 147456
    assert mem.SHAPES["qwen3-4b"].kv_bytes_per_token(4) == 294912
    # Llama-3.1-8B: 32 x 8 x 128 x 2 x 2
    assert mem.SHAPES["llama-3.1-8b"].kv_bytes_per_token() == 131072
    with pytest.raises(ValueError, match="num_kv_heads"):
        mem.kv_bytes_per_token(36, 0, 128)


def test_param_count_of_published_shapes():
    q4 = mem.SHAPES["qwen3-4b"]
    per_layer = (2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 3 * 2560 * 9728 + 2 * 2560 + 2 * 128)
    assert q4.num_params() == 151936 * 2560 + 36 * per_layer + 2560   # tied LM head
    assert q4.num_params() == 4_022_468_096                           # "4.0B" on its card
    assert 8.0e9 < mem.SHAPES["llama-3.1-8b"].num_params() < 8.1e9    # 8.03B on its card


def test_shape_from_config_file(tmp_path):
    cfg = {"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 2560,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = mem.resolve_shape(str(tmp_path))
    assert dataclasses.replace(shape, name="Qwen3-4B") == mem.SHAPES["qwen3-4b"]
    with pytest.raises(ValueError, match="neither a known name"):
        mem.resolve_shape("no-such-model")


def test_max_concurrent_sequences_hand_computed():
    # H100 80 GB x 0.9 = 72 GB; Qwen3-4B bf16 weights 8.044936192 GB; 4096-token sequences
    # hold 4096 * 147456 B = 603,979,776 B -> floor((72e9 - 8.044936192e9) / 603979776) = 105
    w = mem.SHAPES["qwen3-4b"].num_params() * 2
    per_seq = 4096 * 147456
    assert mem.max_concurrent_sequences(80e9, w, per_seq) == 105
    assert mem.max_concurrent_sequences(80e9, w, per_seq, utilization=1.0) == 119
    assert mem.max_concurrent_sequences(8e9, w, per_seq) == 0          # weights alone do not fit
    with pytest.raises(ValueError, match="per_sequence_bytes"):
        mem.max_concurrent_sequences(80e9, w, 0)


def test_gpu_memory_caps_scales_the_drafter():
    report = {"target_weight_bytes": 1000, "draft_weight_bytes": 250,
              "target_kv_bytes_per_token": 100, "draft_kv_bytes_per_token": 50}
    rows = mem.gpu_memory_caps(mem.SHAPES["qwen3-4b"], 80e9,
                               {("draft_model", "short"): 1000.0, ("ngram", "short"): 1000.0},
                               {"draft_model": report})
    dm, ng = rows
    w = mem.SHAPES["qwen3-4b"].num_params() * 2
    assert dm["weight_bytes"] == pytest.approx(1.25 * w)
    assert dm["kv_bytes_per_seq"] == pytest.approx(1.5 * 147456 * 1000)
    assert dm["max_seqs"] == int((72e9 - 1.25 * w) // (1.5 * 147456 * 1000))
    assert ng["max_seqs"] == int((72e9 - w) // (147456 * 1000))
    assert "not counted" in ng["draft_source"]


def test_memory_table_per_sequence():
    report = {"device": "cpu", "target_kv_bytes_per_token": 1024, "draft_kv_bytes_per_token": 1024,
              "target_weight_bytes": 10}
    req = pd.DataFrame({mn.REQ_STRATEGY: ["draft_model"] * 3, mn.REQ_STATUS: ["ok", "ok", "error"],
                        mn.REQ_OUTPUT_CLASS: ["short"] * 3, mn.REQ_PROMPT_TOKENS: [100, 200, 5000],
                        mn.REQ_OUTPUT_TOKENS: [24, 24, 0]})
    t = mem.memory_table({"draft_model": report, "bad": {"error": "404"}}, req)
    assert t["strategy"].tolist() == ["draft_model"]
    assert t["context_tokens_short"].iloc[0] == pytest.approx(174.0)         # (124 + 224) / 2
    assert t["kv_mib_per_seq_short"].iloc[0] == pytest.approx(2048 * 174 / 2 ** 20)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("planmem")
    strats = (syn.AR, dataclasses.replace(syn.DFLASH, draft_ms=0.0))
    return syn.write_run(root / "run", strats=strats)


def test_plan_caps_the_batch_by_memory(run_dir, tmp_path):
    # A Llama-2-7B shape (multi-head attention: 32 KV heads): 512 KiB of KV per token, so
    # ~840 sequences of ~133 tokens fit in 80 GB, fewer than the 1024 compute would allow.
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
           "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
           "intermediate_size": 11008, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = plan(run_dir, qps=10, tier="low", slo_ttft_ms=10_000, slo_tpot_ms=10_000, gpu="h100",
               model_shape=str(tmp_path / "config.json"))
    shape = mem.resolve_shape(str(tmp_path / "config.json"))
    bpt = 32 * 32 * 128 * 2 * 2
    assert shape.kv_bytes_per_token() == bpt
    mem_rows = {(r["strategy"], r["output_class"]): r for r in out["memory"]}
    gpu_rows = {(r["strategy"], r["output_class"]): r for r in out["gpu_plan"]}
    key = (mn.AUTOREGRESSIVE, "short")
    ctx = mem_rows[key]["context_tokens"]
    expect = int((GPUS["h100"].memory_bytes * 0.9 - shape.num_params() * 2) // (bpt * ctx))
    assert mem_rows[key]["max_seqs"] == expect and 0 < expect < 1024
    row = gpu_rows[key]
    assert row["limit"] == "memory" and row["users"] == expect
    assert row["note"].startswith(f"memory-bound: the KV cache fits {expect} sequences")
    assert any("KV bytes per token" in a for a in out["assumptions"])
    # without --model-shape the same plan is compute-bound at max_batch
    free = plan(run_dir, qps=10, tier="low", slo_ttft_ms=10_000, slo_tpot_ms=10_000, gpu="h100",
                model_params=float(shape.num_params()))
    assert {(r["strategy"], r["output_class"]): r for r in free["gpu_plan"]}[key]["users"] > expect


def test_plan_cli_model_shape_flags(run_dir, capsys):
    base = ["plan", str(run_dir), "--qps", "10", "--tier", "low", "--slo-ttft-ms", "1000",
            "--slo-tpot-ms", "1000"]
    with pytest.raises(SystemExit) as e:
        cli.main(base + ["--model-shape", "qwen3-4b"])
    assert e.value.code == 2 and "--model-shape only applies with --gpu" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(base + ["--gpu", "h100", "--model-shape", "nope"])
    assert e.value.code == 2 and "--model-shape" in capsys.readouterr().err
    assert cli.main(base + ["--gpu", "h200", "--model-shape", "qwen3-4b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(r["max_seqs"] > 0 for r in out["memory"])
    assert any("147456 KV bytes per token" in a for a in out["assumptions"])
