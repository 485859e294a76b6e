"""Output consistency measured in the run: every strategy's output against the baseline's.

Greedy check (default on for greedy profiles, ``--consistency N``, default 16):
the first N prompts of the run, with the max_tokens each cell's request of the
same index gets, are sent to every strategy with temperature 0 (non-streamed
``POST /v1/completions``, up to ``concurrency`` in flight per strategy), and
each output is compared token by token with the baseline's (``autoregressive``):
token ids when the target returns them (specload and vLLM put ``token_ids``
on each choice), the text otherwise. The baseline's requests also ask for its top
logprobs at every position (``logprobs: 5``, ``return_tokens_as_token_ids: true``,
as vLLM names it), so each first divergence is classified as a numerical ``tie`` or a
``violation`` (``analysis.data.consistency.classify_divergence``) with the tie
tolerance of the engines' dtype (``--consistency-dtype``, or
``--consistency-tie-tolerance``). The baseline may be served elsewhere
(``--consistency-baseline-target URL``): specload's fp32 engine as the baseline of a
vLLM bf16 target, for instance.

Sampled check (opt-in, ``--consistency-sampled N``): N seeded requests per
strategy (request j: prompt j mod the N prompts above, seed j), ``positions``
output tokens each, at the profile's temperature (1.0 when the profile is
greedy). The distribution of the token at each output position (position 0:
the first token; position 1: the first token decided by a verification step
in engines that draft after prefill) is compared with the baseline's by a
chi-square test of homogeneity, Bonferroni-corrected over positions
(``analysis.data.consistency``).

The result is written to ``consistency.json`` in the run directory.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from analysis.data.consistency import (CONSISTENCY_FILE, DEFAULT_ALPHA, TOP_LOGPROBS,
                                       compare_outputs, first_token_test, merge_counts,
                                       sampled_verdict)
from configs import metric_names as M
from configs.jsonio import write_json
from configs.tiers import MaxTokens
from loadgen.run.service import ssl_context

DEFAULT_SAMPLES = 16
DEFAULT_POSITIONS = 2
DEFAULT_CONCURRENCY = 4


class CompletionError(RuntimeError):
    """A consistency request failed (HTTP error, bad body, no choice)."""


TOKEN_ID_PREFIX = "token_id:"   # vLLM's rendering under return_tokens_as_token_ids


def top_logprobs_of(choice: dict) -> list[dict[int, float]] | None:
    """Per output position {token id: logprob} from an OpenAI completions choice's
    ``logprobs.top_logprobs`` whose tokens are rendered ``token_id:N``; None when the
    server sent none or rendered tokens as text (ids cannot be recovered)."""
    lp = choice.get("logprobs") if isinstance(choice, dict) else None
    tops = lp.get("top_logprobs") if isinstance(lp, dict) else None
    if not isinstance(tops, list) or not tops:
        return None
    out = []
    for pos in tops:
        row = {}
        for tok, v in (pos or {}).items():
            if not (isinstance(tok, str) and tok.startswith(TOKEN_ID_PREFIX)) or v is None:
                return None
            row[int(tok[len(TOKEN_ID_PREFIX):])] = float(v)
        out.append(row)
    return out


def complete_full(base_url: str, body: dict, timeout_s: float,
                  headers: dict[str, str] | None = None, insecure: bool = False) -> dict:
    """One non-streamed completion's first choice (the parsed JSON object).

    headers: extra HTTP headers (``--api-key`` / ``--header``); insecure: skip TLS
    verification of an https target. Raises CompletionError with the status and the
    server's message.
    """
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={**(headers or {}), "Content-Type": "application/json"},
                                 method="POST")
    ctx = ssl_context(insecure) if base_url.startswith("https://") else None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:  # noqa: S310
            data = json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as err:
        raise CompletionError(f"HTTP {err.code}: {err.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise CompletionError(str(err)) from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise CompletionError(f"no choices in {str(data)[:300]}")
    return choices[0]


def complete(base_url: str, body: dict, timeout_s: float, headers: dict[str, str] | None = None,
             insecure: bool = False) -> tuple[list[int] | None, str, list | None]:
    """One non-streamed completion: (token ids or None when the server sends none, text,
    top logprobs per position or None: ``top_logprobs_of``).

    headers: extra HTTP headers (``--api-key`` / ``--header``); insecure: skip TLS
    verification of an https target. Raises CompletionError with the status and the
    server's message.
    """
    c = complete_full(base_url, body, timeout_s, headers, insecure)
    ids = c.get("token_ids")
    return (list(ids) if isinstance(ids, list) else None), str(c.get("text") or ""), \
        top_logprobs_of(c)


def _run_all(base_url: str, bodies: list[dict], timeout_s: float, concurrency: int,
             headers: dict[str, str] | None = None, insecure: bool = False
             ) -> list[tuple[list[int] | None, str, list | None] | None]:
    """Send ``bodies`` (at most ``concurrency`` in flight); None for a failed request."""
    def one(body: dict):
        try:
            return complete(base_url, body, timeout_s, headers, insecure)
        except CompletionError:
            return None

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, bodies))


def _max_tokens(max_tokens: dict, seed: int, index: int, prompt_max: int | None) -> int:
    """The max_tokens the cell's request ``index`` gets (same draw as ``loadgen.run.cells``)."""
    return int(prompt_max or MaxTokens.model_validate(max_tokens).sample(
        random.Random(f"max-tokens-{seed}-{index}")))


def greedy_check(base_url: str, strategies: list[str], prompts: list[list[Any]],
                 max_tokens_by_class: dict[str, dict], seed: int, n: int = DEFAULT_SAMPLES,
                 baseline: str = M.AUTOREGRESSIVE, extra_body: dict | None = None,
                 timeout_s: float = 120.0, concurrency: int = DEFAULT_CONCURRENCY,
                 model_of: Callable[[str], str] = lambda s: s,
                 headers: dict[str, str] | None = None, insecure: bool = False,
                 tolerance: float | None = None, baseline_url: str | None = None) -> dict:
    """Greedy outputs of every strategy vs ``baseline`` on the first ``n`` prompts.

    prompts: [[prompt_id, text, max_tokens or None], ...] (the run's order);
    max_tokens_by_class: output class -> MaxTokens dump (one check per class).
    tolerance: the tie tolerance (nats) for classifying divergences (None: not
    classified). baseline_url: where ``baseline`` is served when not at ``base_url``
    (then it is compared with every strategy of ``base_url``, and needs not be one of
    them). Returns {strategy: entry} as in ``analysis.data.consistency``; the baseline's
    own entry has ``baseline_self``. Raises ValueError when ``baseline`` is not served.
    """
    if baseline not in strategies and baseline_url is None:
        raise ValueError(f"baseline {baseline!r} is not among the strategies {strategies}")
    everyone = strategies if baseline in strategies and baseline_url is None \
        else [baseline, *strategies]
    sample = prompts[:n]
    parts: dict[str, list[dict]] = {s: [] for s in everyone}
    modes: dict[str, str] = {}
    for oc, mt in max_tokens_by_class.items():
        outputs, errors = {}, {}
        for s in everyone:
            # the baseline's top logprobs classify a divergence as a tie or a violation
            top = {"logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True} \
                if s == baseline and tolerance is not None else {}
            url = baseline_url if s == baseline and baseline_url else base_url
            outputs[s], errors[s] = _greedy_outputs(
                url, sample, {**(extra_body or {}), "model": model_of(s), **top}, mt, seed,
                timeout_s, concurrency, headers, insecure)
        base = outputs[baseline]
        tops = {k: r[2] for k, r in base.items()} if tolerance is not None else None
        for s in everyone:
            use_ids = all(r[0] is not None for r in list(base.values()) + list(outputs[s].values()))
            modes[s] = "token_ids" if use_ids and modes.get(s, "token_ids") == "token_ids" else "text"
            pick = 0 if modes[s] == "token_ids" else 1
            part = compare_outputs({k: r[pick] for k, r in base.items()},
                                   {k: r[pick] for k, r in outputs[s].items()}, oc,
                                   baseline_top=tops if modes[s] == "token_ids" else None,
                                   tolerance=tolerance)
            part["errors"] = errors[s]
            parts[s].append(part)
    out = {}
    for s in everyone:
        entry = merge_counts(parts.setdefault(s, []))
        entry.update(mode=modes.get(s, "text"), baseline=baseline, samples_per_class=len(sample),
                     output_classes=list(max_tokens_by_class))
        if baseline_url and s == baseline:
            entry["baseline_url"] = baseline_url
        if s == baseline:
            entry["baseline_self"] = True
        out[s] = entry
    return out


def _greedy_outputs(url: str, sample: list[list[Any]], fields: dict, max_tokens: dict, seed: int,
                    timeout_s: float, concurrency: int, headers: dict[str, str] | None,
                    insecure: bool) -> tuple[dict[str, Any], int]:
    """One strategy's greedy completions of ``sample`` (``fields``: model, extra body, top
    logprobs) at one output class's ``max_tokens`` (a MaxTokens dump). Returns
    ({"<prompt_id>#<i>": (token ids, text, top logprobs)}, requests that failed)."""
    keys = [f"{p[0]}#{i}" for i, p in enumerate(sample)]
    # return_token_ids: vLLM sends the ids only when asked (specload always does)
    bodies = [{**fields, "prompt": p[1], "max_tokens": _max_tokens(max_tokens, seed, i, p[2]),
               "temperature": 0.0, "seed": seed, "return_token_ids": True}
              for i, p in enumerate(sample)]
    res = _run_all(url, bodies, timeout_s, concurrency, headers, insecure)
    return {k: r for k, r in zip(keys, res) if r is not None}, sum(r is None for r in res)


def sampled_check(base_url: str, strategies: list[str], prompts: list[list[Any]], n: int,
                  temperature: float, top_p: float = 1.0, top_k: int = 0,
                  positions: int = DEFAULT_POSITIONS, n_prompts: int = DEFAULT_SAMPLES,
                  baseline: str = M.AUTOREGRESSIVE, alpha: float = DEFAULT_ALPHA,
                  extra_body: dict | None = None, timeout_s: float = 120.0,
                  concurrency: int = DEFAULT_CONCURRENCY,
                  model_of: Callable[[str], str] = lambda s: s,
                  headers: dict[str, str] | None = None, insecure: bool = False) -> dict:
    """Per strategy: chi-square tests of the output-position token distributions vs the
    baseline's over ``n`` seeded requests (see module doc). Returns {strategy: {"n",
    "temperature", "positions": [test per position], "min_p_value", "alpha", "level",
    "diverges"}}. Raises ValueError for n < 1, temperature <= 0 or an absent baseline."""
    if n < 1 or not temperature > 0:
        raise ValueError(f"the sampled check needs n >= 1 and temperature > 0, got n={n}, "
                         f"temperature={temperature}")
    if baseline not in strategies:
        raise ValueError(f"baseline {baseline!r} is not among the strategies {strategies}")
    use = prompts[:max(1, n_prompts)]
    tokens: dict[str, list[list]] = {}
    for s in strategies:
        bodies = [{**(extra_body or {}), "model": model_of(s), "prompt": use[j % len(use)][1],
                   "max_tokens": positions, "temperature": temperature, "top_p": top_p,
                   "top_k": top_k, "seed": j, "ignore_eos": True} for j in range(n)]
        res = _run_all(base_url, bodies, timeout_s, concurrency, headers, insecure)
        seqs = []
        for r in res:
            if r is None:
                continue
            seqs.append(r[0] if r[0] is not None else list(r[1]))
        tokens[s] = seqs
    out = {}
    for s in strategies:
        tests = []
        for pos in range(positions):
            base = [q[pos] for q in tokens[baseline] if len(q) > pos]
            got = [q[pos] for q in tokens[s] if len(q) > pos]
            tests.append({"position": pos, **first_token_test(base, got)})
        out[s] = {"n": len(tokens[s]), "temperature": temperature, "positions": tests,
                  **sampled_verdict(tests, alpha)}
        if s == baseline:
            out[s]["diverges"] = False
    return out


def write_consistency(run_dir: Path, result: dict) -> Path:
    """Write ``consistency.json`` (strict JSON, atomically); returns its path."""
    return write_json(Path(run_dir) / CONSISTENCY_FILE, result)


def run_checks(target: str, strategies: list[str], prompts: list[list[Any]], profile: Any,
               tier: str, outputs: list[str], run_dir: Path, samples: int = DEFAULT_SAMPLES,
               sampled: int = 0, baseline: str = M.AUTOREGRESSIVE,
               say: Callable[[str], None] = print, headers: dict[str, str] | None = None,
               insecure: bool = False, tolerance: float | None = None,
               baseline_url: str | None = None) -> dict:
    """The run's consistency phase: the greedy check (when ``samples`` > 0), the sampled
    check (when ``sampled`` > 0), ``consistency.json`` written; returns a summary for the
    manifest: {strategy: {"compared", "identical", "diverges"}} or {"skipped": reason}.

    profile: a ``configs.tiers.Profile`` (max_tokens of ``tier``'s cell per output class in
    ``outputs``, sampling, extra_body, seed, request timeout). The greedy check runs
    whatever the profile's temperature (temperature 0 is the exact lossless check).
    tolerance / baseline_url: as in ``greedy_check`` (the sampled check needs the
    baseline at ``target``).
    """
    from analysis.data.consistency import SYNTHETIC_SKIP

    synthetic = [s for s in strategies if M.parse_acceptance_length(s) is not None]
    strategies = [s for s in strategies if s not in synthetic]   # forced acceptance: not the target's text
    if samples <= 0 and sampled <= 0:
        return {"skipped": "disabled (--consistency 0)"}
    if baseline not in strategies and not baseline_url:
        reason = (f"baseline {baseline!r} not in this run's strategies {strategies}; "
                  "pass --consistency-baseline NAME or include it in --strategies")
        say(f"consistency check skipped: {reason}")
        return {"skipped": reason}
    extra = dict(profile.extra_body)
    result: dict[str, dict] = {}
    if samples > 0:
        mt = {oc: profile.cell(tier, oc).max_tokens.model_dump() for oc in outputs}
        result = greedy_check(target, strategies, prompts, mt, profile.seed, samples, baseline,
                              extra, profile.request_timeout_s, headers=headers, insecure=insecure,
                              tolerance=tolerance, baseline_url=baseline_url)
    if sampled > 0 and baseline in strategies:
        temp = profile.sampling.temperature or 1.0
        tests = sampled_check(target, strategies, prompts, sampled, temp, profile.sampling.top_p,
                              profile.sampling.top_k, baseline=baseline, extra_body=extra,
                              timeout_s=profile.request_timeout_s, headers=headers,
                              insecure=insecure)
        for s, t in tests.items():
            result.setdefault(s, {"compared": 0, "identical": 0, "errors": 0,
                                  "first_divergence": [], "baseline": baseline})["sampled"] = t
    for s in synthetic:
        result[s] = {"compared": 0, "identical": 0, "errors": 0, "first_divergence": [],
                     "baseline": baseline, "synthetic": True, "skipped": SYNTHETIC_SKIP}
    if synthetic:
        say(f"consistency: {len(synthetic)} synthetic deployment(s) skipped ({SYNTHETIC_SKIP})")
    write_consistency(run_dir, result)
    return _summarize_checks(result, baseline, say)


def _summarize_checks(result: dict[str, dict], baseline: str, say: Callable[[str], None]) -> dict:
    """One console line per compared strategy, a warning naming the diverging ones; the
    manifest's summary {strategy: {"compared", "identical", ties/violations/tolerance,
    "diverges"}}."""
    from analysis.data.consistency import diverges

    bad = sorted(s for s, e in result.items() if diverges(e))
    for s, e in result.items():
        if s != baseline and not e.get("synthetic"):
            ties = (f" ({e['ties']} ties, {e['violations']} violations at tolerance "
                    f"{e['tolerance']:g})" if "violations" in e else "")
            say(f"consistency {s}: {e['identical']}/{e['compared']} identical to {baseline}{ties}"
                + (f", sampled min p {e['sampled']['min_p_value']:.3g}" if e.get("sampled") else ""))
    if bad:
        say(f"WARNING: output of {', '.join(bad)} diverges from {baseline} (consistency.json)")
    return {s: {"compared": e["compared"], "identical": e["identical"],
                **({"synthetic": True} if e.get("synthetic") else {}),
                **({k: e[k] for k in ("ties", "violations", "tolerance") if k in e}),
                "diverges": diverges(e)} for s, e in result.items()}
