"""Soak (issue 23, item 13): hours of mixed, partly hostile traffic must not grow any process.

    python -m stress.soak --minutes N [--sample-s S] [--concurrency C] [--seed K] [--model DIR] [--json]

Starts a real 2 prefill + 2 decode cluster (the tiny random model of checkpoints/tiny.py unless
--model; Ray, the router, gRPC and the OpenAI HTTP door) and drives it for N minutes from a
process of its own (so the router's process pays only for serving): gRPC streams, HTTP
completions and chats streamed and whole, clients that cancel mid-stream, bad requests that must
get their precise status (INVALID_ARGUMENT, 400, 404), and prompts that share prefixes. The
first `--sample-s` seconds (default 60) warm up; then, and every `--sample-s` after, the RSS of
the router's process (this one) and of every worker actor is sampled. After the load, the
workers' block accounting must come back whole (used 0, free == total: blocks the prefix cache
keeps are free, evictable). The tokens of the first CHECKED greedy requests (gRPC and HTTP
completions) must be the tokens an in-process engine with the cluster's own engine config
produces for them afterwards (a request that finished with the right count but wrong tokens is
no success).

`--json` prints {"minutes", "samples": {proc: [MB, ...]}, "rss_growth_mb": {proc: last - first},
"rss_growth_pct", "completed", "cancelled", "sent", "errors_by_status": {status: n},
"unexpected_errors": {"kind status": n}, "tokens_checked", "tokens_wrong": [{prompt, max_tokens, got,
reference}, ...], "leaked_blocks": {worker: used}, "integrity_errors",
"pools_at_end", "targets_met", "missed_targets"}. Targets (exit 0 when all hold, 1 otherwise):
every process's RSS grows at most 5% after the warm-up, 0 leaked blocks, no error but the
expected statuses, every checked greedy request token-exact, every pool at its size at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import queue
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpc  # noqa: E402
import httpx2  # noqa: E402
import ray  # noqa: E402

from checkpoints.tiny import make_tiny_model  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from proto import pdserve_pb2 as pb  # noqa: E402
from proto import pdserve_pb2_grpc as pb_grpc  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402
from router.config.loader import parse_config  # noqa: E402
from router.config.schema import ClusterConfig  # noqa: E402
from router.launch import LocalCluster  # noqa: E402
from stress.chaos import ChaosOptions, ChaosReport, _ready_views, settle  # noqa: E402

GROWTH_PCT = 5.0  # the most any process's RSS may grow after the warm-up
VOCAB = (10, 2000)
PREFIXES = 4  # shared 48-token prefixes (3 full KV blocks) half the prompts start with
REQUEST_TIMEOUT_S = 60.0  # a request not answered by then counts as "HUNG"
START_TIMEOUT_S = 300.0  # four workers on a shared 2-core host can take minutes to start
LOAD_START_S = 120.0
CHECKED = 200  # greedy requests whose tokens are compared with the reference (the first ones)
# what each bad request must get, exactly
BAD_GRPC = "INVALID_ARGUMENT"
BAD_HTTP = {"top_p": "400", "json": "400", "model": "404"}


def cluster_config(model: str) -> ClusterConfig:
    raw = {"model": {"path": model}, "mode": "disaggregated",
           "router": {"host": "127.0.0.1", "port": 0, "http_port": 0, "metrics_port": None, "shutdown_grace_s": 5},
           "prefill": {"replicas": 2, "num_cpus": 0.5}, "decode": {"replicas": 2, "num_cpus": 0.5},
           "kv_cache": {"block_size": 16, "num_blocks": 256}, "kv_transfer": {"timeout_s": 10}}
    return parse_config(raw, where="soak")


# ---- the load, in a process of its own --------------------------------------------------------
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


def wrong_tokens(cluster: LocalCluster, greedy: list[tuple[list[int], int, list[int]]]) -> list[dict]:
    """Each greedy request whose tokens are not what an engine of the cluster's config produces."""
    engine = LLMEngine(cluster.cfg.engine_config(cluster.cfg.decode))
    wrong = []
    for start in range(0, len(greedy), 16):  # 16 at a time: no preemption in the reference
        batch = greedy[start:start + 16]
        for i, (prompt, max_tokens, _) in enumerate(batch):
            engine.add_request(f"ref-{start + i}", prompt_token_ids=prompt,
                               sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        reference: dict[str, list[int]] = collections.defaultdict(list)
        while engine.has_unfinished():
            for out in engine.step():
                reference[out.request_id] += out.token_ids
        wrong += [{"prompt": prompt, "max_tokens": max_tokens, "got": got, "reference": reference[f"ref-{start + i}"]}
                  for i, (prompt, max_tokens, got) in enumerate(batch) if got != reference[f"ref-{start + i}"]]
    return wrong


# ---- the sampler, in the router's process -----------------------------------------------------
def rss_sample(cluster: LocalCluster) -> dict[str, float]:
    """MB resident (Linux /proc): this process (the router's) and every ready worker actor,
    each read in its own process."""
    def rss_mb(actor=None) -> float:  # a closure, so Ray pickles it by value: workers need not import this
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    views = cluster.call(_ready_views(cluster), 10)
    sizes = ray.get([v.actor.__ray_call__.remote(rss_mb) for v in views], timeout=60)
    return {"router": rss_mb()} | {v.name: mb for v, mb in zip(views, sizes, strict=True)}


@dataclass(frozen=True)
class SoakOptions:
    minutes: float = 1.0
    sample_s: float = 60.0  # the warm-up, then the sampling period
    concurrency: int = 4
    seed: int = 0


def drive(cluster: LocalCluster, opts: SoakOptions) -> tuple[dict, dict[str, list[float]]]:
    """The load for opts.minutes in a spawned process; RSS sampled after the warm-up and every
    sample_s, on the load's clock (from when it connected)."""
    seconds = opts.minutes * 60
    ctx = multiprocessing.get_context("spawn")
    results, started = ctx.Queue(), ctx.Event()
    target = Target(cluster.address, cluster.http_url, Path(cluster.cfg.model.path).name)
    load = ctx.Process(target=_load_process, args=(target, seconds, opts.concurrency, opts.seed, started, results))
    samples: dict[str, list[float]] = collections.defaultdict(list)
    load.start()
    try:
        if not started.wait(LOAD_START_S):  # the spawned process imports torch, Ray and gRPC first
            raise TimeoutError(f"the load process did not connect within {LOAD_START_S:.0f} s")
        t0 = time.monotonic()
        at = opts.sample_s
        while at <= seconds + 1e-6:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            for proc, mb in rss_sample(cluster).items():
                samples[proc].append(round(mb, 1))
            at += opts.sample_s
        tally = _result(load, results, t0 + seconds + REQUEST_TIMEOUT_S + 30)
    finally:
        load.join(30)
        if load.is_alive():
            load.kill()
    return tally, dict(samples)


def _result(load, results, deadline: float) -> dict:
    """The load's tally, once its last request ended; an error at once if the process died."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not load.is_alive():
                raise RuntimeError(f"the load process died (exit code {load.exitcode})") from None
            if time.monotonic() > deadline:
                raise TimeoutError("the load did not end by its deadline") from None


def run(model_dir: str, opts: SoakOptions) -> dict:
    """The whole soak against a fresh cluster (Ray must be initialized or is started by it)."""
    with LocalCluster(cluster_config(model_dir), start_timeout_s=START_TIMEOUT_S) as cluster:
        return soak(cluster, opts)


def soak(cluster: LocalCluster, opts: SoakOptions) -> dict:
    """The load, the samples, then the pools and block accounting once it drained: the report."""
    tally, samples = drive(cluster, opts)
    greedy = tally.pop("greedy")
    wrong = wrong_tokens(cluster, greedy)
    ended = ChaosReport(pools_target=dict(cluster.router.pools.targets))
    settle(cluster, ended, ChaosOptions(heal_timeout_s=30, drain_timeout_s=15))
    growth = {p: round(s[-1] - s[0], 1) for p, s in samples.items()}
    doc = {"minutes": opts.minutes, "sample_s": opts.sample_s, "concurrency": opts.concurrency,
           "samples": samples, "rss_growth_mb": growth,
           "rss_growth_pct": {p: round(100 * growth[p] / s[0], 2) for p, s in samples.items()},
           **tally, "tokens_checked": len(greedy), "tokens_wrong": wrong, "leaked_blocks": ended.leaked_blocks, "integrity_errors": ended.integrity_errors,
           "pools_at_end": ended.pools_at_end}
    missed = missed_targets(doc, ended.pools_target)
    return doc | {"targets_met": not missed, "missed_targets": missed}


def missed_targets(doc: dict, pools_target: dict[str, int]) -> list[str]:
    grown = {p: pct for p, pct in doc["rss_growth_pct"].items() if pct > GROWTH_PCT}
    checks = [(not grown, f"RSS grew over {GROWTH_PCT}% after the warm-up: {grown}"),
              (doc["completed"] > 0, "no request completed"),
              (not any(doc["leaked_blocks"].values()), f"leaked blocks {doc['leaked_blocks']}"),
              (not doc["integrity_errors"], f"KV integrity errors {doc['integrity_errors']}"),
              (not doc["unexpected_errors"], f"unexpected errors {doc['unexpected_errors']}"),
              (doc["tokens_checked"] > 0, "no greedy request's tokens were checked"),
              (not doc["tokens_wrong"], f"{len(doc['tokens_wrong'])} of {doc['tokens_checked']} greedy requests' "
                                        "tokens differ from the reference"),
              (doc["pools_at_end"] == pools_target, f"pools {doc['pools_at_end']} != {pools_target}")]
    return [why for ok, why in checks if not ok]


def summary(doc: dict) -> str:
    lines = [f"{doc['minutes']} min, {doc['sent']} sent: {doc['completed']} completed, {doc['cancelled']} cancelled, "
             f"errors {doc['errors_by_status']}, unexpected {doc['unexpected_errors'] or 'none'}; "
             f"{doc['tokens_checked']} greedy requests checked, {len(doc['tokens_wrong'])} wrong"]
    lines += [f"{p:12} RSS {s[0]:.1f} -> {s[-1]:.1f} MB ({doc['rss_growth_pct'][p]:+.2f}%)"
              for p, s in doc["samples"].items()]
    lines.append(f"leaked blocks {doc['leaked_blocks']}; pools at end {doc['pools_at_end']}")
    lines.append("targets met" if doc["targets_met"] else "targets missed: " + "; ".join(doc["missed_targets"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stress.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="minutes of load (fractions allowed)")
    ap.add_argument("--sample-s", type=float, default=60.0, help="warm-up, then RSS sampling period, seconds")
    ap.add_argument("--concurrency", type=int, default=4, help="clients, each with one request at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="checkpoint directory (default: a fresh tiny llama)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.sample_s <= 0 or args.concurrency < 1:
        ap.error("--minutes and --sample-s must be > 0, --concurrency >= 1")
    if args.sample_s * 2 > args.minutes * 60 + 1e-6:
        ap.error(f"--minutes {args.minutes} leaves fewer than two samples {args.sample_s} s apart")
    opts = SoakOptions(args.minutes, args.sample_s, args.concurrency, args.seed)
    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
            model = args.model or str(make_tiny_model(os.path.join(tmp, "tiny"), arch="llama", size="tiny", seed=0))
            doc = run(model, opts)
    finally:
        ray.shutdown()
    print(json.dumps(doc) if args.json else summary(doc))
    return 0 if doc["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
