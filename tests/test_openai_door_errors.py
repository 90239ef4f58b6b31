"""The OpenAI HTTP door's refusals without a cluster: the app over a stand-in Router, each failure
as the status, error type and code the OpenAI SDK sees, before and after the first token, and the
door's own bounds (a body or request head that does not arrive in time, hostile bodies, a model not
served). The body mapping: tests/test_openai_request.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx2
import openai
import pytest

from router.frontdoor.openai_server import OpenAIApi, OpenAIServer
from router.lifecycle.life import RequestLife
from router.lifecycle.outcomes import Chunk, InternalError, QueueFull, Unavailable
from router.lifecycle.service import Router
from router.observability.metrics import RouterMetrics
from tests.test_openai_request import CHAT, MODEL


# ---- the error mapping, over a stand-in Router (no cluster) ---------------------------------------
class _FakeRouter:
    """The Router surface the HTTP API uses: `prepare` raises `refuse`; `generate` yields `chunks`,
    then raises `fail`; open (accepting and serving) unless told otherwise."""

    check_open = Router.check_open

    def __init__(self, chunks=(), fail: Exception | None = None, refuse: Exception | None = None):
        self.config = SimpleNamespace(model=SimpleNamespace(path=f"/models/{MODEL}"), router=SimpleNamespace(
            max_prompt_bytes=1024, read_timeout_s=0.5, max_concurrent_calls=8, write_timeout_s=0.5,
            max_connections=64, max_connections_per_address=64, max_body_bytes_in_flight=1 << 20))
        self.validator, self.metrics = SimpleNamespace(max_model_len=64), RouterMetrics()
        self.intake = SimpleNamespace(check_room=lambda large: None)
        self.accepting = self.started = self.serving = True
        self.chunks, self.fail, self.refuse, self.closed = list(chunks), fail, refuse, False

    async def prepare(self, request_id, prompt, prompt_ids, sampling, messages=None, caller="",
                      add_special_tokens=None) -> RequestLife:
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
    # what the client reads of a server-side failure names no worker (router/frontdoor/public_errors.py)
    message = str(failure).replace("decode-0", "a decode worker")
    assert err.body == {"message": message, "type": kind, "param": None, "code": code}
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


# ---- refusals through the app ------------------------------------------------------------------
def _http(router: _FakeRouter, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    async def main():
        transport = httpx2.ASGITransport(app=OpenAIApi(router).app())
        async with httpx2.AsyncClient(transport=transport, base_url="http://pdserve") as http:
            response = await http.request(method, path, content=body)
            return response.status_code, response.json()
    return asyncio.run(main())


@pytest.mark.parametrize("started, message", [(False, "the server is starting"),
                                              (True, "the server is shutting down")])
def test_every_v1_path_is_503_while_the_router_takes_no_requests(started, message):
    router = _FakeRouter()
    router.accepting, router.started, router.serving = False, started, False
    refused = {"message": message, "type": "server_error", "param": None, "code": "unavailable"}
    assert _http(router, "GET", "/v1/models") == (503, {"error": refused})
    body = json.dumps({"prompt": [5]}).encode()
    assert _http(router, "POST", "/v1/completions", body) == (503, {"error": refused})
    assert _http(router, "POST", "/v1/chat/completions", body) == (503, {"error": refused})
    assert _http(router, "GET", "/health") == (503, {"status": "not serving"})
    assert router.errors("UNAVAILABLE") == 3
    router.accepting = router.serving = True  # the pools are up: /health and /v1 agree
    assert _http(router, "GET", "/health") == (200, {"status": "serving"})
    status, models = _http(router, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("raw, param, message", [
    (b'{"prompt": [5], "temperature": ' + b"9" * 401 + b"}", "temperature", "temperature must be a number that "
                                                                        "fits in 64 bits, got 9999"),
    (b'{"prompt": ' + b"[" * 20_000 + b"5" + b"]" * 20_000 + b"}", None, "the request body nests JSON more"),
    (b'{"prompt": [5], "logprobs": 0}', "logprobs", "logprobs is not supported"),
])
def test_hostile_bodies_are_400_not_500(raw, param, message):
    router = _FakeRouter()
    status, body = _http(router, "POST", "/v1/completions", raw)
    assert status == 400 and body["error"]["param"] == param and body["error"]["message"].startswith(message)
    assert router.errors("INVALID_ARGUMENT") == 1


def test_a_model_not_served_is_the_sdks_not_found_error():
    async def call(client):
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(model="gpt-4o", messages=CHAT)
        return err.value

    err = _over(_FakeRouter(), call)
    assert err.status_code == 404 and err.body["code"] == "model_not_found" and err.body["param"] == "model"


def test_an_unexpected_error_is_a_500_that_echoes_none_of_its_text():
    response = asyncio.run(OpenAIApi._bug(None, RuntimeError("/secret/path/model.bin: checksum 0xdead")))
    body = json.loads(response.body)
    assert response.status_code == 500
    assert body["error"]["type"] == "server_error"
    assert body["error"]["message"] == "internal error (RuntimeError); the server log has the details"


def test_a_body_that_does_not_arrive_in_time_is_408():
    """A client that sends its headers and then trickles (here: stops sending) its body gets 408 after
    router.read_timeout_s, and the router never sees the request."""
    router = _FakeRouter(refuse=AssertionError("a request without its body reached the router"))

    async def stalled():
        yield b'{"prompt": [5], '
        await asyncio.sleep(30)
        yield b'"max_tokens": 1}'

    async def main():
        transport = httpx2.ASGITransport(app=OpenAIApi(router).app())
        async with httpx2.AsyncClient(transport=transport, base_url="http://pdserve") as client:
            return await client.post("/v1/completions", content=stalled(), headers={"content-type": "application/json"})

    reply = asyncio.run(main())
    assert reply.status_code == 408
    assert reply.json()["error"]["message"] == "the request body did not arrive within 0.5 s"


async def _closed_by_server(port: int, sent: bytes, drip_s: float | None = None) -> float:
    """Opens a raw connection, sends `sent` (all at once, or a byte every `drip_s`: slowloris) and
    returns the seconds until the server closed it without a byte of reply; fails after 10 s."""
    loop = asyncio.get_running_loop()
    started = loop.time()  # before the connect: the server's deadline starts when it accepts, inside it
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        try:
            for i in range(len(sent)) if drip_s is not None else ():
                writer.write(sent[i:i + 1])
                await writer.drain()
                await asyncio.sleep(drip_s)
            writer.write(sent if drip_s is None else b"")
        except ConnectionError:
            pass  # closed under it: what the test wants
    sender = asyncio.create_task(send())
    try:
        assert await asyncio.wait_for(reader.read(), 10) == b""  # EOF, and no reply to a head never finished
        return loop.time() - started
    finally:
        sender.cancel()
        writer.close()


def test_a_request_head_that_does_not_arrive_in_time_closes_its_connection():
    """Connections that send nothing, half a request line, or headers a byte at a time (slowloris)
    are closed router.read_timeout_s (0.5 s here) after they opened, so they cannot hold connection
    slots (router.max_concurrent_calls) for ever; meanwhile a good request is answered."""
    async def main():
        server = OpenAIServer(_FakeRouter(), "127.0.0.1", 0)
        await server.start()
        try:
            slow = b"GET /v1/models HTTP/1.1\r\nHost: pdserve\r\n" + b"X-Slow: 1\r\n" * 1000  # 550 s at this pace
            hostile = asyncio.gather(_closed_by_server(server.port, b""), _closed_by_server(server.port, b"GET /v1/mo"),
                                     _closed_by_server(server.port, slow, drip_s=0.05))
            async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
                good = await client.get("/v1/models")
            return good, await hostile
        finally:
            await server.stop()

    good, closed_after = asyncio.run(main())
    assert good.status_code == 200 and good.json()["data"][0]["id"] == MODEL
    assert all(0.5 <= s < 10 for s in closed_after), closed_after
