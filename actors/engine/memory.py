"""Memory accounting of one replica: weight bytes, KV-cache bytes, process memory.

Counts resident tensors, not nominal parameter counts: tensors shared between
modules (a tied LM head, a drafter that reuses the target's embedding) are
counted once, by storage, and the engine's fused inference copies (qkv,
gate|up) are reported apart. KV bytes per token = layers x KV heads x head_dim
x 2 (K, V) x element size.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Iterable

import torch
from torch import nn


def storage_key(t: torch.Tensor) -> tuple:
    """Identity of a tensor's storage (device, data pointer): shared tensors share it."""
    return (str(t.device), t.untyped_storage().data_ptr())


def unique_bytes(tensors: Iterable[torch.Tensor], exclude: set | None = None) -> int:
    """Bytes of the distinct storages among ``tensors`` (minus those in ``exclude``)."""
    seen = set(exclude or ())
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers of ``module`` (shared ones appear once per owner)."""
    return [p.data for p in module.parameters()] + list(module.buffers())


def fused_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors held as plain attributes of submodules (the engine's fused qkv / gate|up
    copies built by ``CausalLM.fuse``), excluding parameters and buffers."""
    out = []
    for m in module.modules():
        for name, v in vars(m).items():
            if isinstance(v, torch.Tensor) and not name.startswith(("_rope", "rope_")) \
                    and not isinstance(v, nn.Parameter):
                out.append(v)
    return out


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """layers x KV heads x head_dim x 2 (K, V) x element size, bytes."""
    elem = torch.empty((), dtype=dtype).element_size()
    return int(num_layers) * int(num_kv_heads) * int(head_dim) * 2 * elem


def cache_bytes(k: list[torch.Tensor], v: list[torch.Tensor]) -> int:
    """Allocated bytes of a cache's per-layer K and V tensors."""
    return sum(t.numel() * t.element_size() for t in list(k) + list(v))


def process_memory(device: str | torch.device) -> dict:
    """Process RSS now and its peak (bytes), and on CUDA ``torch.cuda.max_memory_allocated``.

    RSS from /proc/self/statm (Linux) or psutil; peak RSS from getrusage
    (kilobytes on Linux, bytes on macOS). Values are None where unavailable.
    """
    rss = None
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            rss = int(psutil.Process().memory_info().rss)
        except Exception:  # noqa: BLE001  (no psutil: leave it unknown)
            rss = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = int(peak) if sys.platform == "darwin" else int(peak) * 1024
    out = {"process_rss_bytes": rss, "process_peak_rss_bytes": peak,
           "cuda_max_memory_allocated_bytes": None, "cuda_memory_allocated_bytes": None}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        out["cuda_max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["cuda_memory_allocated_bytes"] = int(torch.cuda.memory_allocated(device))
    return out
