"""Every request field, implemented or refused (issue 42: no field silently ignored).

The fixture lists every field of OpenAI's completions and chat completions requests
(API reference) and of vLLM 0.32's ``CompletionRequest`` / ``ChatCompletionRequest``
(``vllm/entrypoints/openai/*/protocol.py``; checked against the installed vLLM when
``.venv-vllm`` is there). Each field on each endpoint has one outcome:
- implemented: a real value is accepted and reaches the sampling parameters;
- label: accepted (it changes neither the output nor the response);
- neutral only: null and its neutral value are accepted; anything else is a 400 naming it;
- other endpoint's / unknown: a 400 naming it (never ignored).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from actors.engine.errors import InvalidRequest
from actors.serve.openai_request import parse_request, request_fields

REPO = Path(__file__).resolve().parent.parent
OPENAI_COMPLETIONS = ["model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias",
                      "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
                      "stream", "stream_options", "suffix", "temperature", "top_p", "user"]
OPENAI_CHAT = ["messages", "model", "audio", "frequency_penalty", "function_call",
               "functions", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens",
               "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
               "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format",
               "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
               "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
               "top_p", "user", "verbosity", "web_search_options"]
VLLM_COMPLETIONS = [
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "prompt_logprobs",
    "logprob_token_ids", "bad_words", "prompt_embeds", "add_special_tokens", "response_format",
    "structured_outputs", "priority", "request_id", "session_id", "return_tokens_as_token_ids",
    "return_token_ids", "routed_experts_prompt_start", "return_token_offsets", "mm_payload",
    "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "stream_interval"]
VLLM_CHAT_ONLY = ["messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                  "reasoning_effort", "include_reasoning", "parallel_tool_calls",
                  "add_generation_prompt", "continue_final_message", "documents",
                  "chat_template", "chat_template_kwargs", "media_io_kwargs",
                  "mm_processor_kwargs", "return_prompt_text"]
# vLLM's chat request has every completions field but these (its echo is its own:
# repeat the last message)
VLLM_NOT_CHAT = {"prompt", "suffix"}
FIELDS = {
    False: sorted(set(OPENAI_COMPLETIONS) | set(VLLM_COMPLETIONS)),
    True: sorted(set(OPENAI_CHAT) | (set(VLLM_COMPLETIONS) - VLLM_NOT_CHAT) | set(VLLM_CHAT_ONLY)),
}
BASE = {False: {"model": "m", "prompt": "def f(x):"},
        True: {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
# a real (non-default) value of every implemented field, and where it lands
VALID = {"max_tokens": (9, "max_tokens", 9), "temperature": (0.5, "temperature", 0.5),
         "top_p": (0.5, "top_p", 0.5), "top_k": (5, "top_k", 5), "seed": (7, "seed", 7),
         "stop": (["x"], "stop", ("x",)), "ignore_eos": (True, "ignore_eos", True),
         "min_tokens": (2, "min_tokens", 2),
         "skip_special_tokens": (False, "skip_special_tokens", False),
         "spaces_between_special_tokens": (False, "spaces_between_special_tokens", False),
         "stop_token_ids": ([3, 5], "stop_token_ids", (3, 5)),
         "include_stop_str_in_output": (True, "include_stop_str_in_output", True),
         "n": (1, None, None), "stream": (True, None, None), "echo": (False, None, None),
         "stream_interval": (4, None, None), "stream_interval_ms": (50, None, None),
         "return_tokens_as_token_ids": (True, None, None),
         "stream_options": ({"include_usage": True, "continuous_usage_stats": True}, None, None),
         "model": ("m", None, None), "prompt": ("x", None, None),
         "messages": ([{"role": "user", "content": "x"}], None, None)}
VALID_BY_ENDPOINT = {(False, "logprobs"): (2, "logprobs", 2),
                     (True, "logprobs"): (True, "logprobs", 0),
                     (True, "top_logprobs"): (3, None, None),
                     (True, "max_completion_tokens"): (9, "max_tokens", 9)}


def _cases():
    for chat in (False, True):
        known = request_fields(chat)
        for f in FIELDS[chat]:
            yield chat, f, known.get(f, "unknown")


def _refused(body, chat, field):
    with pytest.raises(InvalidRequest) as e:
        parse_request(body, chat)
    assert e.value.param.split(".")[0] == field, str(e.value)
    return str(e.value)


@pytest.mark.parametrize("chat,field,kind", list(_cases()),
                         ids=[f"{'chat' if c else 'completions'}-{f}" for c, f, _ in _cases()])
def test_every_field_is_implemented_or_refused(chat, field, kind):
    assert kind in ("implemented", "label", "neutral only"), (field, kind)
    body = {**BASE[chat]}
    if field == "top_logprobs":
        body["logprobs"] = True
    if field == "stream_options" or field in ("stream_interval", "stream_interval_ms"):
        body["stream"] = True
    if field not in ("model", "prompt", "messages"):   # explicit null stays accepted
        parse_request({**body, field: None}, chat)
    if kind == "implemented":
        value, param, want = VALID_BY_ENDPOINT.get((chat, field), VALID.get(field, (None,) * 3))
        assert value is not None, f"no valid value for implemented field {field}"
        got = parse_request({**body, field: value}, chat)
        if param is not None:
            assert got.params[param] == want, (field, got.params[param])
    elif kind == "label":
        parse_request({**body, field: "anything"}, chat)
    else:
        msg = _refused({**body, field: {"not": "neutral"}}, chat, field)
        assert "not supported" in msg


@pytest.mark.parametrize("chat", [False, True])
def test_unknown_and_other_endpoints_fields_are_400s_naming_them(chat):
    _refused({**BASE[chat], "no_such_field": 1}, chat, "no_such_field")
    _refused({**BASE[chat], ("prompt" if chat else "messages"): "x"}, chat,
             "prompt" if chat else "messages")
    _refused({**BASE[chat], "stream": True, "stream_options": {"no_such": 1}}, chat,
             "stream_options")
    for f, v in (("min_p", 0.5), ("repetition_penalty", 1.2), ("use_beam_search", True),
                 ("priority", False), ("bad_words", ["x"]), ("allowed_token_ids", [1])):
        _refused({**BASE[chat], f: v}, chat, f)
    for f, v in (("min_p", 0), ("repetition_penalty", 1.0), ("use_beam_search", False),
                 ("priority", 0), ("bad_words", []), ("add_special_tokens", not chat)):
        parse_request({**BASE[chat], f: v}, chat)


def test_fixture_lists_every_field_of_the_installed_vllm():
    """Skips without vLLM's venv, fails instead under SPECLOAD_REQUIRE_VLLM=1 (CI)."""
    from tests.vllm_server import vllm_python

    python = vllm_python()
    code = ("import json\nfrom vllm.entrypoints.openai.completion.protocol import "
            "CompletionRequest as C\nfrom vllm.entrypoints.openai.chat_completion.protocol "
            "import ChatCompletionRequest as H\nprint(json.dumps([list(C.model_fields), "
            "list(H.model_fields)]))")
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"vLLM not importable: {p.stderr[-300:]}"
    comp, chat = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(comp) <= set(FIELDS[False]), set(comp) - set(FIELDS[False])
    assert set(chat) <= set(FIELDS[True]), set(chat) - set(FIELDS[True])
