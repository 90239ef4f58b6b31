"""Replays a `Workload` against any OpenAI-compatible server (`pdserve bench --endpoint openai:URL`).

Every request is one streaming POST /v1/completions: greedy, `max_tokens` the spec's exact
length, `stream_options.include_usage`, plus `extra_body` (default {"ignore_eos": true}; a
server that refuses unknown fields needs its own way to ignore EOS). Prompts go as token ids
when the server takes them (one probe before the run decides), else as text decoded with
`tokenizer`. Output tokens of a message: its `token_ids` where the server sends them (pdserve),
else one per message with text; a final `usage.completion_tokens` above the count adds the
difference to the last message (tokens whose text arrived merged).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx2

from bench.dispatch import PROGRESS_EVERY_S, Progress, dispatch
from bench.errors import BenchError, RouterUnreachable
from bench.metrics import RequestRecord
from bench.workload import RequestSpec, Workload
from client.credentials import Target

DEFAULT_EXTRA_BODY: Mapping[str, Any] = {"ignore_eos": True}
REQUEST_TIMEOUT_S = 300.0  # the longest wait for one request's next byte


def parse_endpoint(text: str) -> str:
    """'openai:http://HOST:PORT[/v1]' -> 'http://HOST:PORT/v1'."""
    kind, _, url = text.partition(":")
    if kind != "openai" or not url.startswith(("http://", "https://")):
        raise BenchError(f"--endpoint {text!r}: expected openai:http://HOST:PORT[/v1]")
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # ".../v1"
    model: str | None = None  # None: the first model of GET /v1/models
    extra_body: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_EXTRA_BODY))
    tokenizer: str | None = None  # decodes prompt ids to text for a server that refuses ids
    security: Target | None = None  # the bearer token (api key) and TLS files; the address is base_url


async def replay_openai(endpoint: Endpoint, workload: Workload, arrangement: str, *, connect_timeout_s: float = 10.0,
                        show_progress: bool = True, progress_every_s: float = PROGRESS_EVERY_S,
                        request_timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[list[RequestRecord], dict[str, Any]]:
    """One record per request, and what the report says about the server (url, model, prompt format)."""
    timeout = httpx2.Timeout(request_timeout_s, connect=connect_timeout_s)
    security = endpoint.security or Target(endpoint.base_url)
    tls = security.ssl_context()
    async with httpx2.AsyncClient(timeout=timeout, limits=httpx2.Limits(max_connections=None),
                                  headers=security.headers, verify=True if tls is None else tls) as http:
        model = await _model(http, endpoint, connect_timeout_s)
        prompts, prompt_format = await _prompt_format(http, endpoint, model, workload)
        run = _Run(http, endpoint, model, prompts, arrangement, time.perf_counter())
        progress = Progress(len(workload.requests), arrangement, sys.stderr if show_progress else None,
                            progress_every_s)
        records = await dispatch(workload, run.send, run.now, progress)
    return records, {"endpoint": endpoint.base_url, "model": model, "prompt_format": prompt_format}


async def _model(http: httpx2.AsyncClient, endpoint: Endpoint, timeout_s: float) -> str:
    """`endpoint.model`, else the first model the server lists; waits while it refuses connections
    or answers 503 (pdserve does until its workers have started)."""
    url, deadline = f"{endpoint.base_url}/models", time.monotonic() + timeout_s
    while True:
        try:
            response = await http.get(url)
            if response.status_code != 503:
                break
            if time.monotonic() > deadline:
                raise RouterUnreachable(f"server {endpoint.base_url} not ready within {timeout_s:g} s: HTTP 503: "
                                        f"{_message(response.content)}")
        except httpx2.TransportError as err:
            if time.monotonic() > deadline:
                raise RouterUnreachable(f"server {endpoint.base_url} not reachable within {timeout_s:g} s: "
                                        f"{err}") from err
        await asyncio.sleep(0.2)
    if endpoint.model:
        return endpoint.model
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"{url} answered {response.status_code} without a model list: give --model") from None


async def _prompt_format(http: httpx2.AsyncClient, endpoint: Endpoint, model: str,
                         workload: Workload) -> tuple[Callable[[RequestSpec], Any], str]:
    """Token ids if a probe with ids succeeds, else text from `endpoint.tokenizer`."""
    probe = list(workload.requests[0].prompt_token_ids[:8]) if workload.requests else [1]
    refused = await _probe(http, endpoint, model, probe)
    if refused is None:
        return (lambda spec: list(spec.prompt_token_ids)), "token ids"
    if endpoint.tokenizer is None:
        raise BenchError(f"{endpoint.base_url} refused a prompt of token ids ({refused}); give --tokenizer "
                         "(the server's tokenizer) to send the prompts as text, or change --extra-body")
    from transformers import AutoTokenizer  # slow to import; only text prompts need it

    tokenizer = AutoTokenizer.from_pretrained(endpoint.tokenizer)
    texts = {spec.request_id: tokenizer.decode(spec.prompt_token_ids) for spec in workload.requests}
    refused = await _probe(http, endpoint, model, tokenizer.decode(probe))
    if refused is not None:
        raise BenchError(f"{endpoint.base_url} refused a text prompt too: {refused} (see --extra-body)")
    return (lambda spec: texts[spec.request_id]), "text"


async def _probe(http: httpx2.AsyncClient, endpoint: Endpoint, model: str, prompt: Any) -> str | None:
    """None if the server generates for this prompt, else why not."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0} | dict(endpoint.extra_body)
    try:
        response = await http.post(f"{endpoint.base_url}/completions", json=body)
    except httpx2.HTTPError as err:
        raise BenchError(f"{endpoint.base_url}/completions failed: {type(err).__name__}: {err}") from err
    return None if response.status_code == 200 else f"HTTP {response.status_code}: {_message(response.content)}"


def _message(body: bytes) -> str:
    """The error sentence of an OpenAI error object or a FastAPI `detail`, else the raw body."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:200]
    if isinstance(data, dict):
        error = data.get("error", data.get("detail"))
        return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
    return str(data)[:300]


def message_tokens(event: Mapping[str, Any]) -> int:
    """Output tokens one streamed event carries: len(token_ids) if given, else 1 if it has text."""
    choices = event.get("choices") or []
    if not choices:
        return 0
    ids = choices[0].get("token_ids")
    return len(ids) if ids is not None else int(bool(choices[0].get("text")))


@dataclass
class _Run:
    http: httpx2.AsyncClient
    endpoint: Endpoint
    model: str
    prompt: Callable[[RequestSpec], Any]
    arrangement: str
    t0: float

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, spec: RequestSpec) -> RequestRecord:
        """Streams one request; an HTTP or stream error is recorded, never raised."""
        body = {"model": self.model, "prompt": self.prompt(spec), "max_tokens": spec.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        times: list[float] = []
        counts: list[int] = []
        finish, error, usage = "", None, {}
        send_s = self.now()
        try:
            async with self.http.sse(f"{self.endpoint.base_url}/completions", method="POST",
                                     json=body | dict(self.endpoint.extra_body)) as source:
                if source.response.status_code != 200:
                    error = f"HTTP {source.response.status_code}: {_message(await source.response.aread())}"
                else:
                    async for event in source:
                        if event.data.startswith("[DONE]"):
                            break
                        data = json.loads(event.data)
                        if "error" in data or "detail" in data:
                            error = f"stream error: {_message(event.data.encode())}"
                            break
                        if n := message_tokens(data):
                            times.append(self.now())
                            counts.append(n)
                        finish = ((data.get("choices") or [{}])[0].get("finish_reason") or finish)
                        usage = data.get("usage") or usage
        except (httpx2.HTTPError, ValueError) as err:  # transport failures, a malformed event
            error = f"{type(err).__name__}: {err}"
        if counts and usage.get("completion_tokens", 0) > sum(counts):
            counts[-1] += usage["completion_tokens"] - sum(counts)
        return RequestRecord(spec.request_id, self.arrangement, send_s, tuple(times), tuple(counts),
                             usage.get("prompt_tokens") or spec.num_prompt_tokens, spec.max_tokens, finish,
                             error, usage)
