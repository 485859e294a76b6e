"""Forced acceptance (``rejection_sample_method: synthetic``) and block verification
(``rejection_sample_method: block``, Sun et al. 2024, arXiv 2403.10444) in the embedded
engine: vLLM 0.32's fields, checks and semantics (issue 46).

Statistical tolerances are derived from the sample size: Z = 4 standard errors
(a false failure about once in 16,000 runs of one check), never a fixed number.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from scipy.stats import chisquare

from actors.engine.config import EngineConfig
from actors.engine.llm_engine import run_requests
from actors.engine.types import SamplingParams
from actors.engine.verifier import (synthetic_num_accepted, verify_block, verify_sampling,
                                    verify_synthetic)
from configs.serve_config import (ServeAppConfig, acceptance_length_to_rates,
                                  unconditional_to_conditional_rates)
from tests.lossless import assert_sampling_lossless

Z = 4.0
SPECULATIVE = ["draft_model", "ngram", "dflash", "dflash2", "dspark"]


# --------------------------------------------------------------------------- config checks
DM = {"strategy": "draft_model", "num_speculative_tokens": 4}
BAD = [  # (engine fields, the message's text)
    ({**DM, "rejection_sample_method": "fancy"},
     "engine.rejection_sample_method: 'fancy' is unknown; expected one of "
     "['standard', 'synthetic', 'block']"),
    ({**DM, "rejection_sample_method": "synthetic"},
     "engine: rejection_sample_method='synthetic' requires exactly one of "
     "synthetic_acceptance_rates or synthetic_acceptance_length (got neither)"),
    ({**DM, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0,
      "synthetic_acceptance_rates": [1, 0, 0, 0]},
     "engine: rejection_sample_method='synthetic' requires exactly one of "
     "synthetic_acceptance_rates or synthetic_acceptance_length (got both)"),
    ({**DM, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 5.5},
     "engine.synthetic_acceptance_length must be in [1, 5] (num_speculative_tokens 4 + 1), "
     "got 5.5"),
    ({**DM, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 0.5},
     "engine.synthetic_acceptance_length must be in [1, 5] (num_speculative_tokens 4 + 1), "
     "got 0.5"),
    ({**DM, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.5]},
     "engine.synthetic_acceptance_rates must have length 4 (num_speculative_tokens), "
     "got [0.9, 0.5]"),
    ({**DM, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [1.2, 0.5, 0.2, 0.1]},
     "engine.synthetic_acceptance_rates entries must be in [0, 1], got [1.2, 0.5, 0.2, 0.1]"),
    ({**DM, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5, 0.6, 0.2, 0.1]},
     "engine.synthetic_acceptance_rates must be non-increasing (unconditional per-position "
     "rates), got [0.5, 0.6, 0.2, 0.1]"),
    ({"strategy": "autoregressive", "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 1.0},
     "engine.rejection_sample_method: 'synthetic' needs a speculative strategy "
     "(autoregressive verifies no drafts); use 'standard'"),
    ({**DM, "num_speculative_tokens": 0, "rejection_sample_method": "block"},
     "engine.rejection_sample_method: 'block' needs draft tokens (num_speculative_tokens is 0)"),
    ({**DM, "synthetic_acceptance_length": 2.0},
     "engine.synthetic_acceptance_rates / synthetic_acceptance_length are only valid with "
     "rejection_sample_method='synthetic' (got rejection_sample_method='standard')"),
]


@pytest.mark.parametrize("fields,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_values_fail_config_load_naming_the_field(fields, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(**fields)
    assert message in str(err.value)
    # the Serve config (configs/serve.yaml's schema) fails at load with the same text
    with pytest.raises(ValueError) as err:
        ServeAppConfig(strategies=[{"name": "x", "engine": fields}])
    assert message.replace("engine", "strategy 'x': engine", 1) in str(err.value)


def test_k_from_the_strategy_default_when_unset():
    # dflash's default k is 7: length 8 is allowed, 8.5 is not (EngineConfig knows k)
    assert EngineConfig(strategy="dflash", rejection_sample_method="synthetic",
                        synthetic_acceptance_length=8).synthetic_rates() == [1.0] * 7
    with pytest.raises(ValueError, match=r"must be in \[1, 8\]"):
        EngineConfig(strategy="dflash", rejection_sample_method="synthetic",
                      synthetic_acceptance_length=8.5)


def test_per_request_field_is_a_400_naming_it():
    from actors.engine.errors import InvalidRequest
    from actors.serve.openai_request import parse_request

    for field, value in [("rejection_sample_method", "synthetic"),
                         ("synthetic_acceptance_length", 3.0)]:
        with pytest.raises(InvalidRequest) as err:
            parse_request({"model": "draft_model", "prompt": "x", field: value}, chat=False)
        assert err.value.param == field and field in str(err.value)


def test_minimum_variance_schedule_as_vllm():
    assert acceptance_length_to_rates(3.5, 4) == [1.0, 1.0, 0.5, 0.0]
    assert acceptance_length_to_rates(5.0, 4) == [1.0, 1.0, 1.0, 1.0]
    assert acceptance_length_to_rates(1.0, 4) == [0.0, 0.0, 0.0, 0.0]
    assert unconditional_to_conditional_rates([0.8, 0.4, 0.1, 0.0]) == [0.8, 0.5, 0.25, 0.0]
    for a in (1.0, 1.5, 2.25, 3.5, 4.0, 5.0):
        assert math.isclose(1 + sum(acceptance_length_to_rates(a, 4)), a)


# ----------------------------------------------------------------- forced acceptance, verifier
@pytest.mark.parametrize("rates", [acceptance_length_to_rates(3.5, 4), [0.9, 0.6, 0.3, 0.1],
                                   acceptance_length_to_rates(1.5, 4)])
def test_synthetic_per_position_and_mean_match_the_schedule(rates):
    n = 20000
    gen = torch.Generator().manual_seed(7)
    cond = unconditional_to_conditional_rates(rates)
    counts = [synthetic_num_accepted(len(rates), cond, gen) for _ in range(n)]
    for i, r in enumerate(rates):
        got = sum(c > i for c in counts) / n
        assert abs(got - r) <= Z * math.sqrt(r * (1 - r) / n), (i, got, r)
    # tokens per step = 1 + accepted: its mean is 1 + sum(rates); its sd from the schedule
    probs = [1 - rates[0]] + [rates[i] - (rates[i + 1] if i + 1 < len(rates) else 0.0)
                              for i in range(len(rates))]
    mean = sum((a + 1) * p for a, p in enumerate(probs))
    sd = math.sqrt(sum((a + 1 - mean) ** 2 * p for a, p in enumerate(probs)))
    assert math.isclose(mean, 1 + sum(rates))
    assert abs(1 + sum(counts) / n - mean) <= Z * sd / math.sqrt(n) + 1e-12


def test_synthetic_keeps_drafts_and_takes_the_targets_next_token():
    draft = [5, 6, 7]
    target = [1, 2, 3, 4]      # greedy target argmax at [last, d1, d2, d3]
    res = verify_synthetic(target, draft, None, [1.0, 1.0, 0.0], torch.Generator(), True)
    assert res.num_accepted == 2 and res.emitted == [5, 6, 3]
    res = verify_synthetic(target, draft, None, [1.0, 1.0, 1.0], torch.Generator(), True)
    assert res.emitted == [5, 6, 7, 4]
    # fewer drafts than k: judged on its own positions, never more than it drafted
    res = verify_synthetic(target[:2], draft[:1], None, [1.0, 1.0, 1.0], torch.Generator(), True)
    assert res.emitted == [5, 2]


# ---------------------------------------------------------- block verification: goodness of fit
V, K, L = 3, 2, 3   # vocabulary, drafts per block, tokens generated per trial


def _tables(seed: int, one_hot_draft: bool):
    """p(. | prefix) and q(. | prefix) for every prefix (random, cached)."""
    rng = random.Random(seed)
    cache: dict = {}

    def dist(kind, prefix):
        key = (kind, tuple(prefix))
        if key not in cache:
            w = [rng.random() + 0.15 for _ in range(V)]
            t = torch.tensor(w)
            cache[key] = t / t.sum()
        return cache[key]

    def p(prefix):
        return dist("p", prefix)

    def q(prefix):
        d = dist("q", prefix)
        return torch.nn.functional.one_hot(d.argmax(), V).float() if one_hot_draft else d

    return p, q


def _exact(p, depth):
    out = {}

    def rec(prefix, pr):
        if len(prefix) == depth:
            out[tuple(prefix)] = pr
            return
        d = p(prefix)
        for t in range(V):
            rec(prefix + [t], pr * float(d[t]))

    rec([], 1.0)
    return out


def _generate(p, q, verify, gen, one_hot):
    seq: list[int] = []
    steps = accepted = 0
    while len(seq) < L:
        drafts, qs = [], []
        for _ in range(K):
            qd = q(seq + drafts)
            drafts.append(int(torch.multinomial(qd, 1, generator=gen)))
            qs.append(qd)
        ps = torch.stack([p(seq + drafts[:i]) for i in range(K + 1)])
        res = verify(ps, drafts, None if one_hot else torch.stack(qs), gen)
        seq += res.emitted
        steps += 1
        accepted += res.num_accepted
    return tuple(seq[:L]), steps, accepted


def gof_pvalue(verify, one_hot: bool, n: int = 6000, seed: int = 3) -> tuple[float, float]:
    """(chi-square p-value of ``n`` generated L-token sequences against the target's
    exact joint, tokens per verify step)."""
    p, q = _tables(seed, one_hot)
    gen = torch.Generator().manual_seed(seed)
    exact = _exact(p, L)
    counts = {s: 0 for s in exact}
    steps = accepted = 0
    for _ in range(n):
        s, st, ac = _generate(p, q, verify, gen, one_hot)
        counts[s] += 1
        steps += st
        accepted += ac
    obs = [counts[s] for s in exact]
    total = sum(exact.values())
    exp = [exact[s] * n / total for s in exact]     # sums to n (float round-off)
    assert min(exp) >= 5
    return float(chisquare(obs, exp).pvalue), 1 + accepted / steps


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-probs", "one-hot"])
def test_block_verification_output_has_the_targets_distribution(one_hot):
    pval, tau = gof_pvalue(verify_block, one_hot)
    assert pval > 0.001, pval
    assert 1.0 <= tau <= K + 1


def test_block_accepts_at_least_token_by_token_in_expectation():
    # Sun et al. 2024, Thm 2: E[tokens per step] of block >= token-by-token verification
    p, q = _tables(11, False)
    n = 4000
    res = {}
    for name, fn in (("block", verify_block), ("standard", verify_sampling)):
        gen = torch.Generator().manual_seed(5)
        taus = []
        for _ in range(n):
            drafts, qs = [], []
            for _ in range(K):
                qd = q(drafts)
                drafts.append(int(torch.multinomial(qd, 1, generator=gen)))
                qs.append(qd)
            ps = torch.stack([p(drafts[:i]) for i in range(K + 1)])
            taus.append(1 + fn(ps, drafts, torch.stack(qs), gen).num_accepted)
        mean = sum(taus) / n
        sd = math.sqrt(sum((t - mean) ** 2 for t in taus) / (n - 1))
        res[name] = (mean, sd)
    se = math.hypot(res["block"][1], res["standard"][1]) / math.sqrt(n)
    assert res["block"][0] >= res["standard"][0] - Z * se, res


# ------------------------------------------------------------------------- engine level
@pytest.fixture(scope="module")
def reference(make_engine, heldout_prompts):
    eng = make_engine("autoregressive", max_num_seqs=8)
    return run_requests(eng, [(p["id"], p["prompt"], SamplingParams(max_tokens=24))
                              for p in heldout_prompts[:8]], batch_size=8)


@pytest.mark.parametrize("strategy", SPECULATIVE)
def test_block_greedy_output_identical_to_standard(strategy, make_engine, heldout_prompts,
                                                   reference):
    eng = make_engine(strategy, max_num_seqs=8, rejection_sample_method="block")
    out = run_requests(eng, [(p["id"], p["prompt"], SamplingParams(max_tokens=24))
                             for p in heldout_prompts[:8]], batch_size=8)
    for p in heldout_prompts[:8]:
        assert out[p["id"]]["token_ids"] == reference[p["id"]]["token_ids"], p["id"]


def test_block_sampling_lossless_in_the_engine(make_engine):
    """The engine-level goodness of fit (tests/lossless.py: the joint of the first three
    emitted tokens against the target's exact distribution) under block verification."""
    engine = make_engine("draft_model", max_num_seqs=64, num_speculative_tokens=2,
                         rejection_sample_method="block")
    assert_sampling_lossless(engine)


@pytest.mark.parametrize("strategy", SPECULATIVE)
def test_synthetic_engine_acceptance_matches_the_schedule(strategy, make_engine, heldout_prompts):
    """Every speculative strategy: the measured tokens per step equals the schedule's
    expectation given the drafts each step actually proposed (a step of n < k drafts is
    judged on its n positions), and the output is marked synthetic."""
    k = 4
    rates = [0.9, 0.7, 0.4, 0.2]
    eng = make_engine(strategy, max_num_seqs=8, num_speculative_tokens=k,
                      rejection_sample_method="synthetic", synthetic_acceptance_rates=rates)
    lengths: list[int] = []
    real = eng.proposer.propose

    def spy(items):
        out = real(items)
        lengths.extend(len(p.token_ids) for p in out)
        return out

    eng.proposer.propose = spy
    try:
        n_req, max_tokens = 8, 64
        out = run_requests(eng, [(p["id"], p["prompt"], SamplingParams(
            max_tokens=max_tokens, ignore_eos=True)) for p in heldout_prompts[:n_req]],
            batch_size=8)
    finally:
        del eng.proposer.propose
    drafted = [n for n in lengths if n > 0]
    steps = sum(o["stats"].num_drafts for o in out.values())
    acc = sum(o["stats"].num_accepted_tokens for o in out.values())
    assert all(o["stats"].synthetic for o in out.values())
    assert steps == len(drafted) and steps > 50
    # expectation and variance of tokens per step given each step's draft length n
    exp = var = 0.0
    for n in drafted:
        r = rates[:n]
        probs = [1 - r[0]] + [r[i] - (r[i + 1] if i + 1 < n else 0.0) for i in range(n)]
        m = sum(a * pr for a, pr in enumerate(probs))
        exp += m
        var += sum((a - m) ** 2 * pr for a, pr in enumerate(probs))
    # a request's last step may be cut by max_tokens (the engine counts what the user
    # received): at most k - 1 tokens per request below the draw
    slack = n_req * (k - 1)
    assert exp - Z * math.sqrt(var) - slack <= acc <= exp + Z * math.sqrt(var), \
        (strategy, acc, exp, var)


def test_synthetic_length_engine_measured_equals_set(make_engine, heldout_prompts):
    """draft_model k=4 at A = 2.5: measured tokens per step within the statistical
    tolerance of the set length (sd 0.5 per step: one forced coin at position 2)."""
    eng = make_engine("draft_model", max_num_seqs=8, num_speculative_tokens=4,
                      rejection_sample_method="synthetic", synthetic_acceptance_length=2.5)
    n_req = 16
    out = run_requests(eng, [(p["id"], p["prompt"], SamplingParams(
        max_tokens=128, ignore_eos=True)) for p in heldout_prompts[:n_req]], batch_size=8)
    steps = sum(o["stats"].num_drafts for o in out.values())
    acc = sum(o["stats"].num_accepted_tokens for o in out.values())
    per_pos = [sum(o["stats"].num_accepted_tokens_per_pos[i] for o in out.values()) / steps
               for i in range(2)]
    assert per_pos[0] >= 1 - n_req / steps     # position 1 always accepted (cuts aside)
    assert abs(per_pos[1] - 0.5) <= Z * math.sqrt(0.25 / steps) + n_req / steps
    got = 1 + acc / steps
    assert abs(got - 2.5) <= Z * 0.5 / math.sqrt(steps) + n_req * 3 / steps, got


# ------------------------------------------------------------------------- backend vllm
def test_fields_pass_through_to_vllms_speculative_config():
    from actors.engine.vllm_backend import vllm_engine_args

    cfg = EngineConfig(strategy="ngram", backend="vllm", num_speculative_tokens=3,
                       rejection_sample_method="synthetic",
                       synthetic_acceptance_rates=[0.8, 0.5, 0.1]).model_dump()
    spec = vllm_engine_args(cfg)["speculative_config"]
    assert spec["rejection_sample_method"] == "synthetic"
    assert spec["synthetic_acceptance_rates"] == [0.8, 0.5, 0.1]
    assert "synthetic_acceptance_length" not in spec
    spec = vllm_engine_args(EngineConfig(strategy="ngram", backend="vllm",
                                         rejection_sample_method="block").model_dump())
    assert spec["speculative_config"]["rejection_sample_method"] == "block"


class _FakeVllm:
    """A vLLM LLMEngine stand-in: ``fail`` raised from step(), or never finishing."""

    def __init__(self, fail: BaseException | None = None, finishes: bool = True):
        self.fail, self.finishes, self.reqs, self.steps = fail, finishes, [], 0

    def add_request(self, rid, prompt, params):
        self.reqs.append(rid)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        self.steps += 1
        if self.fail is not None:
            raise self.fail
        if self.finishes and self.steps >= 3:
            self.reqs.clear()


def test_a_vllm_build_that_refuses_fails_fast_with_its_reason():
    """Fake vLLM (a monkeypatched engine, not a real start-up): the CPU build's kernel
    assertion at the first verify step becomes the deploy's error, naming the field."""
    from actors.engine.vllm_backend import probe_rejection_sampler

    reason = "Synthetic acceptance not supported with CPU sampling"
    with pytest.raises(ValueError) as err:
        probe_rejection_sampler(_FakeVllm(AssertionError(reason)), "synthetic",
                                sampling_params=dict)
    assert str(err.value) == ("engine.rejection_sample_method: 'synthetic' is refused by this "
                              f"vLLM build: AssertionError: {reason}")
    hung = _FakeVllm(finishes=False)
    with pytest.raises(ValueError, match="unfinished after 64 engine steps"):
        probe_rejection_sampler(hung, "synthetic", sampling_params=dict)
    assert hung.steps == 64
    ok = _FakeVllm()
    probe_rejection_sampler(ok, "synthetic", sampling_params=dict)
    assert ok.steps == 3
