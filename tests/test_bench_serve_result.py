"""bench_serve's result document: its headline is the load generator's default route."""

from __future__ import annotations

import argparse

from bench.serving_overhead import (DIRECT, DIRECT_INGRESS, MODEL_FIELD, STRATEGY_ROUTE, _result,
                                summarize)


def _runs(ways: list[str]) -> dict:
    """Two concurrencies, two repetitions; each way's tokens/s a fixed share of direct's,
    TTFT a fixed number of ms above direct's."""
    share = {DIRECT: 1.0, STRATEGY_ROUTE: 0.85, MODEL_FIELD: 0.8, DIRECT_INGRESS: 0.95}
    ttft = {DIRECT: 10.0, STRATEGY_ROUTE: 30.0, MODEL_FIELD: 40.0, DIRECT_INGRESS: 15.0}
    runs: dict = {}
    for c, tps in ((4, 1000.0), (16, 2000.0)):
        for way in ways:
            for rep in range(2):
                req = {"e2e_ms": 100.0 + ttft[way], "ttft_ms": ttft[way] + (c == 16) * 5 * (way != DIRECT),
                       "tokens": 64, "chunks": 3}
                runs.setdefault((c, way), []).append(
                    {"tokens_per_s": tps * share[way] * (1 - 0.02 * (c == 4)) ** (way != DIRECT),
                     "wall_s": 1.0, "requests": [req] * c})
    return runs


def _args() -> argparse.Namespace:
    return argparse.Namespace(strategy="autoregressive", max_tokens=64, reps=2, waves=1,
                              settle_s=0.0, engine_process="auto")


def test_headline_is_the_direct_listener_when_measured_else_the_proxy_route():
    ways = [DIRECT, STRATEGY_ROUTE, MODEL_FIELD, DIRECT_INGRESS]
    res = _result(_args(), [4, 16], summarize(_runs(ways), [4, 16], ways))
    assert res["route"] == "direct"
    assert res["ratio"] == res["ratio_direct_ingress"] == round(0.95 * 0.98, 3)   # worst: 4 streams
    assert res["ratio_strategy_route"] == round(0.85 * 0.98, 3)
    assert res["ratio_model_field"] == round(0.8 * 0.98, 3)
    assert res["ttft_added_ms_p50"] == res["ttft_added_ms_p50_direct_ingress"] == 10.0  # worst: 16
    assert res["ttft_added_ms_p50_strategy_route"] == 25.0
    ways = [DIRECT, STRATEGY_ROUTE, MODEL_FIELD]                  # --no-direct-ingress
    res = _result(_args(), [4, 16], summarize(_runs(ways), [4, 16], ways))
    assert res["route"] == "strategy" and "ratio_direct_ingress" not in res
    assert res["ratio"] == res["ratio_strategy_route"] == round(0.85 * 0.98, 3)
