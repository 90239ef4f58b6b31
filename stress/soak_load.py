"""The soak's load (stress/soak.py), run in a process of its own so the router's process pays only
for serving: gRPC streams, HTTP completions and chats streamed and whole, clients that cancel
mid-stream, bad requests that must get their precise status, and prompts that share prefixes;
each outcome tallied, and the first CHECKED greedy requests kept for the token check."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from dataclasses import dataclass, field

import grpc
import httpx2

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

VOCAB = (10, 2000)
PREFIXES = 4  # shared 48-token prefixes (3 full KV blocks) half the prompts start with
REQUEST_TIMEOUT_S = 60.0  # a request not answered by then counts as "HUNG"
CHECKED = 200  # greedy requests whose tokens are compared with the reference (the first ones)
# what each bad request must get, exactly
BAD_GRPC = "INVALID_ARGUMENT"
BAD_HTTP = {"top_p": "400", "json": "400", "model": "404"}


@dataclass
class Tally:
    """What the clients saw. A status is a gRPC code name or an HTTP status; "SHORT" is an answer
    with fewer tokens than asked for (every good request sets ignore_eos)."""

    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    errors_by_status: collections.Counter = field(default_factory=collections.Counter)
    unexpected: collections.Counter = field(default_factory=collections.Counter)
    greedy: list[tuple[list[int], int, list[int]]] = field(default_factory=list)  # prompt, max_tokens, tokens

    def tokens(self, prompt: list[int], max_tokens: int, tokens: list[int]) -> None:
        """A greedy request's whole output, kept for the reference check (the first CHECKED)."""
        if len(self.greedy) < CHECKED:
            self.greedy.append((prompt, max_tokens, tokens))

    def outcome(self, kind: str, status: str, expected: str = "OK") -> None:
        if status == "OK" and expected == "OK":
            self.completed += 1
        elif status != "OK":
            self.errors_by_status[status] += 1
        if status != expected:
            self.unexpected[f"{kind} {status}"] += 1


@dataclass(frozen=True)
class Target:
    grpc: str
    http: str  # the OpenAI base URL, .../v1
    model: str  # the served model's id


class Load:
    """`concurrency` clients, each sending one request after another, its kind drawn at random."""

    def __init__(self, target: Target, seed: int):
        self.target, self.tally = target, Tally()
        rng = random.Random(f"soak-prefixes-{seed}")
        self.prefixes = [[rng.randrange(*VOCAB) for _ in range(48)] for _ in range(PREFIXES)]
        self.kinds = {"grpc": self.grpc, "grpc_cancel": self.grpc_cancel, "grpc_bad": self.grpc_bad,
                      "completion": self.completion, "chat": self.chat, "http_cancel": self.http_cancel,
                      "http_bad": self.http_bad}

    def prompt(self, rng: random.Random) -> list[int]:
        tail = [rng.randrange(*VOCAB) for _ in range(rng.randint(4, 40))]
        return rng.choice(self.prefixes) + tail if rng.random() < 0.5 else tail

    async def run(self, seconds: float, concurrency: int, seed: int, started) -> Tally:
        """Sends for `seconds` from when it sets `started` (connected: the sampler's clock starts)."""
        async with grpc.aio.insecure_channel(self.target.grpc) as channel, \
                httpx2.AsyncClient(base_url=self.target.http, timeout=REQUEST_TIMEOUT_S) as http:
            await asyncio.wait_for(channel.channel_ready(), 10)
            stub = pb_grpc.GenerationStub(channel)
            started.set()
            until = time.monotonic() + seconds
            await asyncio.gather(*(self.client(stub, http, until, random.Random(f"soak-{seed}-{i}"))
                                   for i in range(concurrency)))
        return self.tally

    async def client(self, stub, http, until: float, rng: random.Random) -> None:
        names = list(self.kinds)
        while time.monotonic() < until:
            kind = rng.choice(names)
            self.tally.sent += 1
            try:
                await asyncio.wait_for(self.kinds[kind](stub, http, rng), REQUEST_TIMEOUT_S)
            except TimeoutError:
                self.tally.outcome(kind, "HUNG")
            except (httpx2.HTTPError, ValueError) as e:  # transport failures, a body that is not JSON
                self.tally.outcome(kind, type(e).__name__)

    # -- gRPC
    @staticmethod
    def _sampling(rng: random.Random, max_tokens: int) -> pb.SamplingParams:
        sampled = {} if rng.random() < 0.5 else {"temperature": 0.75, "top_p": 0.875, "seed": rng.randrange(2**31)}
        return pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampled)

    async def grpc(self, stub, http, rng: random.Random) -> None:
        max_tokens, got = rng.randint(4, 24), []
        sampling = self._sampling(rng, max_tokens)
        request = pb.GenerateRequest(prompt_token_ids=self.prompt(rng), sampling=sampling)
        try:
            async for msg in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
                got += msg.token_ids
        except grpc.aio.AioRpcError as e:
            return self.tally.outcome("grpc", e.code().name)
        if len(got) == max_tokens and not sampling.HasField("seed"):  # greedy
            self.tally.tokens(list(request.prompt_token_ids), max_tokens, got)
        self.tally.outcome("grpc", "OK" if len(got) == max_tokens else "SHORT")

    async def grpc_cancel(self, stub, http, rng: random.Random) -> None:
        request = pb.GenerateRequest(prompt_token_ids=self.prompt(rng), sampling=self._sampling(rng, 64))
        call = stub.Generate(request, timeout=REQUEST_TIMEOUT_S)
        try:
            async for _ in call:
                call.cancel()  # after the first message
                break
        except grpc.aio.AioRpcError as e:
            if e.code() is not grpc.StatusCode.CANCELLED:
                return self.tally.outcome("grpc_cancel", e.code().name)
        self.tally.cancelled += 1

    async def grpc_bad(self, stub, http, rng: random.Random) -> None:
        bad = rng.choice([pb.SamplingParams(max_tokens=4, top_p=2.0), pb.SamplingParams(max_tokens=10**6)])
        request = pb.GenerateRequest(prompt_token_ids=self.prompt(rng), sampling=bad)
        try:
            async for _ in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
                pass
        except grpc.aio.AioRpcError as e:
            return self.tally.outcome("grpc_bad", e.code().name, BAD_GRPC)
        self.tally.outcome("grpc_bad", "OK", BAD_GRPC)

    # -- HTTP
    async def completion(self, stub, http, rng: random.Random) -> None:
        max_tokens = rng.randint(4, 24)
        body = {"model": self.target.model, "prompt": self.prompt(rng), "max_tokens": max_tokens, "ignore_eos": True}
        if rng.random() < 0.5:  # greedy (OpenAI's default temperature is 1: sampled)
            body["temperature"] = 0
        await self._http("completion", http, "/completions", body, rng, max_tokens)

    async def chat(self, stub, http, rng: random.Random) -> None:
        max_tokens = rng.randint(4, 16)
        words = " ".join(rng.choice(("once", "upon", "a", "time", "there", "was", "soak")) for _ in range(12))
        body = {"model": self.target.model, "messages": [{"role": "user", "content": words}],
                "max_tokens": max_tokens, "ignore_eos": True}
        await self._http("chat", http, "/chat/completions", body, rng, max_tokens)

    async def _http(self, kind: str, http, path: str, body: dict, rng: random.Random, max_tokens: int) -> None:
        """Streamed (usage in the last event) or whole; OK when the usage counts max_tokens. A
        greedy completion's tokens (temperature 0) are kept for the reference check."""
        tokens: list[int] = []
        if rng.random() < 0.5:
            reply = await http.post(path, json=body)
            status = str(reply.status_code)
            whole = reply.json() if reply.status_code == 200 else {}
            usage = whole.get("usage")
            tokens = [t for c in whole.get("choices", []) for t in c.get("token_ids") or []]
        else:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            usage = None
            async with http.stream("POST", path, json=body) as reply:
                status = str(reply.status_code)
                async for line in reply.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        usage = event.get("usage") or usage
                        tokens += [t for c in event.get("choices", []) for t in c.get("token_ids") or []]
        if status == "200":
            status = "OK" if usage and usage["completion_tokens"] == max_tokens else "SHORT"
        if status == "OK" and body.get("temperature") == 0 and len(tokens) == max_tokens:
            self.tally.tokens(body["prompt"], max_tokens, tokens)
        self.tally.outcome(kind, status)

    async def http_cancel(self, stub, http, rng: random.Random) -> None:
        """A stream the client closes after its first event: the router must abort it everywhere."""
        body = {"model": self.target.model, "prompt": self.prompt(rng), "max_tokens": 64, "stream": True}
        async with http.stream("POST", "/completions", json=body) as reply:
            if reply.status_code != 200:
                return self.tally.outcome("http_cancel", str(reply.status_code))
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    break
        self.tally.cancelled += 1

    async def http_bad(self, stub, http, rng: random.Random) -> None:
        why = rng.choice(sorted(BAD_HTTP))
        if why == "json":
            reply = await http.post("/completions", content=b'{"prompt": [5,', headers={"content-type": "application/json"})
        else:
            body = {"model": self.target.model if why != "model" else "no-such-model", "prompt": [5, 6],
                    "max_tokens": 4} | ({"top_p": 2} if why == "top_p" else {})
            reply = await http.post("/completions", json=body)
        status = str(reply.status_code)
        if status == BAD_HTTP[why] and "error" not in reply.json():  # not an OpenAI error object
            status = "NO_ERROR_BODY"
        self.tally.outcome(f"http_bad({why})", status, BAD_HTTP[why])


def _load_process(target: Target, seconds: float, concurrency: int, seed: int, started, results) -> None:
    tally = asyncio.run(Load(target, seed).run(seconds, concurrency, seed, started))
    results.put({"sent": tally.sent, "completed": tally.completed, "cancelled": tally.cancelled,
                 "errors_by_status": dict(tally.errors_by_status), "unexpected_errors": dict(tally.unexpected),
                 "greedy": tally.greedy})
