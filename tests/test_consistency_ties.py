"""Tie-aware output consistency (issue 19): a first divergence where the baseline's own
top logprobs put the strategy's token within the tolerance of its best is a numerical tie,
not a violation; only violations flag a strategy."""

from __future__ import annotations

import math

import pytest

from analysis.data import consistency as c
from loadgen.cli.consistency import top_logprobs_of


def test_classify_divergence_cases():
    # the embedded target's real case: two best logits 1.1e-6 apart (fp64)
    assert c.classify_divergence({7: -0.6931, 9: -0.6931011, 3: -4.0}, 7, 9, 1e-3)[0] == c.TIE
    kind, gap = c.classify_divergence({7: -0.1, 9: -2.5}, 7, 9, 1e-3)
    assert kind == c.VIOLATION and gap == pytest.approx(2.4)
    # not in the baseline's top-N: at least as far as the N-th best
    kind, gap = c.classify_divergence({7: -0.1, 9: -2.5}, 7, 42, 1e-3)
    assert kind == c.VIOLATION and gap == pytest.approx(2.4)
    # top-N all within the tolerance and the token not among them: cannot tell
    assert c.classify_divergence({7: -1.0, 9: -1.0}, 7, 42, 1e-3)[0] == c.UNCLASSIFIED
    assert c.classify_divergence(None, 7, 9, 1e-3) == (c.UNCLASSIFIED, None)
    # the strategy ended (EOS) where the baseline went on: EOS's logprob decides
    assert c.classify_divergence({7: -0.5, 0: -0.5002}, 7, None, 1e-3, eos_token_id=0)[0] == c.TIE
    assert c.classify_divergence({7: -0.5, 0: -0.5002}, 7, None, 1e-3)[0] == c.UNCLASSIFIED
    # bf16's tolerance takes a gap fp32's does not
    assert c.classify_divergence({7: -0.5, 9: -0.6}, 7, 9, c.tie_tolerance("bfloat16"))[0] == c.TIE
    assert c.classify_divergence({7: -0.5, 9: -0.6}, 7, 9, c.tie_tolerance("float32"))[0] == c.VIOLATION


def test_tolerance_is_the_loosest_dtypes():
    assert c.tie_tolerance() == c.TIE_TOLERANCE["float32"]
    assert c.tie_tolerance("float32", "bfloat16") == c.TIE_TOLERANCE["bfloat16"]
    assert c.tie_tolerance("torch.float16") == c.TIE_TOLERANCE["float16"]
    assert c.tie_tolerance("fp8-something") == c.TIE_TOLERANCE["bfloat16"]   # unknown: loosest


def _tops(n: int, best: int, other: int | None = None, gap: float = 0.0) -> list[dict]:
    row = {best: -0.2}
    if other is not None:
        row[other] = -0.2 - gap
    return [dict(row) for _ in range(n)]


def test_compare_counts_ties_and_violations_and_only_violations_flag():
    base = {"p0": [1, 2, 3, 4], "p1": [1, 2, 3, 4], "p2": [5, 6, 7, 8]}
    tops = {"p0": _tops(4, 3, 9, 1e-6), "p1": _tops(4, 3, 9, 3.0), "p2": _tops(4, 7)}
    # a lossless strategy that took the other side of a tie at p0 position 2
    tie_only = c.compare_outputs(base, {"p0": [1, 2, 9, 4], "p1": [1, 2, 3, 4], "p2": [5, 6, 7, 8]},
                                 "short", baseline_top=tops, tolerance=1e-3)
    assert (tie_only["identical"], tie_only["ties"], tie_only["violations"]) == (2, 1, 0)
    assert tie_only["first_divergence"][0]["kind"] == c.TIE
    assert not c.diverges(tie_only)
    # a broken strategy: flips a token where the baseline's margin is 3 nats (p1)
    broken = c.compare_outputs(base, {"p0": [1, 2, 3, 4], "p1": [1, 2, 9, 4], "p2": [5, 6, 7, 8]},
                               "short", baseline_top=tops, tolerance=1e-3)
    assert (broken["ties"], broken["violations"]) == (0, 1) and c.diverges(broken)
    assert broken["first_divergence"][0]["gap"] == pytest.approx(3.0)
    # without classification every divergence counts (text mode, no logprobs)
    plain = c.compare_outputs(base, {"p0": [1, 2, 9, 4], "p1": [1, 2, 3, 4]}, "short")
    assert "violations" not in plain and c.diverges(plain)


def test_merge_and_table_carry_the_classification(tmp_path):
    a = {"compared": 3, "identical": 2, "ties": 1, "violations": 0, "unclassified": 0,
         "tolerance": 1e-3, "first_divergence": [{"position": 2}]}
    b = {"compared": 3, "identical": 3, "ties": 0, "violations": 0, "unclassified": 0,
         "tolerance": 1e-3, "first_divergence": []}
    m = c.merge_counts([a, b])
    assert (m["compared"], m["identical"], m["ties"], m["violations"]) == (6, 5, 1, 0)
    assert m["tolerance"] == 1e-3 and not c.diverges(m)
    row = c.consistency_table({"dspark": m}).iloc[0]
    assert row["ties"] == 1 and row["violations"] == 0 and not row["diverges"]
    assert math.isclose(row["tie_tolerance"], 1e-3)


def test_top_logprobs_parsed_from_token_id_rendering():
    choice = {"logprobs": {"tokens": ["token_id:5", "token_id:9"],
                           "top_logprobs": [{"token_id:5": -0.1, "token_id:6": -2.0},
                                            {"token_id:9": -0.3}]}}
    assert top_logprobs_of(choice) == [{5: -0.1, 6: -2.0}, {9: -0.3}]
    # tokens rendered as text: ids cannot be recovered, so nothing is classified
    assert top_logprobs_of({"logprobs": {"top_logprobs": [{"def": -0.1}]}}) is None
    assert top_logprobs_of({"text": "x"}) is None


# --- real engines: specload's six strategies, and a deliberately broken one ---------------
STRATEGIES = ["autoregressive", "draft_model", "ngram", "dflash", "dflash2", "dspark"]


@pytest.fixture(scope="module")
def real_outputs(make_engine, heldout_prompts):
    """Greedy outputs of every strategy on 12 held-out prompts (6 code, 6 prose), 32
    tokens, in one ragged batch; the baseline also returns its top-5 logprobs."""
    from actors.engine.llm_engine import run_requests
    from actors.engine.types import SamplingParams

    prompts = heldout_prompts[:6] + heldout_prompts[24:30]
    out = {}
    for s in STRATEGIES:
        eng = make_engine(s, max_num_seqs=12)
        lp = c.TOP_LOGPROBS if s == "autoregressive" else None
        out[s] = run_requests(eng, [(p["id"], p["prompt"], SamplingParams(
            max_tokens=32, logprobs=lp)) for p in prompts], batch_size=len(prompts))
    return out


def _baseline_top(res: dict) -> dict[str, list[dict[int, float]]]:
    return {k: [{t: v for t, _, _, v in e.top} | {e.token_id: e.logprob} for e in r["logprobs"]]
            for k, r in res.items()}


def test_six_strategies_have_no_violation(real_outputs):
    base = real_outputs["autoregressive"]
    tops = _baseline_top(base)
    ids = {s: {k: r["token_ids"] for k, r in real_outputs[s].items()} for s in STRATEGIES}
    table = {}
    for s in STRATEGIES:
        e = c.compare_outputs(ids["autoregressive"], ids[s], "short", baseline_top=tops,
                              tolerance=c.tie_tolerance("float32"))
        table[s] = (e["compared"], e["identical"], e["ties"], e["violations"])
        assert e["compared"] == 12 and e["violations"] == 0 and e["unclassified"] == 0, (s, e)
        assert e["identical"] + e["ties"] == 12
    print("\nstrategy: compared / identical / tie / violation", table)


def test_a_broken_strategy_is_a_violation(real_outputs):
    """A test double: autoregressive's output with one token flipped, at the position
    where the baseline's margin to its runner-up is largest: a violation, with that gap."""
    base = real_outputs["autoregressive"]
    tops = _baseline_top(base)
    key, pos, gap = max(((k, i, max(row.values()) - sorted(row.values())[-2])
                         for k, rows in tops.items() for i, row in enumerate(rows)),
                        key=lambda x: x[2])
    assert gap > 1.0   # a decisive position exists on held-out text
    ids = {k: list(r["token_ids"]) for k, r in base.items()}
    broken = {k: list(v) for k, v in ids.items()}
    row = tops[key][pos]
    runner_up = sorted(row, key=row.get)[-2]
    broken[key][pos] = runner_up
    e = c.compare_outputs(ids, broken, "short", baseline_top=tops,
                          tolerance=c.tie_tolerance("float32"))
    assert (e["identical"], e["ties"], e["violations"]) == (11, 0, 1)
    assert e["first_divergence"][0]["kind"] == c.VIOLATION
    assert e["first_divergence"][0]["gap"] == pytest.approx(gap, rel=1e-6)
    assert c.diverges(e)
