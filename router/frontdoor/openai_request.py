"""OpenAI request bodies -> `Router.prepare` arguments: the prompt or chat messages, and sampling
with OpenAI's defaults. Anything refused raises ApiError with the sentence the client gets
(naming the field as `param`), before any work is done for the request.

`load_body`: UTF-8 JSON, nested at most MAX_JSON_DEPTH deep, without NaN, Infinity or a number
beyond a float's range (an integer field takes at most 64 bits). `parse_request`: each
endpoint's fields are an allowlist. A field is either honoured (vLLM's extensions with vLLM's
meaning: `stream_options.continuous_usage_stats`, `add_special_tokens`, `min_tokens` where
nothing else can end a request early), or one pdserve does not implement, accepted only at the
value that asks for nothing (`n: 1`, `echo: false`, `presence_penalty: 0`, vLLM's defaults such as
`skip_special_tokens: true`); any other field, or value, is refused with 400. `null` is the same
as leaving a field out. A `model` other than the one served is 404 `model_not_found`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

from protocol.limits import MAX_CHAT_MESSAGES
from protocol.sampling import SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "cache_salt")
MAX_JSON_DEPTH = 32  # an OpenAI body nests 5 deep (messages, content parts); far below the parser's stack

_HONOURED = frozenset({"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "seed",
                       "stop", "user", "top_k", "ignore_eos", "stop_token_ids", "cache_salt", "min_tokens",
                       "add_special_tokens"})  # from top_k on: vLLM's extensions, with vLLM's meaning
_NO_OP = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {},
          # vLLM's extensions pdserve does not implement, at vLLM's defaults
          "min_p": 0, "repetition_penalty": 1, "length_penalty": 1, "use_beam_search": False, "priority": 0,
          "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
          "return_tokens_as_token_ids": False, "prompt_logprobs": None, "truncate_prompt_tokens": None}
# per endpoint (chat?): the fields honoured, and the no-op value of each field accepted only at that value
ENDPOINTS: dict[bool, tuple[frozenset[str], dict[str, Any]]] = {
    False: (_HONOURED | {"prompt"}, _NO_OP | {"best_of": 1, "echo": False, "suffix": "", "logprobs": None}),
    True: (_HONOURED | {"messages", "max_completion_tokens"},
           _NO_OP | {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "functions": [],
                     "function_call": "none", "response_format": {"type": "text"}, "store": False,
                     "echo": False, "add_generation_prompt": True, "continue_final_message": False}),
}
_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
_MESSAGE_FIELDS = frozenset({"role", "content"})
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]++")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Parsed:
    prompt: str | None
    prompt_ids: list[int] | None
    messages: list[dict] | None
    sampling: SamplingParams
    max_tokens_given: bool  # chat without it: the rest of the context, at most CHAT_MAX_TOKENS
    stream: bool
    include_usage: bool  # a last chunk with the usage
    continuous_usage: bool  # the usage so far in every chunk too (vLLM's continuous_usage_stats)
    add_special_tokens: bool  # the tokenizer's special tokens (its BOS) around a text prompt


# ---- the body as JSON --------------------------------------------------------------------------
def load_body(raw: bytes) -> dict:
    """The JSON object in `raw`; ApiError (400) for anything else, or JSON nested or numbered
    beyond what a request can mean (see the module docstring)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start})") from None
    if _nested_deeper(text, MAX_JSON_DEPTH):
        raise ApiError(400, f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep")
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except ValueError:  # Python's own limit on an integer's digits (sys.get_int_max_str_digits)
        raise ApiError(400, "a number in the request body is too large: an integer of thousands of "
                            "digits") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _nested_deeper(text: str, limit: int) -> bool:
    """Whether JSON `text` opens more than `limit` arrays/objects inside one another (brackets in
    strings do not count); linear, and stops at the first level too deep."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for bracket in _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > limit:
            return True
    return False


def _no_constant(name: str) -> float:
    raise ApiError(400, f"the request body is not valid JSON: {name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ApiError(400, f"a number in the request body is too large: {text[:40]}")
    return value


# ---- the fields ------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    """An integer of at most 64 bits, signed or not (no field means more)."""
    return isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**64


def _is_number(v: Any) -> bool:
    """A float, or an integer of at most 64 bits (anything larger would not even convert to a float)."""
    return _is_int(v) or isinstance(v, float) and math.isfinite(v)


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_is_int, "an integer of at most 64 bits"), "bool": (lambda v: isinstance(v, bool), "true or false"),
    "number": (_is_number, "a number that fits in 64 bits"), "string": (lambda v: isinstance(v, str), "a string"),
    "ids": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of token ids")}


def _field(body: dict, name: str, kind: str, default: Any = None, where: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return default
    check, what = _KINDS[kind]
    if not check(value):
        raise ApiError(400, f"{where}{name} must be {what}, got {_shown(value)}", where + name)
    return value


def _shown(value: Any) -> str:
    """A value of the body as the client wrote it, cut short (its text carries no control character)."""
    return json.dumps(value)[:60]


def parse_request(body: dict, chat: bool, model: str) -> Parsed:
    """The body's prompt (or messages) and sampling, with OpenAI's defaults; ApiError when refused.
    `model`: the id of the model served (the only one a body may name)."""
    _check_fields(body, chat)
    _check_model(body, model)
    n = _field(body, "n", "int", 1)
    if n != 1:
        raise ApiError(400, f"n must be 1: pdserve returns one choice per request (got {n}); send {n} requests", "n")
    _field(body, "user", "string")  # who the end user is: nothing to do with it
    prompt, ids, messages = (None, None, _messages(body)) if chat else (*_prompt(body), None)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = {name: _field(body, name, "int") for name in names if body.get(name) is not None}
    if len(set(given.values())) > 1:
        raise ApiError(400, "max_completion_tokens and max_tokens differ: give one", "max_completion_tokens")
    max_tokens = next(iter(given.values()), None if chat else COMPLETION_MAX_TOKENS)
    seed = _field(body, "seed", "int")
    if seed is not None and not 0 <= seed < 2**64:
        raise ApiError(400, f"seed must be in [0, 2**64), got {seed}", "seed")
    top_k = _field(body, "top_k", "int", 0)
    sampling = SamplingParams(
        max_tokens=1 if max_tokens is None else max_tokens, temperature=_field(body, "temperature", "number", 1.0),
        top_p=_field(body, "top_p", "number", 1.0), top_k=0 if top_k == -1 else top_k, seed=seed,
        stop=_stops(body.get("stop")), stop_token_ids=tuple(_field(body, "stop_token_ids", "ids", [])),
        ignore_eos=_field(body, "ignore_eos", "bool", False), cache_salt=_field(body, "cache_salt", "string", ""))
    _check_min_tokens(_field(body, "min_tokens", "int", 0), sampling, max_tokens is not None)
    include_usage, continuous_usage = _usage_options(body.get("stream_options"))
    return Parsed(prompt, ids, messages, sampling, max_tokens is not None, _field(body, "stream", "bool", False),
                  include_usage, continuous_usage, _field(body, "add_special_tokens", "bool", not chat))


def _check_min_tokens(min_tokens: int, sampling: SamplingParams, max_tokens_given: bool) -> None:
    """vLLM's min_tokens: no EOS, stop token or stop string ends the request before that many
    tokens. pdserve's engine cannot hold those back, so min_tokens > 0 is honoured only where
    nothing but max_tokens can end a request anyway: with ignore_eos and no stop conditions."""
    if min_tokens == 0:
        return
    if min_tokens < 0 or max_tokens_given and min_tokens > sampling.max_tokens:
        raise ApiError(400, f"min_tokens must be in [0, max_tokens], got {min_tokens}", "min_tokens")
    if not sampling.ignore_eos or sampling.stop or sampling.stop_token_ids:
        raise ApiError(400, "min_tokens above 0 is supported only with ignore_eos: true and no stop or "
                            "stop_token_ids (then nothing ends a request before max_tokens)", "min_tokens")


def _check_fields(body: dict, chat: bool) -> None:
    """Every field given is honoured, or given at its no-op value."""
    honoured, no_op = ENDPOINTS[chat]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for name, value in body.items():
        if name in honoured or value is None:
            continue
        if name not in no_op:
            raise ApiError(400, f"{path} has no field {_shown(name)} in pdserve", name[:60])
        if not _same(value, no_op[name]):
            raise ApiError(400, f"{name} is not supported: pdserve accepts only {_shown(no_op[name])}, the "
                                f"value that asks for nothing (got {_shown(value)})", name)


def _same(value: Any, no_op: Any) -> bool:
    """`value` is `no_op` as JSON means it: 0.0 is 0, but false is not 0 and true is not 1."""
    if isinstance(value, bool) or isinstance(no_op, bool):
        return value is no_op
    return value == no_op


def _check_model(body: dict, model: str) -> None:
    asked = _field(body, "model", "string", model)
    if asked != model:
        raise ApiError(404, f"the model {_shown(asked)} does not exist: this server serves {_shown(model)} "
                            "(GET /v1/models)", "model", code="model_not_found")


def _usage_options(options: Any) -> tuple[bool, bool]:
    """stream_options: an object of the options honoured, (include_usage, continuous_usage_stats);
    as in vLLM, continuous_usage_stats counts only with include_usage."""
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    for name, value in options.items():
        if name not in _STREAM_OPTIONS and value is not None:
            raise ApiError(400, f"stream_options has a field pdserve does not support: {_shown(name)}",
                           f"stream_options.{name[:60]}")
    include = _field(options, "include_usage", "bool", False, where="stream_options.")
    continuous = _field(options, "continuous_usage_stats", "bool", False, where="stream_options.")
    return include, include and continuous


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:  # a batch of prompts
            raise ApiError(400, f"one prompt per request: got {len(prompt)} prompts; send them as separate "
                                "requests", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt or None, None
    if isinstance(prompt, list) and all(map(_is_int, prompt)):
        return None, prompt
    raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None or isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ApiError(400, "stop must be a string or a list of strings", "stop")


def _content(content: Any, name: str) -> str:
    """A message's text: a string, or a list of text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"{name}: only text parts are supported", name)
        return "\n".join(p["text"] for p in content)
    raise ApiError(400, f"{name} must be a string or a list of text parts, got {_shown(content)}", name)


def _messages(body: dict) -> list[dict]:
    """[{"role", "content"}] with text content parts joined; "developer" is the system role. A
    message's other fields (`name`, `tool_calls`, ...) are refused unless null."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise ApiError(400, f"{len(messages)} messages given; at most {MAX_CHAT_MESSAGES} are allowed", "messages")
    out = []
    for i, m in enumerate(messages):
        extra = next((k for k, v in m.items() if k not in _MESSAGE_FIELDS and v is not None), None)
        if extra is not None:
            raise ApiError(400, f"messages[{i}] has a field pdserve does not support: {_shown(extra)} (a "
                                "message is a role and a content)", "messages")
        content = _content(m.get("content"), f"messages[{i}].content")
        out.append({"role": "system" if m.get("role") == "developer" else m.get("role"), "content": content})
    return out
