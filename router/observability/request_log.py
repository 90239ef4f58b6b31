"""The router's request log: one JSON line per finished request (`router.request_log`; off by default).

Each line is a Mooncake trace record — `timestamp` (ms since the router started),
`input_length`, `output_length`, `hash_ids` (one per full 512-token block of the prompt: the
chained block hash of protocol/block_hash.py cut to 48 bits, so equal ids mean an equal prefix
and any JSON reader keeps them exact) — so `pdserve inspect LOG` and `pdserve bench --trace LOG`
read it as they read a trace; then what the router measured: every `Usage` field (protocol/usage.py)
but the token counts and token_steps, the finish reason, e2e_ms. No prompt text is ever written; the prompt's token ids only with
`router.request_log_prompts`. Lines are appended as requests finish (line-buffered); a write
that fails is logged and turns the log off: serving never waits on it or fails because of it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, TextIO

from protocol import clock
from protocol.block_hash import block_hashes
from protocol.outputs import FinishReason
from protocol.usage import Usage
from router.config.schema import RouterSection
from router.config.typed_yaml import ConfigError
from router.lifecycle.life import RequestLife

log = logging.getLogger(__name__)

TRACE_BLOCK_TOKENS = 512  # Mooncake's block: what bench/trace.py replays
# usage fields a line leaves out: the token counts are input_length / output_length already, and
# token_steps (a letter per token) would make long requests' lines long
UNLOGGED = frozenset({"prompt_tokens", "completion_tokens", "token_steps"})


def block_ids(token_ids: list[int] | tuple[int, ...], block_size: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """48-bit ids of the full blocks' chained hashes: equal ids at equal positions = equal prefix."""
    return [int.from_bytes(h[:6], "big") for h in block_hashes(list(token_ids), block_size)]


class RequestLog:
    def __init__(self, handle: TextIO, with_prompts: bool):
        self._handle: TextIO | None = handle
        self._with_prompts = with_prompts
        self._started = clock.now()

    @classmethod
    def open(cls, section: RouterSection) -> RequestLog | None:
        """The log `section` asks for (None when off); a path that cannot be opened is a ConfigError."""
        if section.request_log is None:
            return None
        try:
            Path(section.request_log).parent.mkdir(parents=True, exist_ok=True)
            handle = open(section.request_log, "a", buffering=1, encoding="utf-8")  # kept open: one line per request
        except OSError as e:
            raise ConfigError(f"router.request_log: cannot open {section.request_log}: {e.strerror}") from None
        return cls(handle, section.request_log_prompts)

    def record(self, life: RequestLife, finish_reason: FinishReason, usage: Usage) -> dict[str, Any]:
        """The JSON object of one finished request."""
        now = clock.now()
        line = {
            "timestamp": round((life.accepted - self._started) * 1e3, 3),
            "input_length": len(life.prompt_token_ids),
            "output_length": len(life.output_token_ids),
            "hash_ids": block_ids(life.prompt_token_ids),
            "time_unix": round(time.time() - (now - life.accepted), 3),
            "request_id": life.client_id,
            "finish_reason": finish_reason,
            "e2e_ms": round((now - life.accepted) * 1e3, 3),
        } | {f.name: getattr(usage, f.name) for f in fields(usage) if f.name not in UNLOGGED}
        if self._with_prompts:
            line["prompt_token_ids"] = list(life.prompt_token_ids)
        return line

    def write(self, life: RequestLife, finish_reason: FinishReason, usage: Usage) -> None:
        if self._handle is None:
            return
        try:
            self._handle.write(json.dumps(self.record(life, finish_reason, usage), separators=(",", ":")) + "\n")
        except OSError as e:
            log.error("request log: writing failed (%s); no more requests are logged", e)
            self.close()

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            try:
                handle.close()
            except OSError as e:
                log.error("request log: closing failed (%s)", e)
