"""OpenAI request bodies -> `Router.prepare` arguments: the prompt or chat messages, and sampling
with OpenAI's defaults. Anything refused raises ApiError with the sentence the client gets
(400, naming the field as `param`); options pdserve does not implement are refused unless
given at their "off" value.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from protocol.sampling import SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")
_OFF = {"best_of": 1, "echo": False, "suffix": "", "logprobs": False, "top_logprobs": 0, "presence_penalty": 0,
        "frequency_penalty": 0, "logit_bias": {}, "tools": [], "response_format": {"type": "text"}}


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
    include_usage: bool


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_is_int, "an integer"), "bool": (lambda v: isinstance(v, bool), "true or false"),
    "number": (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    "ids": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of token ids")}


def _field(body: dict, name: str, kind: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    check, what = _KINDS[kind]
    if not check(value):
        raise ApiError(400, f"{name} must be {what}, got {json.dumps(value)[:60]}", name)
    return value


def parse_request(body: dict, chat: bool) -> Parsed:
    """The body's prompt (or messages) and sampling, with OpenAI's defaults; ApiError when refused."""
    n = _field(body, "n", "int", 1)
    if n != 1:
        raise ApiError(400, f"n must be 1: pdserve returns one choice per request (got {n}); send {n} requests", "n")
    for name, off in _OFF.items():
        if body.get(name) not in (None, off):
            raise ApiError(400, f"{name} is not supported (got {json.dumps(body[name])[:60]})", name)
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
        ignore_eos=_field(body, "ignore_eos", "bool", False))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    return Parsed(prompt, ids, messages, sampling, max_tokens is not None, _field(body, "stream", "bool", False),
                  bool(_field(options, "include_usage", "bool", False)))


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


def _messages(body: dict) -> list[dict]:
    """[{"role", "content"}] with text content parts joined; "developer" is the system role."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "\n".join(p["text"] for p in content)
        out.append({"role": "system" if m.get("role") == "developer" else m.get("role"), "content": content})
    return out
