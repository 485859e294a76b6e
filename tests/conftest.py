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
