"""Fuzzing both front doors of a real cluster (issue 46): hypothesis generates OpenAI request
bodies (the endpoints' own fields and strangers, each with values of every JSON type, the
right one among them) and gRPC GenerateRequests (every field, with and without presence).
Whatever comes, the answer is a success or the client's fault: HTTP 200 or 4xx, gRPC OK,
INVALID_ARGUMENT or RESOURCE_EXHAUSTED; never a 500, INTERNAL or UNKNOWN, and no KV block is
left held. FUZZ_EXAMPLES inputs a door (derandomized: the same ones every run).
"""

from __future__ import annotations

import json

import grpc
import httpx2
import pytest
import ray

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz test needs hypothesis (the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from proto import pdserve_pb2 as pb  # noqa: E402
from proto import pdserve_pb2_grpc as pb_grpc  # noqa: E402
from router.frontdoor.openai_request import ENDPOINTS  # noqa: E402
from tests.cluster_util import wait_until  # noqa: E402

FUZZ_EXAMPLES = 2000
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
CLIENT_FAULT = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-3, 3), st.floats(allow_nan=False),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
tokens = st.lists(st.integers(0, 3000), min_size=1, max_size=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"])
                                 | json_values, "content": st.text(max_size=40) | json_values})
FIELDS = sorted(set(ENDPOINTS[False][0]) | set(ENDPOINTS[True][0]) | set(ENDPOINTS[False][1])
                | set(ENDPOINTS[True][1]) | {"guided_json", "logprobs", "suffix", "stream_options"})
# each field: a value of its own kind (small, so an accepted request is quick), or any JSON at all
KIND = {"max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4), "prompt": tokens | st.text(),
        "messages": st.lists(message, min_size=1, max_size=3), "stream": st.booleans(), "model": st.just("llama"),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()},
                                                optional={"continuous_usage_stats": st.booleans()}),
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
        "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=2)}
valid_chat = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=30)}),
                      min_size=1, max_size=1)
core = st.one_of(st.fixed_dictionaries({"prompt": tokens | st.text(min_size=1, max_size=30)}),
                 st.fixed_dictionaries({"messages": valid_chat | KIND["messages"]}))
extras = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=12), json_values, max_size=3).flatmap(
    lambda d: st.fixed_dictionaries({k: KIND.get(k, json_values) | json_values for k in d}))
# a body that may be right (a prompt or a chat, max_tokens small so accepted ones are quick) with up
# to three fields more, each of its own kind or anything; or any JSON object at all
bodies = st.builds(lambda c, e: {"max_tokens": 2} | c | e, core, extras) | st.dictionaries(
    st.text(max_size=12), json_values, max_size=4)


def _idle(cluster) -> bool:
    counts = [ray.get(w.actor.check.remote()) for w in cluster.router.pools.all()]
    return not cluster.router.lives and all(c["used"] == 0 and c["free"] == c["total"] for c in counts)


@pytest.fixture(scope="module")
def cluster(served):
    yield served
    wait_until(lambda: _idle(served), 60, "every request to end and every block to be free")


def test_fuzz_http(cluster):
    seen: dict[int, int] = {}
    with httpx2.Client(base_url=cluster.http_url, timeout=120) as http:
        @FUZZ
        @given(body=bodies, other_door=st.integers(0, 9), raw=st.integers(0, 19))
        def one(body: dict, other_door: int, raw: int) -> None:
            chat = ("messages" in body) != (other_door == 0)  # mostly the endpoint the body is for
            path = "/chat/completions" if chat else "/completions"
            text = json.dumps(body)
            content = (text if raw else text[: len(text) // 2]).encode()  # now and then cut short
            reply = http.post(path, content=content, headers={"content-type": "application/json"})
            if body.get("stream") is True and reply.status_code == 200:
                assert "data: [DONE]" in reply.text and '"server_error"' not in reply.text, reply.text
            seen[reply.status_code] = seen.get(reply.status_code, 0) + 1
            assert reply.status_code == 200 or 400 <= reply.status_code < 500, (body, reply.text)
        one()
    assert sum(seen.values()) >= FUZZ_EXAMPLES and seen.get(200) and seen.get(400), seen


sampling = st.builds(lambda fields: pb.SamplingParams(**fields), st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(0, 4) | st.integers(0, 2**32 - 1), "temperature": st.floats(width=32),
    "top_p": st.floats(width=32), "top_k": st.integers(0, 2**32 - 1), "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(max_size=6), max_size=3), "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=3),
    "ignore_eos": st.booleans()}))
requests = st.builds(
    lambda fields: pb.GenerateRequest(**fields),
    st.fixed_dictionaries({}, optional={
        "request_id": st.text(max_size=12), "prompt": st.text(max_size=40),
        "prompt_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=12) | tokens, "sampling": sampling,
        "messages": st.lists(st.builds(pb.ChatMessage, role=st.text(max_size=10) | st.sampled_from(["user", "system"]),
                                       content=st.text(max_size=20)), max_size=3),
        "cache_salt": st.text(max_size=300), "add_special_tokens": st.booleans()}))


def test_fuzz_grpc(cluster):
    seen: dict[grpc.StatusCode, int] = {}
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        @FUZZ
        @given(request=requests)
        def one(request: pb.GenerateRequest) -> None:
            try:
                list(stub.Generate(request, timeout=120))
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            seen[code] = seen.get(code, 0) + 1
            assert code in CLIENT_FAULT, (request, code)
        one()
    assert sum(seen.values()) >= FUZZ_EXAMPLES and seen.get(grpc.StatusCode.OK), seen
