"""Shared fixtures: held-out prompts and engines on the embedded models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "data" / "prompts" / "heldout_eval.jsonl"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every single-node Ray a test starts (in process or as a child) stays on 127.0.0.1 instead of
# the address Ray would pick (the host's own); tests.multinode_cluster sets the opposite.
from configs.net import RAY_SINGLE_NODE_LOOPBACK_ENV  # noqa: E402

for _k, _v in RAY_SINGLE_NODE_LOOPBACK_ENV.items():
    os.environ.setdefault(_k, _v)
# One thread: tiny models gain nothing from two, and OpenMP barriers stall badly
# whenever another process shares the cores (measured 10x slower here).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def heldout_prompts() -> list[dict]:
    """48 held-out prompts (24 code, 24 prose) from ``data/prompts/heldout_eval.jsonl``."""
    return [json.loads(l) for l in PROMPTS.read_text().splitlines() if l.strip()]


@pytest.fixture(scope="session")
def make_engine():
    """Factory: ``make_engine(strategy, **engine_config)`` -> LLMEngine (cached per args)."""
    from actors.engine.config import DEFAULT_DRAFT, EngineConfig
    from actors.engine.llm_engine import LLMEngine

    cache = {}

    def make(strategy: str, **kw) -> LLMEngine:
        key = (strategy, tuple(sorted(kw.items(), key=lambda x: x[0])).__repr__())
        if key not in cache:
            if strategy == "draft_model":
                kw.setdefault("draft_model", str(DEFAULT_DRAFT))
            cache[key] = LLMEngine(EngineConfig(strategy=strategy, **kw))
        return cache[key]

    return make


# ------------------------------------------------------------------ the suite on two workers
# pyproject's addopts run the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``).
# The tests that start Ray (Serve, ``cluster up``, ``ray up``, a load run on Ray workers) and
# those that read latencies under load share one worker, in ``SERIAL``'s order: Ray's own
# state (``/tmp/ray``'s current-cluster file, ``ray stop`` in the ray-up test, the loopback
# audit of every listener) allows one cluster at a time. Every other module is a group of its
# own (its module-scoped fixtures built once) on the other worker, vLLM's start-ups first.
# The fault, multi-node and load-timing tests run while that worker runs single-threaded
# unit tests (one core), not vLLM start-ups; the CPU-heavy Serve bring-ups come last, when
# it is done. ``-n 0`` runs everything in one process, in the same order.
SERIAL_GROUP = "ray"
SERIAL = [  # "module" (all its tests) or "module::test" (that test, all its parameters)
    "test_consistency_run.py",
    "test_vllm_backend.py::test_serve_vllm_strategy_both_routes_errors_health_and_step_log",
    "test_vllm_backend.py::test_loadgen_measures_embedded_and_vllm_side_by_side",
    "test_loadgen_e2e.py::test_closed_loop_timing_matches_server_truth",
    "test_loadgen_e2e.py::test_failures_are_rows_and_do_not_distort_ok_rows",
    "test_loadgen_e2e.py::test_open_loop_stall_shows_in_latency",
    "test_loadgen_e2e.py::test_ray_distributed_workers",
    "test_loadgen_e2e.py::test_smoke_against_real_service",
    "test_worker_settle.py",
    "test_faults.py",
    "test_multinode.py",
    "test_install.py",
    "test_serve.py",
    "test_serve_logprobs.py",
    "test_loopback.py",
    "test_serve_cluster.py",
    "test_cluster_down.py",
    "test_cli_input.py::test_cluster_up_failure_after_ray_started_stops_its_head",
    "test_cluster_resources.py",
    "test_analysis_policy.py::test_validation_on_the_local_service_switches_k_by_batch",
    # specload's client against vllm bench serve on one real vLLM (5% agreement): last, when the
    # other worker is past its vLLM start-ups
    "test_peer_client.py",
]
POOL_FIRST = ["test_vllm_target.py", "test_vllm_backend.py"]


def _serial_rank(item) -> int | None:
    module = item.path.name
    name = getattr(item, "originalname", None) or item.name
    for i, entry in enumerate(SERIAL):
        if entry == module or entry == f"{module}::{name}":
            return i
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Each test's ``xdist_group`` (``SERIAL_GROUP`` or its module's name) and the order:
    the serial group first (the scheduler gives it to one worker whole), in ``SERIAL``'s
    order, then ``POOL_FIRST``, then the rest as collected."""
    ranks = {}
    for pos, item in enumerate(items):
        rank = _serial_rank(item)
        if rank is not None:
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))
            ranks[item.nodeid] = (0, rank, pos)
        else:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
            if item.path.name in POOL_FIRST:
                ranks[item.nodeid] = (1, POOL_FIRST.index(item.path.name), pos)
            else:
                ranks[item.nodeid] = (2, 0, pos)
    items.sort(key=lambda it: ranks[it.nodeid])
