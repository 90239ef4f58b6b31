"""The OpenAI response bodies of one request: a completion or chat reply, whole or as stream
chunks, its usage object (and, for vLLM's continuous_usage_stats, the usage after each chunk)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from protocol.usage import Usage
from router.lifecycle.outcomes import Chunk


@dataclasses.dataclass(frozen=True)
class Reply:
    """One response's fixed parts; completions and chat differ only in these shapes."""

    chat: bool
    id: str
    model: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[dict], usage: dict | None, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return out if usage is None and stream else out | {"usage": usage}

    def choice(self, text: str, token_ids: list[int], finish: str | None, stream: bool, first: bool = False) -> dict:
        """`token_ids` is pdserve's own addition: the ids behind `text`."""
        if not self.chat:
            body: dict[str, Any] = {"text": text}
        elif stream:
            body = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish, "token_ids": token_ids}


def usage_body(chunk: Chunk | None) -> dict[str, Any]:
    """OpenAI's usage object for the request whose last chunk is `chunk` (zeros without one)."""
    u = chunk.usage if chunk is not None and chunk.usage is not None else Usage()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class UsageSoFar:
    """The usage after each chunk of a stream, as vLLM's continuous_usage_stats sends it: the
    prompt's tokens and the completion's so far; the last chunk's is the request's whole usage."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0

    def after(self, chunk: Chunk) -> dict[str, Any]:
        self.completion_tokens += len(chunk.token_ids)
        if chunk.usage is not None:
            return usage_body(chunk)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def sse_json(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"))


def finish_reason(chunk: Chunk) -> str | None:
    return chunk.finish_reason.public if chunk.finish_reason is not None else None
