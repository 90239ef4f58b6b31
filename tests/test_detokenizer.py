"""The detokenizer's protocol: a request's deltas concatenate to `decode(output_ids)` cut before
the first stop string, broken UTF-8 included, and a hand-off to a primed detokenizer neither
repeats nor drops a character."""

from __future__ import annotations

import copy
import random

import pytest
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer, _decoder
from protocol.errors import InvalidRequest


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tok(request, model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs[request.param])


@pytest.fixture(scope="module")
def byte_ids(tok) -> dict[int, int]:
    """Token id of each single byte (GPT-2's byte-to-unicode table, which ByteLevel uses)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in chars)})
    ids = {b: tok.convert_tokens_to_ids(c) for b, c in chars.items()}
    assert tok.decode([ids[b] for b in "中é".encode()]) == "中é"
    return ids


def _random_ids(rng: random.Random, tok, byte_ids: dict[int, int], n: int) -> list[int]:
    """Half single bytes (often broken UTF-8), half any token (merges and special tokens)."""
    return [byte_ids[rng.randrange(128, 256)] if rng.random() < 0.5 else rng.randrange(len(tok)) for _ in range(n)]


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    """Feed `ids` as an engine would: a non-final delta per token, a final one at a stop or the end."""
    deltas = []
    for token in ids:
        if detok.add_token(token):
            deltas.append(detok.take_delta(final=True))
            return deltas, True
        deltas.append(detok.take_delta(final=False))
    deltas.append(detok.take_delta(final=True))
    return deltas, False


def _expected(tok, ids: list[int], stop: tuple[str, ...]) -> str:
    text = tok.decode(ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(hits)] if hits else text


def test_deltas_concatenate_to_the_decoded_outputs(tok, byte_ids):
    rng = random.Random(0)
    broken = 0
    for _ in range(300):
        prompt = _random_ids(rng, tok, byte_ids, rng.randint(1, 10))
        out = _random_ids(rng, tok, byte_ids, rng.randint(1, 30))
        deltas, stopped = _stream(IncrementalDetokenizer(tok, prompt), out)
        assert "".join(deltas) == tok.decode(out, skip_special_tokens=True) and not stopped
        assert not any(d.endswith("\ufffd") for d in deltas[:-1]), "an incomplete character was sent mid-stream"
        broken += deltas[-1].endswith("\ufffd")
    assert broken > 20, "too few sequences ended mid-character to exercise the final flush"


def test_a_request_ending_mid_character_flushes_it(tok, byte_ids):
    out = [byte_ids[b] for b in "é".encode() + "中".encode()[:2]]
    detok = IncrementalDetokenizer(tok, [byte_ids[ord("a")]])
    deltas, _ = _stream(detok, out)
    assert deltas == ["", "é", "", "", "\ufffd"]


def test_output_bytes_completing_a_prompt_character_are_output_text(tok, byte_ids):
    prompt = [byte_ids[b] for b in "x中".encode()[:3]]  # ends with 2 of the 3 bytes of 中
    out = [byte_ids["中".encode()[2]], byte_ids[ord("a")]]
    deltas, _ = _stream(IncrementalDetokenizer(tok, prompt), out)
    assert "".join(deltas) == tok.decode(out) == "\ufffda"


def _stop_spanning_tokens(rng: random.Random, tok, out: list[int]) -> str | None:
    """A 2-4 character piece of the decoded output that starts in one token and ends in a later one."""
    k = rng.randint(1, len(out) - 1)
    head, text = tok.decode(out[:k], skip_special_tokens=True), tok.decode(out, skip_special_tokens=True)
    if not head or "\ufffd" in text or len(text) < len(head) + 2:
        return None
    return text[len(head) - 1:len(head) + rng.randint(1, 3)]


def test_stop_strings_split_across_tokens_are_cut_and_never_leak(tok):
    rng = random.Random(1)
    checked = 0
    while checked < 150:
        out = [rng.randrange(3, len(tok)) for _ in range(rng.randint(2, 25))]
        stop = _stop_spanning_tokens(rng, tok, out)
        if stop is None:
            continue
        stops = (stop, "\x00never")
        deltas, stopped = _stream(IncrementalDetokenizer(tok, [5, 6], stops), out)
        expected = _expected(tok, out, stops)
        assert "".join(deltas) == expected and stopped
        assert all(stop not in "".join(deltas[:i + 1]) for i in range(len(deltas)))
        checked += 1


def test_held_back_text_is_released_when_no_stop_comes(tok, byte_ids):
    rng = random.Random(2)
    for _ in range(100):
        out = _random_ids(rng, tok, byte_ids, rng.randint(1, 20))
        stops = ("\x00nowhere-to-be-seen",)
        deltas, stopped = _stream(IncrementalDetokenizer(tok, [7], stops), out)
        assert "".join(deltas) == tok.decode(out, skip_special_tokens=True) and not stopped


@pytest.mark.parametrize("with_stop", [False, True])
def test_hand_off_to_a_primed_detokenizer(tok, byte_ids, with_stop):
    rng = random.Random(3)
    for _ in range(150):
        prompt = _random_ids(rng, tok, byte_ids, rng.randint(1, 8))
        out = _random_ids(rng, tok, byte_ids, rng.randint(2, 25))
        stops = (_stop_spanning_tokens(rng, tok, out) or "zz",) if with_stop else ()
        k = rng.randint(1, len(out) - 1)
        first = IncrementalDetokenizer(tok, prompt, stops)
        if any(first.add_token(t) for t in out[:k]):
            continue  # finished before the hand-off: nothing goes on
        sent = first.take_delta(final=False)
        second = IncrementalDetokenizer(tok, prompt, stops)
        assert not any(second.add_token(t) for t in out[:k])
        second.mark_emitted(len(sent))
        rest, _ = _stream(second, out[k:])
        assert sent + "".join(rest) == _expected(tok, out, stops)


def test_mark_emitted_refuses_more_than_the_text(tok):
    detok = IncrementalDetokenizer(tok, [5])
    detok.add_token(tok.encode("hello", add_special_tokens=False)[0])
    with pytest.raises(InvalidRequest, match=r"emitted_chars is 99 but the output text so far has \d+ characters"):
        detok.mark_emitted(99)


def test_the_decoder_is_the_backends_where_that_is_what_decode_returns(tok, byte_ids):
    """A transformers fast tokenizer that neither cleans up spaces nor overrides decoding is decoded
    by its Rust backend directly (transformers' `_decode` returns the backend's text): the same text
    for any ids, special tokens and broken UTF-8 included. A tokenizer that cleans up, or any other
    object with a `decode`, is called as it is."""
    fast = _decoder(tok)
    assert "backend" in fast.__code__.co_freevars  # the backend's decode, not transformers' wrapper
    rng = random.Random(3)
    for _ in range(200):
        ids = _random_ids(rng, tok, byte_ids, rng.randint(0, 12))
        assert fast(ids) == tok.decode(ids, skip_special_tokens=True)

    class Own:
        def decode(self, ids, skip_special_tokens=False):
            return f"{len(ids)} {skip_special_tokens}"

    assert _decoder(Own())([1, 2]) == "2 True"
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert "backend" not in _decoder(cleaning).__code__.co_freevars
