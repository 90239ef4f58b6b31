"""The OpenAI HTTP door without a cluster: request bodies -> `Router.prepare` arguments
(router/frontdoor/openai_request.py), and the app over a stand-in Router (the statuses of its
refusals); tests/test_openai_api.py runs the same door over a real cluster."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx2
import openai
import pytest

from router.frontdoor.openai_request import ApiError, parse_request
from router.frontdoor.openai_server import OpenAIApi
from router.lifecycle.life import RequestLife
from router.lifecycle.outcomes import Chunk, InternalError, QueueFull, Unavailable
from router.observability.metrics import RouterMetrics

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Once upon a time"}]


# ---- the body -> SamplingParams mapping, no cluster --------------------------------------------
def test_openai_defaults_and_extensions_map_onto_sampling_params():
    p = parse_request({"prompt": "hi"}, chat=False)
    assert (p.prompt, p.prompt_ids, p.stream, p.include_usage) == ("hi", None, False, False)
    assert (p.sampling.max_tokens, p.sampling.temperature, p.sampling.top_p, p.sampling.top_k) == (16, 1.0, 1.0, 0)
    p = parse_request({"prompt": [[5, 6]], "temperature": 0, "top_k": -1, "stop": "\n", "seed": 3,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}, chat=False)
    assert p.prompt_ids == [5, 6] and p.sampling.greedy and p.sampling.top_k == 0
    assert (p.sampling.stop, p.sampling.seed, p.sampling.ignore_eos, p.include_usage) == (("\n",), 3, True, True)
    chat = parse_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}]}, chat=True)
    assert chat.messages == [{"role": "system", "content": "a"}] and not chat.max_tokens_given
    assert parse_request({"messages": CHAT, "max_completion_tokens": 7}, chat=True).sampling.max_tokens == 7


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "a", "n": 2}, "n", "n must be 1"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request: got 2 prompts"),
    ({"prompt": {"text": "a"}}, "prompt", "prompt must be a string or a list of token ids"),
    ({"prompt": "a", "max_tokens": "8"}, "max_tokens", "max_tokens must be an integer"),
    ({"prompt": "a", "echo": True}, "echo", "echo is not supported"),
    ({"prompt": "a", "seed": -1}, "seed", "seed must be in [0, 2**64)"),
    ({"prompt": "a", "stop": [1]}, "stop", "stop must be a string or a list of strings"),
])
def test_refused_bodies_name_the_field(body, param, message):
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=False)
    assert err.value.status == 400 and err.value.param == param and message in str(err.value)


# ---- the error mapping, over a stand-in Router (no cluster) ---------------------------------------
class _FakeRouter:
    """The Router surface the HTTP API uses: `prepare` raises `refuse`; `generate` yields `chunks`,
    then raises `fail`."""

    def __init__(self, chunks=(), fail: Exception | None = None, refuse: Exception | None = None):
        self.config = SimpleNamespace(model=SimpleNamespace(path="/models/fake"), router=SimpleNamespace(
            max_prompt_bytes=1024))
        self.validator, self.metrics, self.serving = SimpleNamespace(max_model_len=64), RouterMetrics(), True
        self.chunks, self.fail, self.refuse, self.closed = list(chunks), fail, refuse, False

    async def prepare(self, request_id, prompt, prompt_ids, sampling, messages=None) -> RequestLife:
        if self.refuse is not None:
            raise self.refuse
        return RequestLife(request_id, 0, prompt_ids or [1], sampling, 0.0)

    async def generate(self, life):
        try:
            for chunk in self.chunks:
                yield chunk
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed = True

    def errors(self, status: str) -> float:
        return self.metrics.registry.get_sample_value("pdserve_request_errors_total", {"status": status}) or 0


def _over(router: _FakeRouter, call):
    async def main():
        transport = httpx2.ASGITransport(app=OpenAIApi(router).app())
        async with openai.AsyncOpenAI(base_url="http://pdserve/v1", api_key="unused", max_retries=0,
                                      http_client=httpx2.AsyncClient(transport=transport)) as client:
            return await call(client)
    return asyncio.run(main())


@pytest.mark.parametrize("failure, error, status, kind, code, grpc_status", [
    (QueueFull("the router queue is full (1 waiting)"), openai.RateLimitError, 429, "rate_limit_error",
     "queue_full", "RESOURCE_EXHAUSTED"),
    (Unavailable("the decode pool has no worker"), openai.InternalServerError, 503, "server_error", "unavailable",
     "UNAVAILABLE"),
    (InternalError("sampling failed on decode-0"), openai.InternalServerError, 500, "server_error",
     "internal_error", "INTERNAL"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_router_failures_become_statuses_before_the_first_token(failure, error, status, kind, code, grpc_status,
                                                                stream):
    router = _FakeRouter(fail=failure)  # raised before any chunk: a status, not a stream

    async def call(client):
        with pytest.raises(error) as err:
            await client.completions.create(model="fake", prompt=[5], stream=stream)
        return err.value

    err = _over(router, call)
    assert err.status_code == status
    assert err.body == {"message": str(failure), "type": kind, "param": None, "code": code}
    assert router.closed and router.errors(grpc_status) == 1


def test_a_failure_after_the_first_token_is_an_error_event_and_closes_the_request():
    router = _FakeRouter([Chunk([5], "five")], fail=InternalError("detokenizing failed"))

    async def call(client):
        stream = await client.completions.create(model="fake", prompt=[5], stream=True)
        seen = []
        with pytest.raises(openai.APIError, match="detokenizing failed"):
            async for chunk in stream:
                seen.append(chunk.choices[0].text)
        return seen

    assert _over(router, call) == ["five"]
    assert router.closed and router.errors("INTERNAL") == 1
