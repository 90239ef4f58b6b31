"""Incremental detokenization that never emits broken UTF-8, plus stop-string handling.

Text is decoded over a small window of recent tokens; a delta that ends in U+FFFD (an
incomplete multi-byte character) is held until the next token completes it. With stop
strings, the last `len(longest stop) - 1` characters are held back so a stop string split
across two steps never leaks to the client; they are released when the request finishes.
"""

from __future__ import annotations

_WINDOW = 6  # tokens of left context; byte-level BPE merges never reach further back


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far (cut at a stop string once one is seen)
        self._emitted = 0  # characters of `text` already handed out

    def add_token(self, token_id: int) -> bool:
        """Decode one new token into `text`; True when a stop string appeared (text is cut there)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        start = max(len(self.text) - self._holdback, 0)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._trim_window()
        return self._cut_at_stop(start)

    def _trim_window(self) -> None:
        if self._prefix_offset > 4 * _WINDOW:
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset -= drop
            self._read_offset -= drop

    def _cut_at_stop(self, search_from: int) -> bool:
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out; keeps back a possible partial stop string unless final."""
        end = len(self.text) if final else max(len(self.text) - self._holdback, self._emitted)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
