"""Degrade instead of fail (issue 22 item 5): a drafter that raises, returns garbage or
misses ``draft_deadline_ms`` costs its request the drafts, not the request.

Each fault kind (``tests.spec_faults.FAULTS``) is injected through a test double
(``FaultyProposer``, wrapping the engine's real proposer) into one request ("bad") of
a batch of four, from its third drafter call on, for every drafter family: the
draft-model proposer, n-gram lookup, and the parallel (block) drafters DFlash,
DFlash 2 and DSpark. Asserted per run: no request fails; "bad" finishes with
``degraded_reason`` = the fault's reason and its greedy output equal to
autoregressive (near-ties told apart); it drafts nothing after the fault; its three
neighbours keep speculating (their drafts and accepted tokens grow after it was
degraded) and match autoregressive too; the engine counter, the step-log
``degraded_requests`` / ``speculation_off`` columns and the request's stats agree.
Run with ``-s`` for the family x fault -> ok / degraded / failed table.
"""

from __future__ import annotations

import collections

import pytest

from actors.engine.types import SamplingParams
from configs import metric_names as M
from tests.spec_faults import FAULTS, FaultyProposer, greedy_mismatch

MAX_TOKENS = 32
FAMILIES = [M.DRAFT_MODEL, M.NGRAM, M.DFLASH, M.DFLASH2, M.DSPARK]
DEADLINE_MS = 1000.0      # generous: a healthy call here takes milliseconds
SLEEP_S = 1.3             # what the "deadline" fault sleeps per call with the victim


@pytest.fixture(scope="module")
def table():
    """family -> fault -> "ok/degraded/failed" counts; printed at the end of the module."""
    t: dict[str, dict[str, str]] = collections.defaultdict(dict)
    yield t
    fams = [f for f in FAMILIES if f in t]
    print("\n\ndrafter fault -> requests ok/degraded/failed (4 greedy requests per run, "
          "the fault in one)")
    print(f"{'fault':<15}" + "".join(f"{f:>13}" for f in fams) + "  reason")
    for fault, reason in FAULTS.items():
        print(f"{fault:<15}" + "".join(f"{t[f].get(fault, '-'):>13}" for f in fams)
              + f"  {reason}")


@pytest.fixture(scope="module")
def prompts(heldout_prompts):
    # code prompts on which n-gram lookup drafts early (the victim, first, from its 2nd step)
    return [heldout_prompts[i] for i in (2, 6, 10, 1)]


@pytest.fixture(scope="module")
def reference(make_engine, prompts):
    from actors.engine.llm_engine import run_requests

    ar = make_engine("autoregressive", max_num_seqs=8)
    return run_requests(ar, [(p["id"], p["prompt"], SamplingParams(max_tokens=MAX_TOKENS))
                             for p in prompts])


def _drive(eng, reqs, victim):
    """Run ``reqs`` [(id, prompt)] together, greedy. Returns (results, step rows,
    neighbours' (drafts, accepted) when the victim was degraded, victim's drafts then)."""
    rows: list[dict] = []
    eng.on_step = rows.append
    res = {rid: {"ids": [], "finish_reason": None, "error": None, "stats": None}
           for rid, _ in reqs}
    at_degrade = None
    try:
        for rid, prompt in reqs:
            eng.add_request(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS))
        for _ in range(500):
            if not eng.has_unfinished_requests():
                break
            for out in eng.step():
                r = res[out.request_id]
                r["ids"] += out.new_token_ids
                if out.finished:
                    r.update(finish_reason=out.finish_reason, error=out.error, stats=out.stats)
            v = eng.requests.get(victim)
            if at_degrade is None and (v is None or v.degraded):
                others = [q.stats for rid, q in eng.requests.items() if rid != victim]
                at_degrade = (sum(s.num_drafts for s in others),
                              sum(s.num_accepted_tokens for s in others),
                              v.stats.num_drafts if v is not None else None)
        assert not eng.has_unfinished_requests()
    finally:
        eng.on_step = None
    return res, rows, at_degrade


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_faults_degrade_the_request_alone(family, make_engine, prompts, reference,
                                                  table):
    ar_model = make_engine("autoregressive", max_num_seqs=8).model
    for fault, reason in FAULTS.items():
        kw = {"draft_deadline_ms": DEADLINE_MS} if fault == "deadline" else {}
        eng = make_engine(family, max_num_seqs=8, **kw)
        real = eng.proposer
        eng.proposer = FaultyProposer(real, "bad", fault, after=2, sleep_s=SLEEP_S)
        before = collections.Counter(eng.degraded_requests)
        names = ["bad", "ok-1", "ok-2", "ok-3"]
        try:
            res, rows, at_degrade = _drive(eng, [(n, p["prompt"]) for n, p in zip(names, prompts)],
                                           "bad")
        finally:
            eng.proposer = real
        failed = [n for n in names if res[n]["finish_reason"] in (None, "error")]
        degraded = [n for n in names if res[n]["stats"] and res[n]["stats"].degraded_reason]
        table[family][fault] = f"{len(names) - len(failed) - len(degraded)}/{len(degraded)}/{len(failed)}"
        where = f"{family} / {fault}"
        assert not failed, (where, {n: res[n]["error"] for n in failed})
        assert degraded == ["bad"], (where, degraded)
        assert res["bad"]["stats"].degraded_reason == reason, where
        # output: every request equals autoregressive (the degraded one included)
        for n, p in zip(names, prompts):
            ids = eng.tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
            bad = greedy_mismatch(ar_model, ids, res[n]["ids"], reference[p["id"]]["token_ids"])
            assert bad is None, (where, n, bad)
        # counters: engine, step log, request stats agree on one degraded request
        delta = collections.Counter(eng.degraded_requests) - before
        assert delta == {reason: 1}, (where, delta)
        assert sum(r[M.STEP_DEGRADED_REQUESTS] for r in rows) == 1, where
        hit = next(i for i, r in enumerate(rows) if r[M.STEP_DEGRADED_REQUESTS])
        if fault not in ("observe_raise", "admit_raise"):   # those strike after the step drafted
            assert rows[hit][M.STEP_SPECULATION_OFF] == reason, where
        assert all(r[M.STEP_SPECULATION_OFF] in ("", reason) for r in rows), where
        assert any(reason == r[M.STEP_SPECULATION_OFF] for r in rows[hit:]), where
        # the victim drafted before the fault (except a failed admission) and never after
        stats = res["bad"]["stats"]
        assert at_degrade is not None and stats.num_drafts == at_degrade[2], where
        if fault == "admit_raise":
            assert stats.num_drafts == 0, where
        else:
            assert stats.num_drafts >= 1, where
        # the neighbours kept speculating after the victim lost its drafter
        drafts = sum(res[n]["stats"].num_drafts for n in names[1:])
        accepted = sum(res[n]["stats"].num_accepted_tokens for n in names[1:])
        assert drafts > at_degrade[0] and accepted > at_degrade[1], (where, at_degrade,
                                                                     drafts, accepted)
        assert all(res[n]["stats"].degraded_reason == "" for n in names[1:]), where


def test_prometheus_counts_degraded_requests_by_reason():
    """The replica's ``specload_degraded_requests`` counter (Ray exports it as
    ``ray_specload_degraded_requests``) goes up once per finished degraded request,
    labelled with its reason, next to the spec_decode counters."""
    from actors.serve.deployments import ReplicaMetrics

    class Counter:
        def __init__(self):
            self.calls = []

        def inc(self, value=1.0, tags=None):
            self.calls.append((value, tags))

    m = ReplicaMetrics.__new__(ReplicaMetrics)   # the instruments without a Ray cluster
    for name in ("num_drafts", "num_draft_tokens", "num_accepted", "per_pos", "degraded",
                 "requests_finished", "generation_tokens"):
        setattr(m, name, Counter())
    base = {M.NUM_DRAFTS: 2, M.NUM_DRAFT_TOKENS: 6, M.NUM_ACCEPTED_TOKENS: 3,
            M.NUM_ACCEPTED_TOKENS_PER_POS: [2, 1]}
    m.observe_request({**base, M.DEGRADED_REASON: M.DEGRADE_DRAFT_DEADLINE})
    m.observe_request({**base, M.DEGRADED_REASON: ""})
    m.observe_request(base)   # stats of an older engine: no field
    assert m.degraded.calls == [(1, {"reason": M.DEGRADE_DRAFT_DEADLINE})]
    assert m.num_drafts.calls == [(2, None)] * 3
    assert M.PROM_DEGRADED_REQUESTS == "degraded_requests"


def test_spec_decode_stats_carry_the_reason():
    """The per-request ``spec_decode`` object of a response (``SpecStats.to_dict``) has
    ``degraded_reason``: "" for a request that speculated throughout."""
    from actors.engine.types import SpecStats

    s = SpecStats()
    assert s.to_dict()[M.DEGRADED_REASON] == ""
    s.degraded_reason = M.DEGRADE_INVALID_DRAFT
    assert s.to_dict()[M.DEGRADED_REASON] == "invalid_draft"


# ------------------------------------------------------------------ through the replica
def make_degrading_engine(cfg: dict):
    """Engine factory (test only): the real engine, its proposer wrapped so that request
    "bad-1" gets a proposer that raises from its third drafting call on."""
    from actors.serve.engine_core import make_llm_engine

    eng = make_llm_engine(cfg)
    eng.proposer = FaultyProposer(eng.proposer, "bad-1", "raise", after=2)
    return eng


def test_degraded_request_succeeds_through_the_replica(heldout_prompts):
    """Through the Serve replica (the plain class, no Ray): the degraded request is a 200
    with the autoregressive text; its ``spec_decode`` object (body, and the final usage
    chunk of a stream) says ``degraded_reason: drafter_error``; the step log carries the
    new columns; the Prometheus counter goes up once with that reason."""
    import asyncio

    from actors.serve.deployments import StrategyReplica as Replica
    from actors.serve.openai_response import ResponseContext, collect_body, sse_events
    from actors.serve.protocol import Admitted

    prompt = heldout_prompts[2]["prompt"]
    greedy = {"max_tokens": 24, "temperature": 0.0}

    async def request(rep, rid, stream=False):
        gen = rep.generate(rid, prompt, greedy)
        first = await gen.__anext__()
        assert isinstance(first, Admitted), first
        ctx = ResponseContext(rid, "ngram", 0, False, first.num_prompt_tokens)
        if stream:
            import json
            return [json.loads(x[6:]) for x in
                    [line async for line in sse_events(gen, ctx, include_usage=True)]
                    if x.startswith("data: ") and x[6:].strip() != "[DONE]"]
        return await collect_body(gen, ctx)

    class Counter:
        def __init__(self):
            self.calls = []

        def inc(self, value=1.0, tags=None):
            self.calls.append((value, tags))

    async def main():
        rep = Replica("ngram", {"strategy": "ngram", "max_num_seqs": 8, "torch_threads": 1},
                      "tests.test_drafter_degrade:make_degrading_engine", engine_process=False)
        rep._metrics.degraded = Counter()
        try:
            ok = await request(rep, "ok-0")
            bad, ok1 = await asyncio.gather(request(rep, "bad-1"), request(rep, "ok-1"))
            ev = await request(rep, "bad-1", stream=True)   # id reused: degraded again
            rows = await rep.step_log()
        finally:
            rep.engine.shutdown()
        return ok, bad, ok1, ev, rows, rep._metrics.degraded.calls

    ok, bad, ok1, ev, rows, calls = asyncio.run(main())
    assert bad["choices"][0]["token_ids"] == ok["choices"][0]["token_ids"]
    assert bad["choices"][0]["finish_reason"] == ok["choices"][0]["finish_reason"]
    assert bad[M.SPEC_DECODE_FIELD][M.DEGRADED_REASON] == M.DEGRADE_DRAFTER_ERROR
    assert ok[M.SPEC_DECODE_FIELD][M.DEGRADED_REASON] == ""
    assert ok1[M.SPEC_DECODE_FIELD][M.DEGRADED_REASON] == ""
    assert ok1[M.SPEC_DECODE_FIELD][M.NUM_DRAFTS] > 0
    assert ev[-1][M.SPEC_DECODE_FIELD][M.DEGRADED_REASON] == M.DEGRADE_DRAFTER_ERROR
    assert "".join(e["choices"][0]["text"] for e in ev if e["choices"]) == \
        ok["choices"][0]["text"]
    assert calls == [(1, {"reason": M.DEGRADE_DRAFTER_ERROR})] * 2
    assert sum(r[M.STEP_DEGRADED_REQUESTS] for r in rows) == 2
    assert {r[M.STEP_NUM_SPEC_TOKENS] for r in rows} == {4}
    assert any(r[M.STEP_SPECULATION_OFF] == M.DEGRADE_DRAFTER_ERROR for r in rows)


@pytest.mark.parametrize("family", [M.NGRAM, M.DFLASH])
def test_drafter_broken_for_everyone_degrades_all_and_fails_none(family, make_engine, prompts,
                                                                 reference):
    """A proposer that raises on every call from the third on: the batched call fails,
    every request's own retry fails too, so all four are degraded (drafter_error, logged),
    none fails, and all four still equal autoregressive."""
    eng = make_engine(family, max_num_seqs=8)
    real = eng.proposer
    eng.proposer = FaultyProposer(real, "*", "raise", after=2)
    before = collections.Counter(eng.degraded_requests)
    names = ["a", "b", "c", "d"]
    try:
        res, rows, _ = _drive(eng, [(n, p["prompt"]) for n, p in zip(names, prompts)], "a")
    finally:
        eng.proposer = real
    assert all(res[n]["finish_reason"] not in (None, "error") for n in names), res
    assert [res[n]["stats"].degraded_reason for n in names] == [M.DEGRADE_DRAFTER_ERROR] * 4
    assert collections.Counter(eng.degraded_requests) - before == {M.DEGRADE_DRAFTER_ERROR: 4}
    assert sum(r[M.STEP_DEGRADED_REQUESTS] for r in rows) == 4
    for n, p in zip(names, prompts):
        assert res[n]["ids"] == reference[p["id"]]["token_ids"], n
