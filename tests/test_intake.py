"""The router's work before admission is bounded (router/lifecycle/intake.py): too many requests in
intake, or too many big ones, are refused at once with QueueFull (RESOURCE_EXHAUSTED / 429) while a
small request still goes through; a chat of too many messages is refused before it is copied.
Over a real tokenizer (the tiny checkpoint's), no cluster."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest
from transformers import AutoTokenizer

from protocol.errors import InvalidRequest
from protocol.limits import MAX_CHAT_MESSAGES
from protocol.validation import PROBE_CHARS_PER_TOKEN, RequestValidator
from router.lifecycle.intake import LARGE_LANE_NICENESS, SMALL_INPUT_BYTES, Intake
from router.lifecycle.outcomes import QueueFull


@pytest.fixture(scope="module")
def validator(llama_dir) -> RequestValidator:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    return RequestValidator(tokenizer, tokenizer.vocab_size, 1 << 20, max_prompt_bytes=1 << 20)


def _outcomes(intake: Intake, prompts: list[str]) -> list[object]:
    """Each prompt's ids or the exception it got, all submitted together in this order."""
    async def main():
        return await asyncio.gather(*(intake.prompt_ids(p, None, None) for p in prompts), return_exceptions=True)
    return asyncio.run(main())


def test_big_inputs_beyond_their_share_are_refused_and_a_small_one_still_runs(validator):
    intake = Intake(validator, max_preparing=8, large_threads=1)  # at most 2 big ones in intake
    big, small = "word " * (SMALL_INPUT_BYTES // 4), "a small prompt"
    try:
        outcomes = _outcomes(intake, [big, big, big, small])
    finally:
        intake.shutdown()
    assert [type(o).__name__ for o in outcomes] == ["list", "list", "QueueFull", "list"]
    assert str(outcomes[2]) == "the router is already tokenizing 2 large requests; retry later"
    assert outcomes[0] == outcomes[1] == validator.tokenizer.encode(big, add_special_tokens=False)
    assert outcomes[3] == validator.tokenizer.encode(small, add_special_tokens=False)
    assert (intake.preparing, intake.preparing_large) == (0, 0)


def test_intake_holds_at_most_max_preparing(validator):
    intake = Intake(validator, max_preparing=2, large_threads=1)
    try:
        outcomes = _outcomes(intake, ["one", "two", "three"])
        assert isinstance(outcomes[2], QueueFull) and not isinstance(outcomes[1], Exception)
        assert str(outcomes[2]) == "the router is already preparing 2 requests (router.max_preparing)"
        assert _outcomes(intake, ["three"])[0] == validator.tokenizer.encode("three", add_special_tokens=False)
    finally:
        intake.shutdown()


def test_a_chat_of_too_many_messages_is_refused(validator):
    messages = [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)
    validator.tokenizer.chat_template = validator.tokenizer.chat_template or "{{ messages }}"
    with pytest.raises(InvalidRequest, match=f"^{MAX_CHAT_MESSAGES + 1} messages given; at most "
                                             f"{MAX_CHAT_MESSAGES} are allowed$"):
        validator.chat_ids(messages)


def test_a_prompt_whose_head_is_over_the_context_is_refused_before_the_rest_is_tokenized(validator):
    short = RequestValidator(validator.tokenizer, validator.vocab_size, 64, max_prompt_bytes=1 << 20)
    text = "word " * 200_000
    cut = text.rfind(" ", 0, PROBE_CHARS_PER_TOKEN * 64)  # the head ends before the last space in the probe
    with pytest.raises(InvalidRequest, match=r"^the prompt is over 64 tokens, the model's context \(its first "
                                             rf"{cut} characters alone are \d+ tokens\)$"):
        short.prompt_ids(text, None)
    fits = "word " * 40  # under the probe: tokenized whole, and the context check is the usual one
    assert short.prompt_ids(fits, None) == validator.tokenizer.encode(fits, add_special_tokens=False)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_big_inputs_are_tokenized_at_a_lower_cpu_priority_than_small_ones(validator):
    """The large lane yields the CPU to small requests, the event loop and colocated workers."""
    intake = Intake(validator, max_preparing=8, large_threads=1)

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    try:
        small = intake._small.submit(nice).result(timeout=10)
        large = intake._large.submit(nice).result(timeout=10)
    finally:
        intake.shutdown()
    assert large == min(small + LARGE_LANE_NICENESS, 19)
