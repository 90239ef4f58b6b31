"""The OpenAI HTTP door without a cluster: request bodies -> `Router.prepare` arguments
(router/frontdoor/openai_request.py); the app over a stand-in Router (the statuses of its refusals)
in tests/test_openai_door_errors.py; tests/test_openai_api.py runs the same door over a real cluster."""

from __future__ import annotations

import json

import pytest

from bench.openai_client import DEFAULT_EXTRA_BODY
from protocol.limits import MAX_CHAT_MESSAGES
from router.frontdoor.openai_request import MAX_JSON_DEPTH, ApiError, load_body, parse_request

MODEL = "fake"  # what the stand-in Router below serves
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Once upon a time"}]


# ---- the body -> SamplingParams mapping ----------------------------------------------------------
def _parse(body: dict, chat: bool = False):
    return parse_request(body, chat, MODEL)


def test_openai_defaults_and_extensions_map_onto_sampling_params():
    p = _parse({"prompt": "hi"})
    assert (p.prompt, p.prompt_ids, p.stream, p.include_usage) == ("hi", None, False, False)
    assert (p.sampling.max_tokens, p.sampling.temperature, p.sampling.top_p, p.sampling.top_k) == (16, 1.0, 1.0, 0)
    p = _parse({"prompt": [[5, 6]], "temperature": 0, "top_k": -1, "stop": "\n", "seed": 3, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}})
    assert p.prompt_ids == [5, 6] and p.sampling.greedy and p.sampling.top_k == 0
    assert (p.sampling.stop, p.sampling.seed, p.sampling.ignore_eos, p.include_usage) == (("\n",), 3, True, True)
    chat = _parse({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}]}, chat=True)
    assert chat.messages == [{"role": "system", "content": "a"}] and not chat.max_tokens_given
    assert _parse({"messages": CHAT, "max_completion_tokens": 7}, chat=True).sampling.max_tokens == 7


def test_vllms_extensions_mean_what_they_mean_in_vllm():
    p = _parse({"prompt": "a"})
    assert (p.add_special_tokens, p.include_usage, p.continuous_usage) == (True, False, False)
    assert not _parse({"messages": CHAT}, chat=True).add_special_tokens  # the template writes them
    assert _parse({"messages": CHAT, "add_special_tokens": True}, chat=True).add_special_tokens
    assert not _parse({"prompt": "a", "add_special_tokens": False}).add_special_tokens
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert (_parse({"prompt": "a", "stream_options": both}).continuous_usage,
            _parse({"prompt": "a", "stream_options": {"continuous_usage_stats": True}}).continuous_usage) == (True, False)
    # min_tokens where nothing but max_tokens ends a request: what vLLM would do, done
    taken = _parse({"prompt": "a", "min_tokens": 8, "max_tokens": 8, "ignore_eos": True})
    assert taken.sampling == _parse({"prompt": "a", "max_tokens": 8, "ignore_eos": True}).sampling


def test_what_guidellm_sends_is_taken():
    """guidellm 0.8.1's bodies (backends/openai/request_handlers.py), streamed and not."""
    completion = {"model": MODEL, "stream": True, "prompt": "a b c", "max_tokens": 8, "stop": None,
                  "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    p = _parse(completion)
    assert p.continuous_usage and p.sampling.ignore_eos and p.sampling.max_tokens == 8
    chat = {k: v for k, v in completion.items() if k != "prompt"} | {"messages": CHAT}
    assert _parse(chat, chat=True).continuous_usage


def test_what_the_bench_and_the_sdk_send_is_taken():
    bench = {"model": MODEL, "prompt": [5, 6], "max_tokens": 8, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}} | dict(DEFAULT_EXTRA_BODY)
    p = _parse(bench)
    assert p.sampling.ignore_eos and p.sampling.greedy and p.include_usage
    assert _parse({"model": MODEL, "prompt": [5], "max_tokens": 1, "temperature": 0} | dict(DEFAULT_EXTRA_BODY))


VLLM_DEFAULTS = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                 "include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1, "priority": 0,
                 "return_tokens_as_token_ids": False, "prompt_logprobs": None, "truncate_prompt_tokens": None}
NO_OPS = [  # pdserve implements none of these: each is taken at the value that asks for nothing
    (False, {"n": 1, "best_of": 1, "echo": False, "suffix": "", "logprobs": None, "user": "u-1",
             "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}, "min_p": 0, "min_tokens": 0,
             "repetition_penalty": 1} | VLLM_DEFAULTS),
    (True, {"n": 1, "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "functions": [],
            "function_call": "none", "response_format": {"type": "text"}, "store": False, "user": "u-1",
            "presence_penalty": 0, "stream_options": {"include_usage": None}, "echo": False,
            "add_generation_prompt": True, "continue_final_message": False} | VLLM_DEFAULTS),
]


@pytest.mark.parametrize("chat, fields", NO_OPS)
def test_options_not_implemented_are_taken_at_their_no_op_value(chat, fields):
    prompt = {"messages": CHAT} if chat else {"prompt": "a"}
    assert _parse(prompt | fields, chat).sampling == _parse(prompt, chat).sampling


@pytest.mark.parametrize("body, param, message", [
    ({"n": 2}, "n", "n must be 1"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request: got 2 prompts"),
    ({"prompt": {"text": "a"}}, "prompt", "prompt must be a string or a list of token ids"),
    ({"max_tokens": "8"}, "max_tokens", "max_tokens must be an integer of at most 64 bits, got \"8\""),
    ({"seed": -1}, "seed", "seed must be in [0, 2**64)"),
    ({"stop": [1]}, "stop", "stop must be a string or a list of strings"),
    ({"temperature": 10**400}, "temperature", "temperature must be a number that fits in 64 bits, got 100000"),
    ({"top_p": float("inf")}, "top_p", "top_p must be a number that fits in 64 bits, got Infinity"),
    ({"max_tokens": 10**30}, "max_tokens", "max_tokens must be an integer of at most 64 bits"),
    ({"prompt": [5, 2**64]}, "prompt", "prompt must be a string or a list of token ids"),
    ({"logprobs": 0}, "logprobs", "logprobs is not supported: pdserve accepts only null, the value that asks "
                                  "for nothing (got 0)"),
    ({"echo": 0}, "echo", "echo is not supported: pdserve accepts only false, the value that asks for nothing "
                          "(got 0)"),
    ({"echo": True}, "echo", "echo is not supported: pdserve accepts only false"),
    ({"best_of": True}, "best_of", "best_of is not supported: pdserve accepts only 1, the value that asks for "
                                   "nothing (got true)"),
    ({"min_p": 0.05}, "min_p", "min_p is not supported: pdserve accepts only 0"),
    ({"min_tokens": 4}, "min_tokens", "min_tokens above 0 is supported only with ignore_eos: true and no stop"),
    ({"min_tokens": 4, "ignore_eos": True, "stop": "x"}, "min_tokens", "min_tokens above 0 is supported only"),
    ({"min_tokens": 9, "ignore_eos": True, "max_tokens": 8}, "min_tokens", "min_tokens must be in [0, max_tokens]"),
    ({"skip_special_tokens": False}, "skip_special_tokens", "skip_special_tokens is not supported: pdserve "
                                                            "accepts only true"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output", "accepts only false"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "accepts only true"),
    ({"add_special_tokens": "yes"}, "add_special_tokens", 'add_special_tokens must be true or false, got "yes"'),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs is not supported: pdserve accepts only null"),
    ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "accepts only null"),
    ({"stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats",
     "stream_options.continuous_usage_stats must be true or false, got 1"),
    ({"repetition_penalty": 1.1}, "repetition_penalty", "repetition_penalty is not supported: pdserve accepts "
                                                        "only 1"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty is not supported"),
    ({"guided_json": {"type": "object"}}, "guided_json", '/v1/completions has no field "guided_json" in pdserve'),
    ({"functions": []}, "functions", '/v1/completions has no field "functions" in pdserve'),
    ({"stream_options": {"include_usage": True, "min_tokens": 2}}, "stream_options.min_tokens",
     'stream_options has a field pdserve does not support: "min_tokens"'),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "stream_options.include_usage must be true or false, got 1"),
    ({"user": 7}, "user", "user must be a string, got 7"),
])
def test_refused_completions_name_the_field(body, param, message):
    with pytest.raises(ApiError) as err:
        _parse({"prompt": "a"} | body)
    assert err.value.status == 400 and err.value.param == param and message in str(err.value)


@pytest.mark.parametrize("body, param, message", [
    ({"logprobs": True}, "logprobs", "logprobs is not supported: pdserve accepts only false"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "functions is not supported"),
    ({"function_call": "auto"}, "function_call", 'function_call is not supported: pdserve accepts only "none"'),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools is not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "response_format is not supported"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction",
     '/v1/chat/completions has no field "prediction" in pdserve'),
    ({"echo": True}, "echo", "echo is not supported: pdserve accepts only false"),
    ({"add_generation_prompt": False}, "add_generation_prompt", "accepts only true"),
    ({"continue_final_message": True}, "continue_final_message", "accepts only false"),
    ({"chat_template": "{{ messages }}"}, "chat_template", '/v1/chat/completions has no field "chat_template"'),
    ({"messages": [{"role": "user", "content": "a", "name": "bob"}]}, "messages",
     'messages[0] has a field pdserve does not support: "name"'),
])
def test_refused_chats_name_the_field(body, param, message):
    with pytest.raises(ApiError) as err:
        _parse({"messages": CHAT} | body, chat=True)
    assert err.value.status == 400 and err.value.param == param and message in str(err.value)


@pytest.mark.parametrize("chat", [False, True])
def test_a_model_not_served_is_404_model_not_found(chat):
    body = {"messages": CHAT} if chat else {"prompt": "a"}
    assert _parse(body | {"model": MODEL}, chat) == _parse(body, chat)  # named or left out: the one served
    with pytest.raises(ApiError) as err:
        _parse(body | {"model": "gpt-4o"}, chat)
    assert (err.value.status, err.value.param, err.value.code) == (404, "model", "model_not_found")
    assert str(err.value) == 'the model "gpt-4o" does not exist: this server serves "fake" (GET /v1/models)'


# ---- the body as JSON, before any work ---------------------------------------------------------
@pytest.mark.parametrize("raw, message", [
    (b'{"prompt": "a", "temperature": ' + b"1" * 5000 + b"}",
     "a number in the request body is too large: an integer of thousands of digits"),
    (b'{"prompt": "a", "temperature": ' + b"1" * 401 + b".5}", "a number in the request body is too large: 111"),
    (b'{"prompt": "a", "temperature": 1e400}', "a number in the request body is too large: 1e400"),
    (b'{"prompt": "a", "temperature": NaN}', "the request body is not valid JSON: NaN is not a number JSON allows"),
    (b'{"prompt": "a", "top_p": -Infinity}', "the request body is not valid JSON: -Infinity is not a number"),
    (b"[" * 200_000 + b"]" * 200_000, f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep"),
    (b'{"prompt": ' + b"[" * 200_000, f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep"),
    (b'{"prompt": "a\xff"}', "the request body is not UTF-8 (byte 13)"),
    (b"{not json", "the request body is not valid JSON: Expecting property name enclosed in double quotes"),
    (b'["a"]', "the request body must be a JSON object"),
])
def test_bodies_refused_before_any_work(raw, message):
    with pytest.raises(ApiError) as err:
        load_body(raw)
    assert err.value.status == 400 and str(err.value).startswith(message)


def test_nesting_counts_brackets_outside_strings_only():
    deepest = {"prompt": "a"}
    for _ in range(MAX_JSON_DEPTH - 1):
        deepest = {"x": deepest}
    assert load_body(json.dumps(deepest).encode()) == deepest  # exactly the limit
    assert load_body(json.dumps({"prompt": "[{" * 1000 + '\\"]'}).encode())["prompt"].startswith("[{[{")
    with pytest.raises(ApiError, match="nests JSON more than"):
        load_body(json.dumps({"x": deepest}).encode())
    big = {"prompt": list(range(2000)), "seed": 2**64 - 1, "temperature": 1.5e-3, "top_p": 1e300}
    assert load_body(json.dumps(big).encode()) == big  # the float hook takes what fits


def test_too_many_chat_messages_are_refused_before_anything_is_rendered():
    body = {"messages": [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)}
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=True, model=MODEL)
    assert (err.value.status, err.value.param, str(err.value)) == (
        400, "messages", f"{MAX_CHAT_MESSAGES + 1} messages given; at most {MAX_CHAT_MESSAGES} are allowed")
