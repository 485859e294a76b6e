"""The one KV slot pool (actors/engine/kv_cache.py): slots, lengths, explicit rollback."""

from __future__ import annotations

import pytest

from actors.engine.kv_cache import KVCacheFullError, KVSlotPool


def test_slots_are_handed_out_once_and_come_back():
    pool = KVSlotPool(num_slots=2, max_len=16)
    a, b = pool.allocate("a"), pool.allocate("b")
    assert {a, b} == {0, 1} and pool.num_free == 0
    with pytest.raises(KVCacheFullError, match="2 slots"):
        pool.allocate("c")
    with pytest.raises(ValueError, match="already owns"):
        pool.allocate("a")
    pool.free("a")
    pool.free("a")  # unknown / already freed ids are ignored
    assert pool.num_free == 1 and "a" not in pool
    assert pool.allocate("c") == a and pool.length("c") == 0  # a reused slot starts empty


def test_append_and_rollback_move_the_length():
    pool = KVSlotPool(num_slots=1, max_len=10)
    pool.allocate("r")
    assert pool.append("r", 4) == 0          # prefill: positions 0..3
    assert pool.append("r", 5) == 4          # verify row: anchor + 4 drafts at 4..8
    assert pool.rollback("r", 6) == 3        # 1 accepted + the target token kept
    assert pool.length("r") == 6
    assert pool.append("r", 1) == 6          # the next write starts right after the kept prefix
    with pytest.raises(ValueError, match="max_len 10"):
        pool.append("r", 4)
    with pytest.raises(ValueError, match="holds 7"):
        pool.rollback("r", 8)                # rollback never grows a request
    with pytest.raises(KeyError, match="owns no slot"):
        pool.length("nobody")
