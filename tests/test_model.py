"""Our model implementation against transformers on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.config import DEFAULT_TARGET
from actors.engine.kv_cache import KVCache
from actors.engine.model import BatchMeta, CausalLM, ModelConfig


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor(ids)).logits


def test_embedded_target_matches_transformers(heldout_prompts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_TARGET))
    ids = [tok(heldout_prompts[0]["prompt"])["input_ids"][:64]]
    ours = CausalLM.from_pretrained(DEFAULT_TARGET)
    with torch.inference_mode():
        mine = ours(torch.tensor(ids)).logits
    ref = _hf_logits(DEFAULT_TARGET, ids)
    assert (mine - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_family_matches_transformers_random_weights(model_type, tmp_path):
    """Random tiny Llama / Qwen2 / Qwen3 saved by transformers load into our model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=97, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 97, (2, 20))
    with torch.inference_mode():
        ref = hf(ids).logits
        mine = CausalLM.from_pretrained(tmp_path)(ids).logits
    assert (mine - ref).abs().max().item() <= 1e-4


def test_cached_ragged_forward_equals_plain_forward():
    """Rows at different positions of the slot cache give the same logits as
    a plain forward over each full sequence."""
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="qwen3", vocab_size=50, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=64)
    m = CausalLM(cfg).eval()
    seqs = [torch.randint(0, 50, (n,)) for n in (11, 5, 17)]
    cache = KVCache(cfg, 4, 64)
    with torch.inference_mode():
        # prefill all but the last 3 tokens, then 3 tokens in one ragged batch
        for slot, s in enumerate(seqs):
            m(s[None, :-3], cache=cache, meta=BatchMeta(torch.tensor([slot]), torch.tensor([0]),
                                                        len(s) - 3))
        ids = torch.stack([s[-3:] for s in seqs])
        starts = torch.tensor([len(s) - 3 for s in seqs])
        out = m(ids, cache=cache, meta=BatchMeta(torch.arange(3), starts,
                                                 int((starts + 3).max()))).logits
        for b, s in enumerate(seqs):
            ref = m(s[None]).logits[0, -3:]
            assert (out[b] - ref).abs().max().item() <= 1e-5


def test_random_init_embedding_is_nn_embeddings_init():
    """Off the meta device the backbone's embedding gets nn.Embedding's own init (normal_,
    same RNG draws): a random-weight model is initialised, finite, and seeded alike."""
    import json

    cfg = ModelConfig.from_hf_dict(json.loads((DEFAULT_TARGET / "config.json").read_text()))
    torch.manual_seed(0)
    got = CausalLM(cfg).model.embed_tokens.weight
    torch.manual_seed(0)
    want = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).weight
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


_STARTUP_IMPORTS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import actors.serve.app, actors.serve.deployments, actors.serve.async_engine
replica = {m: m in sys.modules for m in ("torch", "transformers")}
from actors.engine.config import EngineConfig
from actors.engine.llm_engine import LLMEngine
eng = LLMEngine(EngineConfig(strategy="draft_model", draft_model="models/draft"))
engine = {m: m in sys.modules for m in ("torch._dynamo", "sympy")}
print(json.dumps({"replica": replica, "engine": engine,
                  "fast_tokenizer": isinstance(eng.tokenizer, __import__("transformers").PreTrainedTokenizerFast),
                  "meta": [n for n, p in eng.model.named_parameters() if p.is_meta]}))
"""


def test_start_up_imports_stay_light():
    """What each process of a service imports at start-up, in a fresh interpreter: a Serve
    replica's modules import neither torch nor transformers (its engine runs in its own
    process), and an engine loads its models without torch._dynamo or sympy (2.7 s and
    0.7 s of every engine process's start-up); every parameter is materialised."""
    import json
    import subprocess
    import sys

    from pathlib import Path

    repo = str(Path(__file__).resolve().parent.parent)
    r = subprocess.run([sys.executable, "-c", _STARTUP_IMPORTS, repo], cwd=repo,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["replica"] == {"torch": False, "transformers": False}, got
    assert got["engine"] == {"torch._dynamo": False, "sympy": False}, got
    assert got["meta"] == [] and got["fast_tokenizer"] is True, got
