"""What an answer holds for: the deployment and the measurement behind it.

A recommendation measured on a 22 MiB target on two CPU cores says nothing about an 8 B
target on a GPU; every answer (console, report, recommendation.json) and the claims check
carry this scope so the reader knows what was measured.
"""

from __future__ import annotations

from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def run_scope(manifests: list[dict[str, Any]], warmup_s: float | None = None) -> dict[str, Any]:
    """The scope of the runs behind a report, from their manifests: {"target", "target_params"
    (parameters, from the replica's weight bytes and dtype; None for a target that does not
    report them, e.g. vLLM), "device", "dtype", "cpu_count", "memory_gb", "replicas" (replicas
    per strategy reporting memory), "cell_s" (offered seconds per cell, sorted set),
    "warmup_s", "warmup_requests" (unmeasured requests per strategy before its first cell),
    "runs"}."""
    m0 = manifests[0] if manifests else {}
    mem = [v for m in manifests for v in (m.get("memory") or {}).values() if isinstance(v, dict)]
    first = mem[0] if mem else {}
    dtype = first.get("dtype")
    wb = first.get("target_weight_bytes")
    params = wb / DTYPE_BYTES[dtype] if wb and dtype in DTYPE_BYTES else None
    per = {}
    for m in manifests:
        for s, v in (m.get("memory") or {}).items():
            per.setdefault(s, set()).add((v or {}).get("replica"))
    durations = set()
    for m in manifests:   # the offered cell length: --duration, else the tier file's, per cell run
        if (m.get("args") or {}).get("duration"):
            durations.add(float(m["args"]["duration"]))
            continue
        tiers = (m.get("profile") or {}).get("tiers") or {}
        for t in m.get("tiers") or []:
            for oc in m.get("outputs") or []:
                d = ((tiers.get(t) or {}).get(oc) or {}).get("duration_s")
                if d:
                    durations.add(float(d))
    durations = sorted(durations)
    machine = m0.get("machine") or {}
    args = m0.get("args") or {}
    return {"target": m0.get("target"), "target_weight_bytes": wb, "target_params": params,
            "device": first.get("device"), "dtype": dtype, "cpu_count": machine.get("cpu_count"),
            "memory_gb": machine.get("memory_gb"),
            "replicas": max((len(v) for v in per.values()), default=None),
            "cell_s": durations,
            "warmup_s": warmup_s if warmup_s is not None else args.get("warmup_s"),
            "warmup_requests": (m0.get("warmup") or {}).get("requests_per_strategy"),
            "runs": len(manifests)}


def scope_line(scope: dict[str, Any]) -> str:
    """``on this deployment: a 5.8 M-parameter float32 target (22 MiB) on cpu, 2 CPU cores,
    23.6 GiB; 1 replica per strategy; 10 s cells, the first 1 s cut as warm-up``."""
    parts = []
    p, wb = scope.get("target_params"), scope.get("target_weight_bytes")
    if p:
        size = f"{p / 1e9:.1f} B" if p >= 1e9 else f"{p / 1e6:.1f} M"
        parts.append(f"a {size}-parameter {scope.get('dtype')} target ({wb / 2**20:.0f} MiB) on "
                     f"{scope.get('device') or 'an unknown device'}")
    else:
        parts.append(f"the target at {scope.get('target')} (its size not reported)")
    if scope.get("cpu_count"):
        parts[-1] += f", a {scope['cpu_count']}-core machine"
        if scope.get("memory_gb"):
            parts[-1] += f" with {scope['memory_gb']:g} GiB"
    if scope.get("replicas"):
        parts.append(f"{scope['replicas']} replica{'s' if scope['replicas'] != 1 else ''} per strategy")
    cells = scope.get("cell_s") or []
    if cells:
        c = "/".join(f"{x:g}" for x in cells)
        w = scope.get("warmup_s")
        n = scope.get("warmup_requests")
        parts.append(f"{c}-s cells" + (f", each one's first {w:g} s cut as warm-up" if w else ", no warm-up cut")
                     + (f", every strategy warmed by {n} unmeasured requests first" if n else ""))
    return "on this deployment only: " + "; ".join(parts)
