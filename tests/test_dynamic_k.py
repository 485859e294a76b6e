"""Dynamic speculation: ``num_speculative_tokens_per_batch_size`` (issue 22 item 4).

vLLM PR #32374's name and rules (inclusive "a-b" ranges; a gap inherits the range
below; past the last range its k; the first range starts at 1), validated by
pydantic with errors naming the key; the step log records the k of each step; and
greedy output stays identical to autoregressive whatever k each step uses, for
every speculative strategy, while the batch grows and shrinks across the ranges.
"""

from __future__ import annotations

import pytest

from actors.engine.config import EngineConfig
from actors.engine.scheduler import Request, Scheduler
from actors.engine.llm_engine import run_requests
from actors.engine.types import SamplingParams
from configs import metric_names as M
from configs import results_schema as S
from configs.serve_config import (SPEC_SCHEDULE_KEY, ServeAppConfig, parse_spec_schedule,
                                  spec_schedule_k)
from tests.spec_faults import greedy_mismatch

MAX_TOKENS = 32


# ------------------------------------------------------------------ the rules
def test_lookup_follows_vllm_gap_rule():
    """vLLM's own test table (tests/v1/spec_decode/test_dynamic_sd.py): gaps inherit the
    range below, sizes past the last range keep its k; the dict and list forms agree."""
    s = parse_spec_schedule({"1-16": 3, "32-128": 2, "256-2048": 0}, max_k=3)
    assert s == ((1, 16, 3), (32, 128, 2), (256, 2048, 0))
    assert s == parse_spec_schedule([[32, 128, 2], [1, 16, 3], [256, 2048, 0]], max_k=3)
    got = {b: spec_schedule_k(s, b) for b in (1, 16, 17, 31, 32, 128, 129, 255, 256, 5000)}
    assert got == {1: 3, 16: 3, 17: 3, 31: 3, 32: 2, 128: 2, 129: 2, 255: 2, 256: 0, 5000: 0}
    assert parse_spec_schedule({"1": 2, "2-3": 0}, max_k=2) == ((1, 1, 2), (2, 3, 0))


@pytest.mark.parametrize("value,match", [
    ({"0-4": 1}, r"\['0-4'\]: expected a range a-b with 1 <= a <= b"),
    ({"1-4": 1, "9-3": 1}, r"\['9-3'\]: expected a range a-b"),
    ({"1-x": 1}, r"\['1-x'\]: expected a batch-size range 'a-b' of integers"),
    ({"1-8": 2, "8-16": 1}, "expected non-overlapping ranges; got '1-8 and 8-16'"),
    ({"2-8": 2}, "first range to start at batch size 1"),
    ({"1-8": -1}, r"\['1-8'\]: expected k an integer in 0..4"),
    ({"1-8": 5}, r"\['1-8'\]: expected k an integer in 0..4 .*got 5; fix: lower k"),
    ({"1-8": 1.5}, r"\['1-8'\]: expected k an integer"),
    ({}, "expected a non-empty map"),
    ("1-8:2", "expected a map"),
    ([[1, 8]], r"\[0\]: expected \[first batch size, last batch size, k\]"),
])
def test_bad_schedules_name_the_key(value, match):
    with pytest.raises(ValueError, match=match) as e:
        EngineConfig(strategy="ngram", num_speculative_tokens=4,
                     num_speculative_tokens_per_batch_size=value)
    assert SPEC_SCHEDULE_KEY in str(e.value)


def test_k_bounded_by_strategy_default_and_block_size():
    """k <= num_speculative_tokens, the strategy default when unset (4 for ngram), and a
    DFlash-family drafter's block size - 1 (7 for the committed 8-token blocks) even
    when num_speculative_tokens is larger; autoregressive allows only 0."""
    with pytest.raises(ValueError, match=r"0\.\.4 \(num_speculative_tokens is unset: ngram's default 4\)"):
        EngineConfig(strategy="ngram", num_speculative_tokens_per_batch_size={"1-8": 5})
    for strategy in M.BLOCK_DRAFTER_STRATEGIES:
        with pytest.raises(ValueError, match=r"0\.\.7 \(.*drafts blocks of 8 tokens"):
            EngineConfig(strategy=strategy, num_speculative_tokens=12,
                         num_speculative_tokens_per_batch_size={"1-8": 8})
        ok = EngineConfig(strategy=strategy, num_speculative_tokens=12,
                          num_speculative_tokens_per_batch_size={"1-8": 7, "9-64": 0})
        assert ok.spec_schedule() == ((1, 8, 7), (9, 64, 0))
    with pytest.raises(ValueError, match=r"0\.\.0"):
        EngineConfig(strategy="autoregressive", num_speculative_tokens_per_batch_size={"1-8": 1})
    assert EngineConfig(strategy="ngram").spec_schedule() is None


def test_serve_config_checks_the_schedule_at_deploy_time():
    """The Serve schema (no torch) refuses a bad map naming the strategy entry and key."""
    good = {"strategies": [{"engine": {"strategy": "ngram", "num_speculative_tokens": 3,
                                       SPEC_SCHEDULE_KEY: {"1-16": 3, "17-64": 0}}}]}
    ServeAppConfig.model_validate(good)
    bad = {"strategies": [{"name": "ng", "engine": {"strategy": "ngram", "num_speculative_tokens": 3,
                                                    SPEC_SCHEDULE_KEY: {"1-16": 4}}}]}
    with pytest.raises(ValueError, match=r"strategy 'ng': engine\.num_speculative_tokens_per_batch_size"
                                         r"\['1-16'\]: expected k an integer in 0\.\.3"):
        ServeAppConfig.model_validate(bad)


def test_scheduler_takes_k_from_the_running_batch():
    """k comes from the requests running once the step's admissions are in; a degraded
    request gets max_draft 0 whatever k is."""
    sched = parse_spec_schedule({"1-2": 3, "3-3": 1, "5-8": 0}, max_k=4)
    s = Scheduler(8, 4096, 512, 4, 100, lambda b: spec_schedule_k(sched, b))
    p = SamplingParams(max_tokens=100)
    seen = []
    for i in range(6):
        s.add(Request(f"r{i}", [1, 2, 3], p, None))
        out = s.schedule(free_slots=8 - len(s.running))
        seen.append((len(s.running), out.num_speculative_tokens))
        for r in s.running:
            r.num_computed = len(r.prompt_ids)   # prefilled: decodes from the next step
    assert seen == [(1, 3), (2, 3), (3, 1), (4, 1), (5, 0), (6, 0)]
    s.running[0].degraded = M.DEGRADE_DRAFTER_ERROR
    assert s.max_draft(s.running[0], 4) == 0 and s.max_draft(s.running[1], 4) == 4


def test_step_columns_in_the_results_schema():
    cols = {c.name: c for c in S.ENGINE_STEP_COLUMNS}
    assert {M.STEP_NUM_SPEC_TOKENS, M.STEP_SPECULATION_OFF, M.STEP_DEGRADED_REQUESTS} <= set(cols)
    row = S.coerce_row(S.ENGINE_STEP_COLUMNS, {M.STEP_TS: 1.0, M.STEP_STRATEGY: "ngram"})
    assert row[M.STEP_SPECULATION_OFF] == "" and row[M.STEP_DEGRADED_REQUESTS] == 0
    assert S.SCHEMA_VERSION >= 4


# ------------------------------------------------------------------ greedy identity
SPECULATIVE = [s for s in M.STRATEGIES if s != M.AUTOREGRESSIVE]
# batch 1-2: the strategy's deepest k here, 3: 1, 4: (gap) inherits 1, 5-8: off
SCHEDULE = {"1-2": 4, "3-3": 1, "5-8": 0}


@pytest.fixture(scope="module")
def prompts(heldout_prompts):
    return heldout_prompts[:6] + heldout_prompts[24:30]   # 6 code + 6 prose


@pytest.fixture(scope="module")
def reference(make_engine, prompts):
    ar = make_engine("autoregressive", max_num_seqs=8)
    return run_requests(ar, [(p["id"], p["prompt"], SamplingParams(max_tokens=MAX_TOKENS))
                             for p in prompts])


@pytest.mark.parametrize("strategy", SPECULATIVE)
def test_greedy_identical_while_k_switches(strategy, make_engine, prompts, reference):
    """12 requests arrive in two waves (batch 1 -> 8 -> 1 -> 4 -> 1): every step's k
    follows SCHEDULE; greedy output equals autoregressive (near-ties told apart) and the
    step log says which k each step used and why a step drafted nothing."""
    eng = make_engine(strategy, max_num_seqs=8, num_speculative_tokens=4,
                      num_speculative_tokens_per_batch_size=SCHEDULE)
    rows: list[dict] = []
    eng.on_step = rows.append
    try:
        arrivals = [0, 0, 2, 4, 6, 8, 10, 12, 60, 62, 64, 66]
        out = run_requests(eng, [(p["id"], p["prompt"], SamplingParams(max_tokens=MAX_TOKENS))
                                 for p in prompts], batch_size=8, arrival_steps=arrivals)
    finally:
        eng.on_step = None
    ar_model = make_engine("autoregressive", max_num_seqs=8).model
    for p in prompts:
        ids = eng.tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
        bad = greedy_mismatch(ar_model, ids, out[p["id"]]["token_ids"],
                              reference[p["id"]]["token_ids"])
        assert bad is None, (strategy, p["id"], bad)
        assert out[p["id"]]["stats"].degraded_reason == ""
    ks = [r[M.STEP_NUM_SPEC_TOKENS] for r in rows]
    assert set(ks) == {4, 1, 0}, sorted(set(ks))     # every range was visited
    for r in rows:
        if r[M.STEP_NUM_SPEC_TOKENS] == 0:
            assert r[M.STEP_DRAFT_TOKENS] == 0
            assert r[M.STEP_SPECULATION_OFF] == (M.SPEC_OFF_BATCH_SIZE_POLICY
                                                 if r[M.STEP_BATCH_SIZE] else "")
        else:
            assert r[M.STEP_SPECULATION_OFF] == ""
            assert r[M.STEP_DRAFT_TOKENS] <= r[M.STEP_NUM_SPEC_TOKENS] * r[M.STEP_BATCH_SIZE]
        assert r[M.STEP_DEGRADED_REQUESTS] == 0
    # speculation resumed after the k = 0 stretch, and drafts were accepted under both k > 0
    first_off = ks.index(0)
    assert any(r[M.STEP_DRAFT_TOKENS] for r in rows[first_off:])
    assert sum(r[M.STEP_ACCEPTED_TOKENS] for r in rows if r[M.STEP_NUM_SPEC_TOKENS] == 4) > 0
    assert sum(o["stats"].num_accepted_tokens for o in out.values()) > 0


def test_sampling_lossless_while_k_switches(make_engine):
    """2,000 seeded trials in batches of up to 64 under a schedule that drafts 2 tokens
    at batch <= 40 and 1 above (both ranges visited as the run drains): the joint of the
    first three emitted tokens still matches the target's exact distribution."""
    from tests.lossless import assert_sampling_lossless

    eng = make_engine("draft_model", max_num_seqs=64, num_speculative_tokens=2,
                      num_speculative_tokens_per_batch_size={"1-40": 2, "41-64": 1})
    rows: list[dict] = []
    eng.on_step = rows.append
    try:
        assert_sampling_lossless(eng, seed0=9000)
    finally:
        eng.on_step = None
    assert {r[M.STEP_NUM_SPEC_TOKENS] for r in rows} == {1, 2}


def test_every_step_logs_the_batch_size_its_k_was_looked_up_with(make_engine, prompts):
    """Issue 42: with [[1,2,4],[3,8,2],[9,64,0]], 98.6% of steps had k = table[batch_size];
    steps that also prefill looked k up by running + admitted requests, which the log did
    not record. ``k_batch_size`` is that size: 100% of steps have k = table[k_batch_size],
    including the steps that admit and prefill while others decode (there k_batch_size
    differs from the decode batch_size)."""
    table = [[1, 2, 4], [3, 8, 2], [9, 64, 0]]
    sched = parse_spec_schedule(table, max_k=4)
    eng = make_engine("ngram", max_num_seqs=12, num_speculative_tokens=4,
                      num_speculative_tokens_per_batch_size=table,
                      strategy_options={"prompt_lookup_min": 1})
    rows: list[dict] = []
    eng.on_step = rows.append
    try:
        arrivals = [0, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23]
        run_requests(eng, [(p["id"], p["prompt"], SamplingParams(max_tokens=MAX_TOKENS))
                           for p in prompts], batch_size=12, arrival_steps=arrivals)
    finally:
        eng.on_step = None
    assert rows and all(r[M.STEP_K_BATCH_SIZE] is not None for r in rows)
    match = [r[M.STEP_NUM_SPEC_TOKENS] == spec_schedule_k(sched, r[M.STEP_K_BATCH_SIZE])
             for r in rows]
    assert sum(match) == len(rows), [r for r, ok in zip(rows, match) if not ok][:3]
    mixed = [r for r in rows if r[M.STEP_PREFILL_TOKENS] and r[M.STEP_BATCH_SIZE]]
    assert mixed, "no step both prefilled and decoded"
    assert any(r[M.STEP_K_BATCH_SIZE] != r[M.STEP_BATCH_SIZE] for r in mixed)
    by_batch = [r[M.STEP_NUM_SPEC_TOKENS] == spec_schedule_k(sched, r[M.STEP_BATCH_SIZE])
                for r in rows if r[M.STEP_BATCH_SIZE]]
    print(f"k = table[batch_size]: {sum(by_batch)}/{len(by_batch)} decode steps; "
          f"k = table[k_batch_size]: {sum(match)}/{len(rows)} steps ({len(mixed)} mixed)")
    assert {r[M.STEP_NUM_SPEC_TOKENS] for r in rows} >= {4, 2}
    # a fixed-k engine logs no lookup size; an older run's rows load with it null
    fixed = make_engine("ngram", max_num_seqs=8, num_speculative_tokens=4)
    frows: list[dict] = []
    fixed.on_step = frows.append
    try:
        run_requests(fixed, [("f", prompts[0]["prompt"], SamplingParams(max_tokens=4))])
    finally:
        fixed.on_step = None
    assert frows and all(r[M.STEP_K_BATCH_SIZE] is None for r in frows)
    old = S.coerce_row(S.ENGINE_STEP_COLUMNS, {M.STEP_TS: 1.0, M.STEP_STRATEGY: "ngram"})
    assert old[M.STEP_K_BATCH_SIZE] is None
