"""The router's work before admission, bounded: rendering a chat and tokenizing a prompt.

That work grows with the request and happens before `router.max_queue` counts it, so it has its
own limits. A request's input size is measured first (bytes of prompt or messages, or number of
token ids: cheap, no tokenizer); inputs of at most SMALL_INPUT_BYTES go to the small lane (one
thread), bigger ones to the large lane (`router.tokenizer_threads` threads), so a short request
never waits behind big ones. The large lane's threads run at a lower CPU priority (Linux: nice
+LARGE_LANE_NICENESS per thread), so tokenizing big inputs takes only the CPU that serving small
requests, the event loop and colocated workers leave. At most `router.max_preparing` requests are in intake at once, of
them at most twice the large lane's threads big ones; beyond either: QueueFull
(RESOURCE_EXHAUSTED / 429) at once, before any work. Each thread tokenizes with its own copy of
the tokenizer (a Rust tokenizer refuses to be used from two threads at once).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from protocol.validation import RequestValidator
from router.lifecycle.outcomes import QueueFull

log = logging.getLogger(__name__)

SMALL_INPUT_BYTES = 16 << 10
LARGE_LANE_NICENESS = 10  # added to the large lane threads' nice value
TOKEN_ID_BYTES = 4  # a token id counts as this many bytes of input (about a token's text)


def input_bytes(prompt: str | None, prompt_token_ids: list[int] | None, messages: list[dict] | None) -> int:
    """About how much tokenizing a request costs, from sizes alone (len of str is O(1))."""
    if messages:
        # 16: the template's text per message; content that is not text is refused later, costs nothing
        return sum((len(c) if isinstance(c := m.get("content"), str) else 0) + 16 for m in messages)
    return len(prompt or "") + TOKEN_ID_BYTES * len(prompt_token_ids or ())


class Intake:
    def __init__(self, validator: RequestValidator, max_preparing: int, large_threads: int):
        self.max_preparing, self.max_large = max_preparing, 2 * large_threads
        self.preparing = self.preparing_large = 0
        self._small = ThreadPoolExecutor(1, thread_name_prefix="tokenize-small")
        self._large = ThreadPoolExecutor(large_threads, thread_name_prefix="tokenize", initializer=lower_priority)
        # one validator (with its own tokenizer) per thread; a job borrows one for its run
        self._validators: queue.SimpleQueue[RequestValidator] = queue.SimpleQueue()
        self._validators.put(validator)
        for _ in range(large_threads):
            self._validators.put(_own_copy(validator))

    async def prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None,
                         messages: list[dict] | None, add_special_tokens: bool | None = None) -> list[int]:
        """The validator's `prompt_ids`, on a lane; QueueFull when intake is full."""
        large = input_bytes(prompt, prompt_token_ids, messages) > SMALL_INPUT_BYTES
        self.check_room(large)
        self._count(+1, large)
        try:
            lane = self._large if large else self._small
            return await asyncio.get_running_loop().run_in_executor(lane, self._run, prompt, prompt_token_ids,
                                                                    messages, add_special_tokens)
        finally:
            self._count(-1, large)

    def check_room(self, large: bool) -> None:
        """QueueFull unless intake has room for one more (`large`) request. The HTTP door asks this
        before it reads a big body, so a refused client costs no JSON parsing either."""
        if self.preparing >= self.max_preparing:
            raise QueueFull(f"the router is already preparing {self.preparing} requests (router.max_preparing)")
        if large and self.preparing_large >= self.max_large:
            raise QueueFull(f"the router is already tokenizing {self.preparing_large} large requests; retry later")

    def _count(self, change: int, large: bool) -> None:
        self.preparing += change
        self.preparing_large += change if large else 0

    def _run(self, prompt, prompt_token_ids, messages, add_special_tokens) -> list[int]:
        validator = self._validators.get_nowait()  # never empty: one per thread of both lanes
        try:
            return validator.prompt_ids(prompt, prompt_token_ids, messages, add_special_tokens)
        finally:
            self._validators.put(validator)

    def shutdown(self) -> None:
        for lane in (self._small, self._large):
            lane.shutdown(wait=False, cancel_futures=True)


def lower_priority() -> None:
    """Raise the calling thread's nice value by LARGE_LANE_NICENESS. Linux only: there a thread id
    names one thread for setpriority; elsewhere it would name the whole process, so nothing is done."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + LARGE_LANE_NICENESS)
    except OSError as e:  # a sandbox may forbid it: the lane still works, only at normal priority
        log.warning("the large tokenizing lane runs at normal CPU priority: %s", e)


def _own_copy(validator: RequestValidator) -> RequestValidator:
    """A validator with its own copy of the tokenizer (the limits are shared values)."""
    return RequestValidator(copy.deepcopy(validator.tokenizer), validator.vocab_size, validator.max_model_len,
                            validator.max_prompt_bytes)
