"""A C kernel for a linear layer of few rows whose weights are bfloat16 values (``linear_packed``).

A decode step at batch 1 on a CPU is a chain of matrix-vector products: every weight is
read from memory once per step and used for one multiply-add, so the step's time is the
weights' bytes over the memory bandwidth (on this project's 2-core box the 23 MB of the
embedded target's float32 weights took 4.3 ms of an 8.6 ms step, 25 ``mm`` calls averaging
174 us). The embedded checkpoints are stored in bfloat16 (``torch_dtype: bfloat16``, as
published LLM checkpoints are), so their float32 copies carry 16 zero low bits per
weight: half of every byte read is zeros. This kernel keeps such weights as their
bfloat16 bits and widens them in registers (a 16-bit shift: exact), multiplying float32
activations and summing in float32, so nothing is rounded that float32 ``mm`` would not
round; only the order of the sums differs (~1e-7 relative, as between two GEMM
libraries). It reads half the bytes: 1.7-2.1x faster than ``torch.mm`` over a step's 25
weights at 1 row, 1.5x at 4, 1.1x at 8, slower from 16 (measured here, one thread, the
AVX2 code), so there it serves batches of at most ``MAX_ROWS`` rows (decode and verify
steps) and prefill chunks stay on ``torch.mm`` and the float32 copies. Where the compiler
targets AVX-512 the kernel computes 6 rows x 64 columns per tile (24 zmm accumulators)
and widens without shuffles (the layout below): 130-145 GFLOP/s one thread from 6 rows
up, about MKL's float32 GEMM on L2-resident weights (measured here), and ahead of it on a
model's weights (read from L3 at half the bytes), so it serves up to ``MAX_ROWS_WIDE``
rows: a verify of any length runs on the same code as a decode (no cliff at 8 rows).
Batches of 7-12 rows run as one tile over each 32-column half instead (2 x rows
accumulators): the widening shares the FMA ports, and one load and two widens then serve
16-24 FMAs, where two 4-row tiles spent four widens on 16. Measured here (one thread,
[M, 256] x [256, 1536], Python call included): 12 rows 146 GFLOP/s (6 + 6 before: ~135),
24 rows 156, 8 rows 128 (124).

Layout: ``pack`` turns a ``linear_t`` weight [K, N] (N a multiple of 64) into
[N / 64, K, 64] bfloat16: each 64-column block is contiguous, so a block streams from
memory once and is reused from the caches for every row of the batch; with the AVX-512
code each 32-column half is interleaved (int32 lane i holds columns i and 16 + i:
``interleaved()``). AVX-512 or AVX2 + FMA intrinsics where the compiler targets them
(``-march=native``; ``isa()`` says which), plain C loops elsewhere.
Built by ``actors.engine.kernel_build`` at first use; ``load()`` returns None where no
compiler works, and ``SPECLOAD_LINEAR_KERNEL=0`` turns the kernel off (the float32 path
then runs alone, for side-by-side benchmarks).

A ``torch.compile`` graph (the compiled flat forward, traced once over dynamic batch
sizes) calls it as the ``specload::linear_bf16`` op, which picks the kernel or ``mm`` by
the rows it gets, so the graph holds no row-count guard.
"""

from __future__ import annotations

import functools
import os

import torch

from actors.engine.kernel_build import (Kernels, load_kernel_outcome, load_kernels, record,
                                        register_op)

MAX_ROWS = 8        # batches of more rows run on torch.mm (the AVX2 kernel is slower from ~16)
# ... with the AVX-512 code (``isa() == 512``: 6-row tiles of 64 columns, 130-145 GFLOP/s
# one thread from 6 rows up, measured here, vs MKL's 1024^3 GEMM ~150): this many
MAX_ROWS_WIDE = 1024
BLOCK = 64          # columns per packed block


@functools.lru_cache(maxsize=1)
def load() -> Kernels | None:
    """The built kernels (``kernel_build.load_ops``: built on first use, cached on disk);
    None (with a warning logged) when they cannot be built or loaded, or
    ``SPECLOAD_LINEAR_KERNEL=0``."""
    if os.environ.get("SPECLOAD_LINEAR_KERNEL", "1") == "0":
        record("linear_bf16", status="disabled", reason="SPECLOAD_LINEAR_KERNEL=0",
               fallback="float32 mm is used")
        return None
    lib = load_kernels("linear_bf16", "float32 mm is used")
    if lib is not None:
        record("linear_bf16", **load_kernel_outcome("linear_bf16"), isa=lib.isa,
               max_rows=MAX_ROWS_WIDE if lib.isa == 512 else MAX_ROWS, openmp=lib.openmp)
    return lib


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of float32 ``w`` is a bfloat16 value (its low 16 bits zero)."""
    return w.dtype == torch.float32 and bool(
        (w.detach().contiguous().view(torch.int32) & 0xFFFF).eq(0).all())


def pack(wt: torch.Tensor) -> torch.Tensor | None:
    """A ``linear_t`` weight wt [K, N] float32 -> [N / 64, K, 64] bfloat16 (``linear_packed``'s
    layout), or None where the kernel cannot serve it: not a CPU float32 tensor, N not a
    multiple of 64, a value that is not a bfloat16 value (the kernel would round it), or no
    kernel (``load()``)."""
    if wt.device.type != "cpu" or wt.dim() != 2 or wt.shape[1] % BLOCK or not bf16_exact(wt) \
            or load() is None:
        return None
    K, N = wt.shape
    p = wt.detach().to(torch.bfloat16).view(K, N // BLOCK, BLOCK).permute(1, 0, 2)
    if interleaved():       # [nb, K, 2 halves, 2 (lo, hi), 16] -> [nb, K, 2, 16, 2]
        p = p.reshape(N // BLOCK, K, 2, 2, 16).transpose(3, 4).reshape(N // BLOCK, K, BLOCK)
    return p.contiguous()


def isa() -> int:
    """The vector width the built kernel uses: 512 (AVX-512), 256 (AVX2 + FMA), 0 (plain C,
    or no kernel)."""
    lib = load()
    return lib.isa if lib is not None else 0


def interleaved() -> bool:
    """Whether ``pack``'s blocks interleave each 32-column half (the AVX-512 code's layout:
    int32 lane i holds columns i and 16 + i, widened without a shuffle)."""
    lib = load()
    return lib is not None and lib.interleaved


def linear_packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided; columns contiguous), packed [N / 64, K, 64]
    bfloat16 (``pack``) -> x @ W [M, N] float32, sums in float32 (module docstring).
    Raises RuntimeError when the kernel is not built, ValueError on a dtype or shape it
    does not take."""
    lib = load()
    if lib is None:
        raise RuntimeError("the bf16 linear kernel is not built (see the log)")
    nb, K, blk = packed.shape
    if x.dtype != torch.float32 or packed.dtype != torch.bfloat16 or blk != BLOCK \
            or x.dim() != 2 or x.shape[1] != K or not packed.is_contiguous():
        raise ValueError(f"linear_packed: x {tuple(x.shape)} {x.dtype}, packed "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    M, N = x.shape[0], nb * BLOCK
    y = torch.empty((M, N), dtype=torch.float32)
    lib.sync_threads()
    if M:
        lib.ops.linear_bf16.default(x, packed, y)
    return y


def max_rows() -> int:
    """The most rows a call runs on the kernel (``MAX_ROWS``, ``MAX_ROWS_WIDE`` with the
    AVX-512 code); more run on float32 ``mm``."""
    return MAX_ROWS_WIDE if isa() == 512 else MAX_ROWS


def linear_rows(x: torch.Tensor, wt: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, wt [K, N] float32, packed: ``pack(wt)`` -> x @ wt [M, N]: the kernel
    for at most ``max_rows()`` rows, float32 ``mm`` above. The CPU implementation of the
    ``specload::linear_bf16`` op, which a ``torch.compile`` graph calls (the row count is
    dynamic there: the choice is made inside the op, so it adds no guard to the graph)."""
    if x.shape[0] <= max_rows():
        return linear_packed(x, packed)
    return torch.mm(x, wt)


# the op, for torch.compile's graphs (``kernel_build.register_op``)
register_op("linear_bf16", "linear_bf16(Tensor x, Tensor wt, Tensor packed) -> Tensor", linear_rows,
            lambda x, wt, packed: x.new_empty((x.shape[0], wt.shape[1])))
