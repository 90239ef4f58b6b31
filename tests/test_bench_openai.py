"""The bench's OpenAI endpoint client: against pdserve's own HTTP front door on the tiny model
(token-id prompts, exact lengths, the CLI's `--endpoint`), and against a stand-in for a server
that takes only text prompts, refuses unknown fields and streams merged tokens without ids."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import httpx2
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from transformers import AutoTokenizer

from bench.errors import BenchError, RouterUnreachable
from bench.openai_client import Endpoint, _model, parse_endpoint, replay_openai
from bench.workload import RequestSpec, make_workload
from cli.main import main as pdserve


def _workload(lengths: list[int], concurrency: int | None = 3):
    rng = random.Random(0)
    specs = [RequestSpec(f"req-{i}", 0.0 if concurrency else 0.02 * i,
                         tuple(rng.randrange(16, 256) for _ in range(rng.randint(5, 40))), n)
             for i, n in enumerate(lengths)]
    return make_workload("test", specs, concurrency, {"preset": "test"})


def test_endpoint_urls():
    assert parse_endpoint("openai:http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert parse_endpoint("openai:http://h:1/v1/") == "http://h:1/v1"
    with pytest.raises(BenchError, match="expected openai:http"):
        parse_endpoint("http://127.0.0.1:8000")


def test_the_model_is_asked_for_until_the_server_stops_answering_503():
    answers = [503, 503, 200]

    def models(request: httpx2.Request) -> httpx2.Response:
        status = answers.pop(0) if len(answers) > 1 else answers[0]
        body = {"object": "list", "data": [{"id": "tiny"}]} if status == 200 else {
            "error": {"message": "the server is starting"}}
        return httpx2.Response(status, json=body)

    async def ask(timeout_s: float) -> str:
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(models)) as http:
            return await _model(http, Endpoint("http://pdserve/v1"), timeout_s)

    assert asyncio.run(ask(10.0)) == "tiny"
    answers[:] = [503]
    with pytest.raises(RouterUnreachable, match="not ready within 0.3 s: HTTP 503: the server is starting"):
        asyncio.run(ask(0.3))


# ---- against pdserve's HTTP front door ------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(served):  # the session's default 1 + 1 cluster (conftest), its HTTP port on
    return served


def test_client_replays_token_id_prompts_with_exact_lengths(cluster):
    workload = _workload([5, 1, 8, 3, 6, 2])
    accepted = cluster.router.requests_total
    records, server = asyncio.run(replay_openai(Endpoint(cluster.http_url), workload, "pdserve",
                                                show_progress=False))
    assert server == {"endpoint": cluster.http_url, "model": "llama", "prompt_format": "token ids"}
    by_id = {r.request_id: r for r in records}
    for spec in workload.requests:
        r = by_id[spec.request_id]
        assert r.error is None and r.finish_reason == "length" and r.arrangement == "pdserve"
        assert r.output_tokens == spec.max_tokens and r.prompt_tokens == spec.num_prompt_tokens
        assert r.usage["completion_tokens"] == spec.max_tokens
        assert r.send_s < r.message_times_s[0] and list(r.message_times_s) == sorted(r.message_times_s)
    assert cluster.router.requests_total == accepted + len(workload.requests) + 1  # the probe too


def test_cli_endpoint_writes_the_report(cluster, tmp_path, capsys):
    assert pdserve(["bench", "--endpoint", f"openai:{cluster.http_url}", "--num-requests", "4", "--rate", "50",
                    "--input-len", "12", "--output-len", "4", "--out", str(tmp_path), "--no-progress"]) == 0
    assert "== endpoint: 4 requests, 0 failed" in capsys.readouterr().out
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["cluster"]["prompt_format"] == "token ids"
    assert doc["arrangements"]["endpoint"]["output_tokens"] == 16


# ---- against a text-only server that merges tokens ---------------------------------------------
class _TextOnlyServer:
    """Like `transformers serve`: text prompts only (400), unknown fields refused (422), one event
    per token without ids except the last two tokens in one event, usage on the finish event, no [DONE]."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        app = Starlette(routes=[Route("/v1/models", self.models), Route("/v1/completions", self.complete,
                                                                         methods=["POST"])])
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "text-only", "object": "model"}]})

    async def complete(self, request: Request):
        body = await request.json()
        if set(body) - {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options"}:
            return JSONResponse({"detail": f"Unexpected fields in the request: {set(body) - {'model'}}"}, 422)
        if not isinstance(body["prompt"], str):
            return JSONResponse({"detail": "prompt must be a string."}, 400)
        self.prompts.append(body["prompt"])
        n = body["max_tokens"]
        texts = ["a"] * (n - 2) + ["bc"] if n >= 2 else ["a"]

        async def events():
            for text in texts:
                await asyncio.sleep(0.005)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n"
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
            yield f"data: {json.dumps(last)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def __enter__(self) -> _TextOnlyServer:
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_text_prompts_from_the_tokenizer_and_merged_tokens_counted_from_usage(llama_dir):
    workload = _workload([6, 3, 1], concurrency=None)
    with _TextOnlyServer() as server:
        endpoint = Endpoint(server.url, extra_body={}, tokenizer=llama_dir)
        records, info = asyncio.run(replay_openai(endpoint, workload, "peer", show_progress=False))
    assert info["prompt_format"] == "text" and info["model"] == "text-only"
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert server.prompts[1:] == [tokenizer.decode(s.prompt_token_ids) for s in workload.requests]  # after the probe
    by_id = {r.request_id: r for r in records}
    assert [by_id[f"req-{i}"].message_tokens for i in range(3)] == [(1, 1, 1, 1, 2), (1, 2), (1,)]
    assert all(r.ok and r.finish_reason == "length" and r.prompt_tokens == 7 for r in records)


def test_a_server_that_refuses_ids_needs_a_tokenizer_and_a_fitting_extra_body(llama_dir):
    with _TextOnlyServer() as server:
        with pytest.raises(BenchError, match="refused a prompt of token ids .*give --tokenizer"):
            asyncio.run(replay_openai(Endpoint(server.url, extra_body={}), _workload([2]), "peer",
                                      show_progress=False))
        with pytest.raises(BenchError, match="refused a text prompt too: HTTP 422: Unexpected fields.*--extra-body"):
            asyncio.run(replay_openai(Endpoint(server.url, tokenizer=llama_dir), _workload([2]), "peer",
                                      show_progress=False))
