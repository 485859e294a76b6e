"""The bf16-weight linear kernel (``actors.engine.linear_kernel``) and the model's use of it.

The kernel must give what float32 ``mm`` gives on the same (bfloat16-valued) weights, up
to the order of float32 sums; refuse what it cannot serve; and the model must use it only
where every linear weight is a bfloat16 value, without folding the RMSNorm weights in.
"""
from __future__ import annotations

import pytest
import torch

from actors.engine import linear_kernel
from actors.engine.config import DEFAULT_DRAFT, DEFAULT_TARGET
from actors.engine.model import CausalLM, ModelConfig, linear_t, transposed


def _bf16_weight(k: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, n, generator=g) * 0.05).to(torch.bfloat16).float()


@pytest.mark.parametrize("k,n", [(256, 512), (768, 256), (256, 4096), (64, 64), (100, 192)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9])
def test_kernel_equals_float32_mm(k, n, m):
    assert linear_kernel.load() is not None, "no C compiler: the kernel did not build"
    wt = _bf16_weight(k, n, k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    packed = linear_kernel.pack(wt)
    assert packed.shape == (n // 64, k, 64) and packed.dtype == torch.bfloat16
    got = linear_kernel.linear_packed(x, packed)
    ref = x.double() @ wt.double()
    # float32 sums in k order vs float64: ~k ulps of the largest partial sums at most
    tol = 8 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ wt.abs().double())
    assert got.shape == (m, n) and ((got.double() - ref).abs() <= tol + 1e-12).all()
    # rows of a strided view (a slice of a wider activation) read the same
    wide = torch.zeros(m, k + 32)
    wide[:, 16:16 + k] = x
    assert torch.equal(linear_kernel.linear_packed(wide[:, 16:16 + k], packed), got)


def test_pack_refuses_what_the_kernel_cannot_serve():
    w = _bf16_weight(256, 512, 0)
    assert linear_kernel.pack(w[:, :100].contiguous()) is None          # N not a multiple of 64
    not_bf16 = w.clone()
    not_bf16[3, 7] += 1e-4                                               # one float32-only value
    assert not linear_kernel.bf16_exact(not_bf16) and linear_kernel.pack(not_bf16) is None
    assert linear_kernel.pack(w.double()) is None
    packed = linear_kernel.pack(w)
    with pytest.raises(ValueError, match="linear_packed"):
        linear_kernel.linear_packed(torch.randn(2, 255), packed)           # K mismatch
    with pytest.raises(ValueError, match="linear_packed"):
        linear_kernel.linear_packed(torch.randn(2, 256).double(), packed)
    # linear_t: over max_rows() rows (8; 1024 with the AVX-512 code) the float32 mm runs,
    # under it the kernel: the same values
    x = torch.randn(linear_kernel.max_rows() + 3, 256)
    many = linear_t(x, w, packed=packed)
    few = linear_t(x[:4], w, packed=packed)
    assert torch.equal(many, torch.mm(x, w))
    assert torch.allclose(few, torch.mm(x[:4], w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", [DEFAULT_TARGET, DEFAULT_DRAFT])
def test_embedded_checkpoints_run_packed_and_unfolded(path):
    """The embedded checkpoints are bfloat16: every projection and the LM head get packed
    copies, the norms stay unfolded, and a decode batch's logits equal the float32 path's."""
    m = CausalLM.from_pretrained(path)
    assert m.packable()
    layer = m.model.layers[0]
    assert not layer.norm_folded
    att, mlp = layer.self_attn, layer.mlp
    for t in (att.qkv_packed, att.o_packed, mlp.gate_up_packed, mlp.down_packed, m.lm_packed):
        assert t is not None and t.dtype == torch.bfloat16
    ids = torch.randint(1, m.config.vocab_size, (4, 1))
    with torch.inference_mode():
        got = m(ids).logits
        ref = CausalLM.from_pretrained(path)
        ref.fuse(False)           # the plain nn.Linear forward: float32 mm, norms applied
        want = ref(ids).logits
    assert (got - want).abs().max().item() < 1e-4


def test_float32_weights_stay_folded_on_mm():
    """A model whose weights are not all bfloat16 values (random float32) keeps the folded
    float32 path: no packed copies (the kernel would round its weights)."""
    cfg = ModelConfig(model_type="qwen3", max_position_embeddings=64, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    m = CausalLM(cfg).eval()
    m.fuse()
    assert not m.packable() and m.model.layers[0].norm_folded and m.lm_packed is None
    assert m.model.layers[0].self_attn.qkv_packed is None


def test_without_a_compiler_the_kernel_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLOAD_KERNEL_CACHE", str(tmp_path / "none"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-cxx"))
    linear_kernel.load.cache_clear()
    try:
        assert linear_kernel.load() is None
        assert linear_kernel.pack(_bf16_weight(64, 64, 1)) is None
        with pytest.raises(RuntimeError, match="not built"):
            linear_kernel.linear_packed(torch.zeros(1, 64), torch.zeros(1, 64, 64, dtype=torch.bfloat16))
        monkeypatch.setenv("SPECLOAD_KERNEL_CACHE", str(tmp_path / "k"))
        monkeypatch.delenv("CXX")
        linear_kernel.load.cache_clear()
        assert linear_kernel.load() is not None
        assert [p.name.split("-")[0] for p in (tmp_path / "k").glob("*.so")] == ["kernels"]
    finally:
        monkeypatch.undo()
        linear_kernel.load.cache_clear()


def test_kernels_honour_torch_threads():
    """The products take ``torch.get_num_threads()`` (``sync_threads``): with 2 threads a
    product split between them gives the same values as with 1 (each 64-column block is
    computed whole by one thread: the same sums in the same order), the library then
    holds 2, and the build records whether OpenMP was there (``openmp``)."""
    from actors.engine.kernel_build import report

    lib = linear_kernel.load()
    assert lib is not None
    gen = torch.Generator().manual_seed(3)
    wt = torch.randn(256, 1536, generator=gen).to(torch.bfloat16).float()
    packed = linear_kernel.pack(wt)
    x = torch.randn(8, 256, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_kernel.linear_packed(x, packed)
        assert lib.threads == 1
        torch.set_num_threads(2)
        two = linear_kernel.linear_packed(x, packed)
        assert lib.threads == 2
        assert lib.ops.build_info()[4] == (2 if lib.openmp else 1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert report()["linear_bf16"]["openmp"] is lib.openmp
