"""Fuzzing both front doors of a real cluster (issue 46): hypothesis generates OpenAI request
bodies (the endpoints' own fields and strangers, each with values of every JSON type, the
right one among them) and gRPC GenerateRequests (every field, with and without presence).
Whatever comes, the answer is a success or the client's fault: HTTP 200 or 4xx, gRPC OK,
INVALID_ARGUMENT or RESOURCE_EXHAUSTED; never a 500, INTERNAL or UNKNOWN, and no KV block is
left held. FUZZ_EXAMPLES inputs a door (derandomized: the same ones every run), drawn BATCH at
a time and sent at once (one pool of keep-alive connections, one gRPC channel), so the engine
batches them as it would a crowd of clients.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

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

FUZZ_EXAMPLES = 1000
BATCH = 20  # inputs sent at once: each hypothesis example is a batch
FUZZ = settings(max_examples=FUZZ_EXAMPLES // BATCH, deadline=None, derandomize=True, database=None,
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


http_inputs = st.tuples(bodies, st.integers(0, 9), st.integers(0, 19))


def _post(http: httpx2.Client, body: dict, other_door: int, raw: int) -> tuple[dict, int, str]:
    chat = ("messages" in body) != (other_door == 0)  # mostly the endpoint the body is for
    text = json.dumps(body)
    content = (text if raw else text[: len(text) // 2]).encode()  # now and then cut short
    reply = http.post("/chat/completions" if chat else "/completions", content=content,
                      headers={"content-type": "application/json"})
    return body, reply.status_code, reply.text


def test_fuzz_http(cluster):
    seen: Counter[int] = Counter()
    limits = httpx2.Limits(max_connections=BATCH, max_keepalive_connections=BATCH)
    with httpx2.Client(base_url=cluster.http_url, timeout=120, limits=limits) as http, ThreadPoolExecutor(BATCH) as pool:
        @FUZZ
        @given(batch=st.lists(http_inputs, min_size=BATCH, max_size=BATCH))
        def some(batch: list[tuple[dict, int, int]]) -> None:
            for body, status, text in pool.map(lambda args: _post(http, *args), batch):
                seen[status] += 1
                assert status == 200 or 400 <= status < 500, (body, text)
                if body.get("stream") is True and status == 200:
                    assert "data: [DONE]" in text and '"server_error"' not in text, text
        some()
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


def _generate(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> grpc.StatusCode:
    try:
        list(stub.Generate(request, timeout=120))
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_fuzz_grpc(cluster):
    seen: Counter[grpc.StatusCode] = Counter()
    with grpc.insecure_channel(cluster.address) as channel, ThreadPoolExecutor(BATCH) as pool:
        stub = pb_grpc.GenerationStub(channel)

        @FUZZ
        @given(batch=st.lists(requests, min_size=BATCH, max_size=BATCH))
        def some(batch: list[pb.GenerateRequest]) -> None:
            for request, code in zip(batch, pool.map(lambda r: _generate(stub, r), batch), strict=True):
                seen[code] += 1
                assert code in CLIENT_FAULT, (request, code)
        some()
    assert sum(seen.values()) >= FUZZ_EXAMPLES and seen.get(grpc.StatusCode.OK), seen
