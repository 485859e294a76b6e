"""Admission at the engine's limits (``actors.engine.errors.queue_full``): a request a free
batch slot takes at once never counts as waiting, so ``max_waiting = 0`` serves up to
``max_num_seqs`` requests and answers 429 (QueueFull) beyond them; on the real engine."""

from __future__ import annotations

import pytest

from actors.engine.errors import QueueFull, queue_full


def test_waiting_counts_only_what_the_free_slots_will_not_take():
    assert not queue_full(0, 0, 2, 0) and not queue_full(1, 0, 2, 0)   # free slots take them
    assert queue_full(2, 0, 2, 0) and queue_full(0, 2, 2, 0)           # both slots spoken for
    assert not queue_full(2, 1, 2, 2) and queue_full(3, 1, 2, 2)       # 1 free: 2 then 3 wait
    assert not queue_full(5, 0, 8, 0)


def test_engine_at_max_waiting_zero_takes_max_num_seqs_then_answers_429():
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine
    from actors.engine.types import SamplingParams
    from configs.paths import MODELS_DIR

    eng = LLMEngine(EngineConfig(strategy="autoregressive", model=str(MODELS_DIR / "target"),
                                 max_num_seqs=2, max_waiting=0, torch_threads=1))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request("a", [5, 6, 7], sp)
    eng.add_request("b", [5, 6, 8], sp)      # the second slot, though "a" has not run yet
    with pytest.raises(QueueFull):
        eng.add_request("c", [5, 6, 9], sp)
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("d", [5, 6, 9], sp)      # the slots are free again
    assert eng.num_waiting + eng.num_running == 1
