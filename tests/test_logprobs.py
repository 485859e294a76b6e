"""Engine-level logprobs, min_tokens and skip_special_tokens for every strategy
(issues 19 items 4 + 6 and 22).

- logprobs are the target's, at every emitted position: for greedy requests every
  strategy's equal the autoregressive engine's (fp32, LOGPROB_TOL) and the chosen
  token is the argmax of the top entries; for sampled requests they are the
  temperature / top-k / top-p processed ones (checked against a fresh target forward).
- min_tokens masks EOS in the target's processing, so greedy output stays identical
  across strategies and is at least min_tokens long; stop strings count only after
  the first min_tokens tokens (vLLM's detokenizer semantics).
- skip_special_tokens (default true) keeps ``<|endoftext|>`` out of the text; token ids
  and counts do not change.

The tiny target practically never picks EOS greedily, so the min_tokens tests give the
engine another EOS id (``engine.eos_token_id``, as tests/test_reliability.py does), and
the special-token tests sample at a position where EOS is the second candidate.
"""

from __future__ import annotations

import math

import pytest
import torch

from actors.engine.llm_engine import run_requests
from actors.engine.sampling import logprob_rows
from actors.engine.types import SamplingParams
from tests.logprob_checks import (ALL_STRATEGIES, LOGPROB_TOL, check_greedy_entry,
                                  same_or_tie)

PROMPT_IDX = (0, 1, 24, 25)    # 2 code + 2 prose held-out prompts
MAX_TOKENS = 24
TOP_N = 5
EOS_TEXT = "<|endoftext|>"


def _engine(make_engine, strategy):
    return make_engine(strategy, max_num_seqs=8)


def _prompts(heldout_prompts):
    return [heldout_prompts[i] for i in PROMPT_IDX]


def _top(entry) -> dict[int, float]:
    return {t: v for t, _, _, v in entry.top} | {entry.token_id: entry.logprob}


@pytest.fixture(scope="module")
def ar_reference(make_engine, heldout_prompts):
    """Autoregressive greedy outputs with logprobs, one request at a time."""
    eng = _engine(make_engine, "autoregressive")
    return run_requests(eng, [(p["id"], p["prompt"], SamplingParams(
        max_tokens=MAX_TOKENS, logprobs=TOP_N)) for p in _prompts(heldout_prompts)])


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_greedy_logprobs_equal_autoregressive(strategy, make_engine, heldout_prompts,
                                              ar_reference):
    """4 prompts in one ragged batch: ids equal (up to a numerical tie), every emitted
    position's logprob and top-5 within LOGPROB_TOL of autoregressive's, the chosen token
    the argmax, text offsets consistent with the text."""
    eng = _engine(make_engine, strategy)
    prompts = _prompts(heldout_prompts)
    out = run_requests(eng, [(p["id"], p["prompt"], SamplingParams(
        max_tokens=MAX_TOKENS, logprobs=TOP_N)) for p in prompts], batch_size=len(prompts))
    worst = 0.0
    for p in prompts:
        ref, got = ar_reference[p["id"]], out[p["id"]]
        assert len(got["logprobs"]) == len(got["token_ids"])
        assert [e.token_id for e in got["logprobs"]] == got["token_ids"]
        n = same_or_tie(ref["token_ids"], [_top(e) for e in ref["logprobs"]], got["token_ids"])
        assert n >= 8, (p["id"], n)
        for a, b in zip(ref["logprobs"][:n], got["logprobs"][:n]):
            check_greedy_entry(b.token_id, b.logprob, [(t, v) for t, _, _, v in b.top], TOP_N)
            worst = max(worst, abs(a.logprob - b.logprob))
            assert abs(a.logprob - b.logprob) < LOGPROB_TOL
            for (_, _, _, va), (_, _, _, vb) in zip(a.top, b.top):
                assert abs(va - vb) < LOGPROB_TOL
        offsets = [e.text_offset for e in got["logprobs"]]
        text = got["text"]
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
        if text.isascii():   # every token a whole character: the pieces are the text
            assert "".join(e.token for e in got["logprobs"]) == text
            for e, nxt in zip(got["logprobs"], offsets[1:] + [len(text)]):
                assert text[e.text_offset:nxt] == e.token
    print(f"{strategy}: max |logprob - autoregressive| = {worst:.2e}")


@pytest.mark.parametrize("strategy", ["autoregressive", "draft_model", "ngram", "dflash2"])
def test_sampled_logprobs_are_processed(strategy, make_engine, heldout_prompts):
    """temperature 0.7, top_k 4, logprobs 6: each chosen token's logprob is the processed
    one of a fresh target forward at that prefix; the 2 entries past top_k are -inf
    (written -9999 in JSON); the chosen token is always inside top_k."""
    eng = _engine(make_engine, strategy)
    p = heldout_prompts[2]
    params = SamplingParams(max_tokens=16, temperature=0.7, top_k=4, seed=11, logprobs=6,
                            ignore_eos=True)
    got = run_requests(eng, [("s", p["prompt"], params)])["s"]
    ids = eng.tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        logits = eng.model(torch.tensor([ids + got["token_ids"]])).logits[0].float()
    want = logprob_rows(logits[len(ids) - 1:-1], params)
    for i, e in enumerate(got["logprobs"]):
        assert abs(e.logprob - float(want[i, e.token_id])) < LOGPROB_TOL, i
        vals = [v for _, _, _, v in e.top]
        assert all(math.isfinite(v) for v in vals[:4]) and vals[4:] == [-math.inf] * 2
        assert e.token_id in [t for t, _, _, _ in e.top[:4]]
        assert abs(math.fsum(math.exp(v) for v in vals[:4]) - 1) < 1e-4


def test_logprobs_cost_nothing_unless_asked(make_engine, heldout_prompts):
    eng = _engine(make_engine, "ngram")
    eng.add_request("q", heldout_prompts[0]["prompt"], SamplingParams(max_tokens=6))
    req = eng.requests["q"]
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs and all(o.logprobs is None for o in outs) and req.logprobs == []


# ------------------------------------------------------------------ min_tokens
MIN_TOKENS = 12


def _with_eos(engines, eos):
    """Give every engine ``eos`` as its EOS id; returns the previous ids."""
    old = [e.eos_token_id for e in engines]
    for e in engines:
        e.eos_token_id = eos
    return old


@pytest.fixture(scope="module")
def early_eos(make_engine, heldout_prompts):
    """(prompt, eos id): the autoregressive greedy output's third token, which then
    ends the request after 3 tokens."""
    p = heldout_prompts[0]["prompt"]
    eng = _engine(make_engine, "autoregressive")
    ids = run_requests(eng, [("e", p, SamplingParams(max_tokens=8))])["e"]["token_ids"]
    assert ids[2] not in ids[:2]
    return p, ids[2]


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_min_tokens_masks_eos_identically(strategy, make_engine, early_eos):
    prompt, eos = early_eos
    ar, eng = _engine(make_engine, "autoregressive"), _engine(make_engine, strategy)
    old = _with_eos([ar, eng], eos)
    try:
        plain = run_requests(eng, [("p", prompt, SamplingParams(max_tokens=MAX_TOKENS))])["p"]
        assert plain["finish_reason"] == "stop" and len(plain["token_ids"]) == 3
        params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MIN_TOKENS, logprobs=2)
        ref = run_requests(ar, [("r", prompt, params)])["r"]
        got = run_requests(eng, [("m", prompt, params)])["m"]
    finally:
        for e, o in zip([ar, eng], old):
            e.eos_token_id = o
    for res in (ref, got):
        ids = res["token_ids"]
        assert len(ids) >= MIN_TOKENS and eos not in ids[:MIN_TOKENS]
        # EOS is -inf where it is masked: never among the top entries there
        assert all(eos not in [t for t, *_ in e.top] for e in res["logprobs"][:MIN_TOKENS])
        assert res["finish_reason"] == ("stop" if ids[-1] == eos else "length")
    n = same_or_tie(ref["token_ids"], [_top(e) for e in ref["logprobs"]], got["token_ids"])
    assert n >= MIN_TOKENS
    assert max(abs(a.logprob - b.logprob) for a, b in
               zip(ref["logprobs"][:n], got["logprobs"][:n])) < LOGPROB_TOL


def test_min_tokens_defers_stop_strings(make_engine, heldout_prompts):
    """A stop string inside the first min_tokens tokens' text does not end the request;
    the first match ending after that text does (vLLM's detokenizer semantics)."""
    eng = _engine(make_engine, "ngram")
    p = heldout_prompts[0]["prompt"]
    full = run_requests(eng, [("f", p, SamplingParams(max_tokens=40, ignore_eos=True))])["f"]
    text, ids = full["text"], full["token_ids"]
    m = 6
    floor = len(eng.tokenizer.decode(ids[:m]))
    stops = [s for s in {text[i:i + 1] for i in range(floor)} if text.find(s, floor) > 0]
    assert stops, text
    stop = sorted(stops)[0]
    assert text.find(stop) < floor
    got = run_requests(eng, [("s", p, SamplingParams(max_tokens=40, ignore_eos=True,
                                                     stop=[stop], min_tokens=m))])["s"]
    assert got["finish_reason"] == "stop"
    assert got["text"] == text[:text.find(stop, floor)]
    assert len(got["token_ids"]) > m
    early = run_requests(eng, [("e", p, SamplingParams(max_tokens=40, ignore_eos=True,
                                                       stop=[stop]))])["e"]
    assert early["text"] == text[:text.find(stop)]


@pytest.mark.parametrize("kwargs,param", [({"min_tokens": -1}, "min_tokens"),
                                          ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
                                          ({"logprobs": 21}, "logprobs"),
                                          ({"logprobs": -1}, "logprobs"),
                                          ({"logprobs": True}, "logprobs"),
                                          ({"skip_special_tokens": 1}, "skip_special_tokens")])
def test_bad_new_params_name_the_field(kwargs, param):
    from actors.engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


# ------------------------------------------------------------------ skip_special_tokens
def eos_prompt_ids(tokenizer, heldout_prompts) -> list[int]:
    """A held-out prefix after which EOS is the target's second candidate."""
    return tokenizer(heldout_prompts[15]["prompt"], add_special_tokens=False)["input_ids"][:30]


EOS_SAMPLING = dict(max_tokens=16, temperature=3.0, top_k=2, ignore_eos=True)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_skip_special_tokens(strategy, make_engine, heldout_prompts):
    """ignore_eos: a seeded request whose tokens include EOS: the default text has no
    ``<|endoftext|>``, skip_special_tokens false has one per EOS id; same ids."""
    eng = _engine(make_engine, strategy)
    ids = eos_prompt_ids(eng.tokenizer, heldout_prompts)
    for seed in range(40):
        hidden = run_requests(eng, [("h", ids, SamplingParams(seed=seed, **EOS_SAMPLING))])["h"]
        if 0 in hidden["token_ids"]:
            break
    else:
        pytest.fail("no seed in 0..39 emitted EOS")
    shown = run_requests(eng, [("s", ids, SamplingParams(seed=seed, skip_special_tokens=False,
                                                         **EOS_SAMPLING))])["s"]
    assert shown["token_ids"] == hidden["token_ids"] and len(shown["token_ids"]) == 16
    assert EOS_TEXT not in hidden["text"]
    assert shown["text"].count(EOS_TEXT) == hidden["token_ids"].count(0) >= 1
    assert shown["text"].replace(EOS_TEXT, "") == hidden["text"]


def test_draft_model_masks_eos_in_q_before_min_tokens(make_engine, heldout_prompts):
    """The draft model's proposal skips a token that is EOS before min_tokens (as the
    target's processing), and proposes it again once min_tokens is reached."""
    from actors.engine.types import ProposeInput

    eng = _engine(make_engine, "draft_model")
    prop = eng.proposer
    ids = eng.tokenizer(heldout_prompts[3]["prompt"], add_special_tokens=False)["input_ids"]

    def first(params, num_output, eos):
        prop.add_request("dq", ids)
        try:
            return prop.propose([ProposeInput("dq", ids, 2, params, None, num_output, eos)]
                                )[0].token_ids
        finally:
            prop.remove_request("dq")

    plain = first(SamplingParams(max_tokens=8), 3, None)
    masked = first(SamplingParams(max_tokens=8, min_tokens=4), 3, plain[0])
    assert masked[0] != plain[0]
    assert first(SamplingParams(max_tokens=8, min_tokens=3), 3, plain[0]) == plain


def test_token_texts_are_the_tokens_bytes(make_engine, heldout_prompts):
    """Every vocabulary entry: its text is ``decode([id])`` and its bytes, joined over a
    sequence, decode to the sequence's text (also across split UTF-8 characters)."""
    eng = _engine(make_engine, "autoregressive")
    tok, texts = eng.tokenizer, eng.detok.token_texts
    for i in range(len(tok)):
        assert texts.get(i)[0] == tok.decode([i]), i
    ids = tok("naïve café — ½ ∑ 東京 " + heldout_prompts[30]["prompt"][:200],
              add_special_tokens=False)["input_ids"]
    assert b"".join(texts.get(i)[1] for i in ids).decode() == tok.decode(ids)
    assert texts.get(eng.eos_token_id) == (EOS_TEXT, EOS_TEXT.encode())


@pytest.mark.parametrize("strategy", ["draft_model", "dflash2"])
def test_min_tokens_sampling_lossless(strategy, make_engine):
    """Sampled, with the target's most likely first token made EOS and min_tokens 4: the
    joint of the first three tokens is the target's distribution with that token masked
    (chi-square over 2,000 seeded requests; drafts proposing it are rejected)."""
    from tests.lossless import PARAMS, PROMPT, assert_sampling_lossless

    eng = make_engine(strategy, max_num_seqs=64, num_speculative_tokens=2)
    ids = eng.tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        eos = int(eng.model(torch.tensor([ids])).logits[0, -1].argmax())
    params = {**PARAMS, "ignore_eos": False, "min_tokens": 4}
    old = _with_eos([eng], eos)
    try:
        assert_sampling_lossless(eng, params=params, masked=eos)
    finally:
        eng.eos_token_id = old[0]
