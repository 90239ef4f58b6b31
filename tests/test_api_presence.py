"""Field presence in the public API, end to end through a real cluster: an unset sampling field
gets its documented default, an explicitly set one is used as given, so an explicit zero that is
out of range is refused with INVALID_ARGUMENT rather than silently replaced by the default."""

from __future__ import annotations

import random

import grpc
import pytest

from proto import pdserve_pb2 as pb
from tests.cluster_util import Client
from tests.reference import hf_greedy


@pytest.fixture(scope="module")
def client(served):  # the session's default 1 + 1 cluster (conftest)
    c = Client(served.address)
    yield c
    c.close()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(f"test_api_presence-{seed}")  # its own prompts: the shared clusters' caches hold others'
    return [rng.randrange(10, 2000) for _ in range(rng.randint(8, 40))]


@pytest.mark.parametrize("sampling, message", [
    (pb.SamplingParams(max_tokens=0), "max_tokens must be at least 1"),
    (pb.SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
])
def test_explicit_zero_out_of_range_is_invalid_argument(client, sampling, message):
    assert sampling.ListFields(), "the zero must be on the wire as a set field"
    request = pb.GenerateRequest(prompt_token_ids=_prompt(1), sampling=sampling)
    with pytest.raises(grpc.RpcError) as err:
        list(client.gen.Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_unset_max_tokens_is_16(client, llama_dir):
    prompt = _prompt(2)
    tokens, last = client.tokens(prompt, ignore_eos=True)
    assert len(tokens) == 16 and last.finish_reason == "length" and last.usage.completion_tokens == 16
    assert tokens == hf_greedy(llama_dir, prompt, 16, ignore_eos=True)  # unset temperature: greedy


def test_explicit_temperature_zero_with_a_seed_is_greedy(client, llama_dir):
    prompt = _prompt(3)
    tokens, last = client.tokens(prompt, max_tokens=20, temperature=0.0, seed=1234, ignore_eos=True)
    assert last.finish_reason == "length"
    assert tokens == hf_greedy(llama_dir, prompt, 20, ignore_eos=True)
