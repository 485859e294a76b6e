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
