"""Every refusal of a bad request, with the exact sentence its sender reads."""

from __future__ import annotations

import copy
import re

import pytest
from jinja2 import TemplateSyntaxError
from transformers import AutoTokenizer

from protocol.errors import InvalidRequest
from protocol.limits import DEFAULT_MAX_PROMPT_BYTES, MAX_REQUEST_ID_CHARS
from protocol.sampling import SamplingParams
from protocol.validation import RequestValidator, validate_request_id

VOCAB, CONTEXT = 2048, 256


class _NoTokenizer:
    """Proves a check runs before tokenizing: any call fails the test."""

    def encode(self, *args, **kwargs):
        raise AssertionError("the prompt was tokenized before the size check")


@pytest.fixture(scope="module")
def validator(llama_dir) -> RequestValidator:
    return RequestValidator(AutoTokenizer.from_pretrained(llama_dir), VOCAB, CONTEXT)


def _refused(message: str):
    return pytest.raises(InvalidRequest, match=f"^{re.escape(message)}$")


# ---- request ids ----------------------------------------------------------------------
@pytest.mark.parametrize("request_id", ["", "a", "req-1_x.y:z/~!", "".join(map(chr, range(0x21, 0x7F))),
                                        "x" * MAX_REQUEST_ID_CHARS])
def test_good_request_ids_pass(request_id):
    validate_request_id(request_id)


@pytest.mark.parametrize("request_id, message", [
    ("x" * 300, "request_id is 300 characters; at most 128 are allowed"),
    ("x" * 129, "request_id is 129 characters; at most 128 are allowed"),
    ("abcd\nef", "request_id may contain only printable ASCII characters without spaces (found '\\n' at 4)"),
    ("a b", "request_id may contain only printable ASCII characters without spaces (found ' ' at 1)"),
    ("tab\t", "request_id may contain only printable ASCII characters without spaces (found '\\t' at 3)"),
    ("é", "request_id may contain only printable ASCII characters without spaces (found 'é' at 0)"),
    ("ok\x7f", "request_id may contain only printable ASCII characters without spaces (found '\\x7f' at 2)"),
    ("\x00", "request_id may contain only printable ASCII characters without spaces (found '\\x00' at 0)"),
])
def test_bad_request_ids_are_refused(request_id, message):
    with _refused(message):
        validate_request_id(request_id)


# ---- sampling values ------------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("nan"), "temperature must be a finite number, got nan"),
    ("temperature", float("inf"), "temperature must be a finite number, got inf"),
    ("temperature", float("-inf"), "temperature must be a finite number, got -inf"),
    ("temperature", 1e-40, "temperature must be 0 or at least 1.1754944e-38 in size (smaller numbers are "
                           "denormal), got 1e-40"),
    ("temperature", -1e-45, "temperature must be 0 or at least 1.1754944e-38 in size (smaller numbers are "
                            "denormal), got -1e-45"),
    ("top_p", float("nan"), "top_p must be a finite number, got nan"),
    ("top_p", float("inf"), "top_p must be a finite number, got inf"),
    ("top_p", float("-inf"), "top_p must be a finite number, got -inf"),
    ("top_p", 5e-39, "top_p must be 0 or at least 1.1754944e-38 in size (smaller numbers are denormal), "
                     "got 5e-39"),
])
def test_non_finite_and_denormal_floats_are_refused(field, value, message):
    with _refused(message):
        SamplingParams(**{field: value}).validate()


def test_the_smallest_normal_float32_is_accepted():
    SamplingParams(temperature=1.1754944e-38, top_p=1.1754944e-38).validate()


@pytest.mark.parametrize("sampling, message", [
    (SamplingParams(stop=tuple(f"s{i}" for i in range(17))), "17 stop strings given; at most 16 are allowed"),
    (SamplingParams(stop=("ok", "y" * 101)), "a stop string is 101 characters; at most 100 are allowed"),
    (SamplingParams(stop=("ok", "")), "stop strings must not be empty"),
    (SamplingParams(stop_token_ids=tuple(range(65))), "65 stop_token_ids given; at most 64 are allowed"),
])
def test_too_many_or_too_long_stops_are_refused(sampling, message):
    with _refused(message):
        sampling.validate()


def test_stops_at_the_limits_are_accepted(validator):
    sampling = SamplingParams(stop=tuple("z" * 100 for _ in range(16)), stop_token_ids=tuple(range(64)))
    validator.check(10, sampling)


@pytest.mark.parametrize("ids, message", [
    ((5, VOCAB), "stop_token_ids has ids outside the vocabulary [0, 2048): [2048]"),
    ((-1, 7), "stop_token_ids has ids outside the vocabulary [0, 2048): [-1]"),
])
def test_stop_token_ids_must_be_in_the_vocabulary(validator, ids, message):
    with _refused(message):
        validator.check(10, SamplingParams(stop_token_ids=ids))


# ---- prompt size ----------------------------------------------------------------------
def test_a_prompt_over_the_byte_limit_is_refused_before_tokenizing():
    v = RequestValidator(_NoTokenizer(), VOCAB, CONTEXT)
    with _refused("the prompt is 2000000 bytes; at most 1048576 are allowed"):
        v.prompt_ids("x" * 2_000_000, None)
    with _refused("the prompt is 1200000 bytes; at most 1048576 are allowed"):
        v.prompt_ids("é" * 600_000, None)  # 600,000 characters, but 2 bytes each


def test_the_byte_limit_is_configurable_and_inclusive(validator):
    small = RequestValidator(validator.tokenizer, VOCAB, CONTEXT, max_prompt_bytes=10)
    assert small.prompt_ids("0123456789", None) == validator.prompt_ids("0123456789", None)
    with _refused("the prompt is 11 bytes; at most 10 are allowed"):
        small.prompt_ids("0123456789a", None)
    assert DEFAULT_MAX_PROMPT_BYTES == 1 << 20


def test_prompt_token_ids_longer_than_the_context_are_refused_first():
    v = RequestValidator(_NoTokenizer(), VOCAB, CONTEXT)
    with _refused("prompt_token_ids has 257 tokens; the model's context is 256 tokens"):
        v.prompt_ids(None, [10**9] * (CONTEXT + 1))  # out of vocab too, but the length is checked first


def test_a_prompt_with_a_lone_surrogate_is_refused():
    with _refused("the prompt is not valid Unicode text (a lone surrogate at 2)"):
        RequestValidator(_NoTokenizer(), VOCAB, CONTEXT).prompt_ids("ab\ud800", None)


# ---- chats ------------------------------------------------------------------------------
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def _with_template(validator: RequestValidator, template: str) -> RequestValidator:
    tokenizer = copy.deepcopy(validator.tokenizer)
    tokenizer.chat_template = template
    return RequestValidator(tokenizer, VOCAB, CONTEXT)


def test_a_chat_the_template_refuses_is_an_invalid_request_in_our_words(validator):
    strict = _with_template(validator, ALTERNATING)
    assert strict.chat_ids([{"role": "user", "content": "hi"}]) == validator.prompt_ids("user: hi\n", None)
    with _refused("this model's chat template refused these messages (templates often need user and assistant "
                  "messages to alternate, after an optional system message)"):
        strict.chat_ids([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}])


def test_a_broken_chat_template_is_not_blamed_on_the_request(validator):
    with pytest.raises(TemplateSyntaxError):
        _with_template(validator, "{% for m in messages %}").chat_ids([{"role": "user", "content": "hi"}])


# ---- resumed requests -------------------------------------------------------------------
def test_resumed_outputs_must_leave_a_token_to_generate(validator):
    validator.check_resumed([5, 6], SamplingParams(max_tokens=3))
    with _refused("the request already has 3 output tokens; max_tokens (3) leaves none to generate"):
        validator.check_resumed([5, 6, 7], SamplingParams(max_tokens=3))
    with _refused("output_token_ids has ids outside the vocabulary [0, 2048): [4096]"):
        validator.check_resumed([5, 4096], SamplingParams(max_tokens=3))
