"""The C kernel of the compiled flat forward's attention (``specload::flat_attention``,
``actors.engine.attention_kernel``): each token's attention equals SDPA over its own
slot's positions 0..pos, for runs of same-slot tokens shorter and longer than its tile,
GQA groups of 1, 2 and 4 and head sizes 16, 32, 64 and 128; bad input is refused with a
ValueError; each CPU gets its own build; without a C compiler the op says it is not built."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import pytest

from actors.engine import attention_kernel, kernel_build
from actors.engine.attention_kernel import TILE

flat_attention = torch.ops.specload.flat_attention


def _reference(q, ck, cv, slot, pos):
    """Token by token: SDPA of q[t] [h, D] over ck/cv[slot[t], :pos[t] + 1] (GQA)."""
    h, kvh = q.shape[1], ck.shape[2]
    outs = []
    for t in range(q.shape[0]):
        n = int(pos[t]) + 1
        k = ck[slot[t], :n].transpose(0, 1).repeat_interleave(h // kvh, 0)   # [h, n, D]
        v = cv[slot[t], :n].transpose(0, 1).repeat_interleave(h // kvh, 0)
        outs.append(F.scaled_dot_product_attention(q[t][:, None], k, v)[:, 0])
    return torch.stack(outs)


def _batch(gen, S, L, h, D, rows):
    """rows: [(slot, start, n)]: n consecutive positions from start in that slot."""
    slot = torch.tensor([s for s, _, n in rows for _ in range(n)])
    pos = torch.tensor([st + i for _, st, n in rows for i in range(n)])
    return torch.randn(len(slot), h, D, generator=gen), slot, pos


@pytest.mark.parametrize("h,kvh,D", [(4, 2, 64), (4, 4, 16), (8, 2, 32), (4, 1, 128)])
def test_kernel_equals_sdpa_per_token(h, kvh, D):
    assert attention_kernel.load() is not None, "no C compiler: the kernel did not build"
    gen = torch.Generator().manual_seed(h * 100 + kvh * 10 + D)
    S, L = 9, 300
    ck = torch.randn(S, L, kvh, D, generator=gen)
    cv = torch.randn(S, L, kvh, D, generator=gen)
    cases = [
        [(3, 0, 1)],                                          # one token at position 0
        [(0, 41, 1), (5, 7, 1), (2, 250, 1), (8, 0, 1)],      # decodes, scattered slots
        [(1, 30, 4), (4, 100, 1), (6, 12, 3)],                # uneven verify rows
        [(2, 0, TILE + 5)],                                   # a prompt chunk over a tile
        [(7, 60, 2), (7, 62, 2 * TILE + 1), (0, 5, 2)],       # one slot twice in a row
        [(3, 290, 9), (4, 0, 9)],                             # near the end of the slot
    ]
    for rows in cases:
        q, slot, pos = _batch(gen, S, L, h, D, rows)
        got = flat_attention(q, ck, cv, slot, pos, D ** -0.5)
        want = _reference(q, ck, cv, slot, pos)
        assert got.shape == (len(slot), h, D)
        assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (rows, float((got - want).abs().max()))
    # a non-contiguous q (the model passes q transposed) and tokens out of slot order
    q, slot, pos = _batch(gen, S, L, h, D, [(5, 10, 3), (1, 99, 2)])
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not qt.is_contiguous()
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert torch.allclose(flat_attention(qt[perm], ck, cv, slot[perm], pos[perm], D ** -0.5),
                          _reference(q, ck, cv, slot, pos)[perm], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("h,kvh,D", [(4, 2, 64), (4, 1, 128), (8, 2, 64)])
def test_simd_code_equals_plain_loops_at_every_key_tail(h, kvh, D):
    """The AVX-512 code (16 keys a block, queries grouped for the weighted sum) against the
    plain C loops and SDPA: key counts 1..40 (every tail of a 16-key block, 0 and 16
    included) and runs of 1..TILE + 3 tokens (groups of queries cut anywhere)."""
    if not attention_kernel.simd_built():
        pytest.skip("this CPU's build has no AVX-512 attention code")
    gen = torch.Generator().manual_seed(7 * h + D)
    S, L = 3, 64
    ck = torch.randn(S, L, kvh, D, generator=gen)
    cv = torch.randn(S, L, kvh, D, generator=gen)
    for start in range(0, 40):
        for n in (1, 3, TILE, TILE + 3):
            if start + n > L:
                continue
            q, slot, pos = _batch(gen, S, L, h, D, [(start % S, start, n)])
            fast = attention_kernel.flat_attention(q, ck, cv, slot, pos, D ** -0.5)
            plain = attention_kernel.flat_attention(q, ck, cv, slot, pos, D ** -0.5, simd=False)
            want = _reference(q, ck, cv, slot, pos)
            assert torch.allclose(fast, want, atol=2e-6, rtol=1e-5), (start, n)
            assert torch.allclose(fast, plain, atol=2e-6, rtol=1e-5), (start, n)


def test_kernel_refuses_bad_input():
    ck = torch.zeros(4, 32, 2, 16)
    q = torch.zeros(3, 4, 16)
    ok = (torch.tensor([0, 1, 3]), torch.tensor([0, 5, 31]))
    flat_attention(q, ck, ck, *ok, 0.25)
    with pytest.raises((ValueError, RuntimeError), match="float32"):
        flat_attention(q.double(), ck.double(), ck.double(), *ok, 0.25)
    with pytest.raises(ValueError, match="slot outside 0..3"):
        flat_attention(q, ck, ck, torch.tensor([0, 4, 1]), ok[1], 0.25)
    with pytest.raises(ValueError, match="position outside 0..31"):
        flat_attention(q, ck, ck, ok[0], torch.tensor([0, 32, 1]), 0.25)
    with pytest.raises(ValueError, match="shapes"):
        flat_attention(torch.zeros(3, 3, 16), ck, ck, *ok, 0.25)     # 3 heads over 2 K/V heads
    with pytest.raises(ValueError, match="shapes"):
        flat_attention(q, ck, ck, ok[0][:2], ok[1], 0.25)


def test_kernel_builds_into_its_cache_dir_per_cpu_and_without_a_compiler_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLOAD_KERNEL_CACHE", str(tmp_path / "k"))
    attention_kernel.load.cache_clear()
    try:
        assert attention_kernel.load() is not None
        assert [p.suffix for p in (tmp_path / "k").glob("*.so")] == [".so"]
        # the outcome is recorded in the cache's status.json (the run manifest's kernels)
        status = kernel_build.build_status()
        assert status["kernels"]["flat_attention"]["status"] == "built"
        assert status["cache_dir"] == str(tmp_path / "k")
        attention_kernel.load.cache_clear()
        attention_kernel.load()
        assert kernel_build.build_status()["kernels"]["flat_attention"]["status"] == "cached"
        # another CPU sharing the cache directory builds its own (-march=native)
        monkeypatch.setattr(kernel_build, "cpu_id", lambda: "another cpu")
        attention_kernel.load.cache_clear()
        assert attention_kernel.load() is not None
        assert sorted(p.suffix for p in (tmp_path / "k").glob("*.so")) == [".so", ".so"]
        monkeypatch.setenv("SPECLOAD_KERNEL_CACHE", str(tmp_path / "none"))
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-cxx"))
        attention_kernel.load.cache_clear()
        assert attention_kernel.load() is None
        # ... and its absence, with the fallback that runs instead
        got = kernel_build.build_status()
        assert got["kernels"]["flat_attention"]["status"] == "unavailable"
        assert got["kernels"]["flat_attention"]["fallback"] == "the torch form is used"
        assert got["compiler_found"] is False
        assert kernel_build.report()["flat_attention"]["status"] == "unavailable"
        with pytest.raises(RuntimeError, match="not built"):
            flat_attention(torch.zeros(2, 2, 8), torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8),
                           torch.tensor([0, 1]), torch.tensor([0, 1]), 1.0)
    finally:
        monkeypatch.undo()
        attention_kernel.load.cache_clear()


_LOAD_AND_SAY = """
import json, sys, time
from actors.engine import kernel_build
t = time.monotonic()
k = kernel_build.load_ops()
print(json.dumps({"status": k.outcome["status"], "s": time.monotonic() - t,
                  "n": int(k.ops.build_info()[0])}))
"""


def test_processes_that_start_together_build_the_library_once(tmp_path):
    """Two processes (as a deployment's replicas, or test workers) that need the kernels
    at once on an empty cache: one builds, the other waits on the build lock and loads its
    library (``cached``), and the cache holds one library. Both processes are this test's
    own, started with Popen and waited for (bounded)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "SPECLOAD_KERNEL_CACHE": str(tmp_path / "k")}
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_AND_SAY], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sorted(o["status"] for o in outs) == ["built", "cached"]
    assert len(list((tmp_path / "k").glob("kernels-*.so"))) == 1
    assert outs[0]["n"] == outs[1]["n"]          # the same build's ISA, read by both
