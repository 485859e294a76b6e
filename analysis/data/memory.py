"""Memory per strategy: KV-cache arithmetic, the replicas' own memory reports, and
how many sequences fit on a GPU.

KV cache of a decoder (grouped-query attention, Ainslie et al. 2023): every
token keeps one key and one value vector per layer and KV head, so

    kv_bytes_per_token = num_layers * num_kv_heads * head_dim * 2 (K, V) * dtype_bytes

e.g. Qwen3-4B in bf16: 36 * 8 * 128 * 2 * 2 = 147,456 bytes (144 KiB) per token.
A sequence of C context tokens holds ``C * kv_bytes_per_token``; a speculative
strategy with a draft model adds the draft model's own cache (its own shape)
per sequence, and its weights once per replica. The number of sequences a
replica can hold at once is then

    max_seqs = floor((gpu_bytes * utilization - weight_bytes) / per_sequence_bytes)

(vLLM's ``gpu_memory_utilization`` idea; activations and the CUDA context are
inside the 1 - utilization headroom). Replicas report their own figures
(``GET /specload/memory``, stored by the load generator in ``manifest.json``
under ``"memory"``); ``memory_table`` turns them into the report's table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from configs import metric_names as mn

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "float8": 1, "fp8": 1}
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9   # vLLM's default share of GPU memory it may use
GIB = 1024 ** 3


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int = 2) -> int:
    """Bytes of K and V cached per token: layers x KV heads x head_dim x 2 x dtype_bytes.

    Raises ValueError for a non-positive size.
    """
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(num_layers) * int(num_kv_heads) * int(head_dim) * 2 * int(dtype_bytes)


def max_concurrent_sequences(gpu_memory_bytes: float, weight_bytes: float,
                             per_sequence_bytes: float,
                             utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> int:
    """Sequences whose KV cache fits next to the weights: floor((gpu * util - weights) / per_seq).

    0 when the weights alone do not fit. Raises ValueError for per_sequence_bytes <= 0
    or utilization outside (0, 1].
    """
    if not per_sequence_bytes > 0:
        raise ValueError(f"per_sequence_bytes must be > 0, got {per_sequence_bytes!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    free = gpu_memory_bytes * utilization - weight_bytes
    return max(0, math.floor(free / per_sequence_bytes + 1e-9))


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape (HF config names), enough for parameters and KV bytes."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False        # Qwen3: per-head RMSNorm on q and k

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes)

    def num_params(self) -> int:
        """Parameters of a Llama/Qwen-style decoder (SwiGLU MLP, RMSNorm, no biases)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = (h * q + 2 * h * kv + q * h            # q, k, v, o projections
                     + 3 * h * self.intermediate_size       # gate, up, down
                     + 2 * h                                # two RMSNorms
                     + (2 * self.head_dim if self.qk_norm else 0))
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_layers * per_layer + h + head

    @classmethod
    def from_hf_config(cls, d: dict, name: str = "config.json") -> "ModelShape":
        """From a parsed HF ``config.json``. Raises ValueError naming a missing key."""
        try:
            heads = int(d["num_attention_heads"])
            return cls(name=name, num_layers=int(d["num_hidden_layers"]),
                       hidden_size=int(d["hidden_size"]), num_heads=heads,
                       num_kv_heads=int(d.get("num_key_value_heads") or heads),
                       head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
                       intermediate_size=int(d["intermediate_size"]),
                       vocab_size=int(d["vocab_size"]),
                       tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                       qk_norm=d.get("model_type") == "qwen3")
        except KeyError as exc:
            raise ValueError(f"{name}: HF config lacks {exc.args[0]!r}; expected "
                             "num_hidden_layers, hidden_size, num_attention_heads, "
                             "intermediate_size, vocab_size") from None


# Published configs (gpt-fast's named shape table idea); numbers from each model's
# config.json on the Hugging Face hub.
SHAPES = {
    "qwen3-0.6b": ModelShape("Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, 151936, True, True),
    "qwen3-4b": ModelShape("Qwen3-4B", 36, 2560, 32, 8, 128, 9728, 151936, True, True),
    "qwen3-8b": ModelShape("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, False, True),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256),
}


def resolve_shape(spec: str) -> ModelShape:
    """A named shape (``SHAPES``, case-insensitive), a ``config.json`` path or an HF model dir.

    Raises ValueError listing the names when ``spec`` is neither.
    """
    if spec.lower() in SHAPES:
        return SHAPES[spec.lower()]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelShape.from_hf_config(json.loads(path.read_text()), name=str(spec))
    raise ValueError(f"model shape {spec!r} is neither a known name ({', '.join(SHAPES)}) nor "
                     "a config.json / HF model directory")


# --- the replicas' reports (manifest.json "memory") ---------------------------------
MEMORY_COLUMNS = ["strategy", "device", "dtype", "target_weight_bytes", "draft_weight_bytes",
                  "target_kv_bytes_per_token", "draft_kv_bytes_per_token",
                  "target_kv_allocated_bytes", "target_kv_peak_used_bytes",
                  "draft_kv_allocated_bytes", "draft_kv_peak_used_bytes",
                  "process_rss_bytes", "process_peak_rss_bytes",
                  "cuda_max_memory_allocated_bytes"]


def per_sequence_bytes(report: dict, context_tokens: float) -> float:
    """KV bytes one sequence of ``context_tokens`` holds: (target + draft bytes/token) x C."""
    bpt = (report.get("target_kv_bytes_per_token") or 0) + (report.get("draft_kv_bytes_per_token") or 0)
    return float(bpt) * float(context_tokens)


def memory_table(memory: dict[str, dict], requests: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per strategy from manifest ``memory`` ({strategy: replica report}).

    With ``requests``, adds per output class the mean context (prompt + output
    tokens of ok requests) and ``kv_mib_per_seq_<class>`` = (target + draft KV
    bytes per token) x that context, in MiB: the memory each concurrent
    sequence costs at this run's context lengths.
    """
    rows = []
    for strategy, rep in memory.items():
        if not isinstance(rep, dict) or rep.get("error"):
            continue
        row = {c: rep.get(c) for c in MEMORY_COLUMNS}
        row["strategy"] = strategy
        if requests is not None and not requests.empty:
            ok = requests[requests[mn.REQ_STRATEGY].eq(strategy)
                          & requests[mn.REQ_STATUS].eq(mn.STATUS_OK)]
            for oc, g in ok.groupby(mn.REQ_OUTPUT_CLASS, sort=True):
                ctx = float((g[mn.REQ_PROMPT_TOKENS].fillna(0) + g[mn.REQ_OUTPUT_TOKENS]).mean())
                row[f"context_tokens_{oc}"] = ctx
                row[f"kv_mib_per_seq_{oc}"] = per_sequence_bytes(rep, ctx) / 2 ** 20
        rows.append(row)
    return pd.DataFrame(rows)


def gpu_memory_caps(shape: ModelShape, gpu_memory_bytes: float, contexts: dict[tuple[str, str], float],
                    memory: dict[str, dict] | None = None, dtype_bytes: int = 2,
                    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> list[dict]:
    """Max concurrent sequences per replica for each (strategy, output class).

    contexts: (strategy, output_class) -> context tokens per sequence (prompt +
    output + verification window). The target's weights and KV bytes per token
    come from ``shape`` in ``dtype_bytes``. A strategy's drafter is scaled from
    the run's replica reports (``memory``): draft weights = target weights x the
    measured draft/target weight ratio, draft KV per token likewise (no report:
    no drafter memory, said in ``draft_source``).
    """
    target_w = shape.num_params() * dtype_bytes
    target_bpt = shape.kv_bytes_per_token(dtype_bytes)
    rows = []
    for (strategy, oc), ctx in sorted(contexts.items()):
        rep = (memory or {}).get(strategy) or {}
        w_ratio = kv_ratio = 0.0
        source = "no replica memory report: drafter memory not counted"
        if rep.get("target_weight_bytes") and rep.get("target_kv_bytes_per_token"):
            w_ratio = (rep.get("draft_weight_bytes") or 0) / rep["target_weight_bytes"]
            kv_ratio = (rep.get("draft_kv_bytes_per_token") or 0) / rep["target_kv_bytes_per_token"]
            source = "scaled from this run's replica report"
        weights = target_w * (1.0 + w_ratio)
        per_seq = target_bpt * (1.0 + kv_ratio) * ctx
        rows.append({"strategy": strategy, "output_class": oc, "context_tokens": ctx,
                     "weight_bytes": weights, "kv_bytes_per_seq": per_seq,
                     "draft_weight_ratio": w_ratio, "draft_kv_ratio": kv_ratio,
                     "draft_source": source,
                     "max_seqs": max_concurrent_sequences(gpu_memory_bytes, weights, per_seq,
                                                          utilization)})
    return rows
