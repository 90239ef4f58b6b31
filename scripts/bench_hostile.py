"""A good request's TTFT while hostile clients keep maximal chat bodies in flight (issue 23, item 2).

Starts a 1 + 1 cluster with the OpenAI door, measures a short chat's client-side TTFT (streamed,
time to the first content event) one request at a time while idle, then again while `--hostile`
clients each keep one maximal chat body in flight (router.max_prompt_bytes of text over the most
messages a chat may have, sent again as soon as it is answered). Prints both medians, their ratio
(the target: at most 2), and what the hostile bodies got; `--json` prints the figures as JSON.

The attackers run in a process of their own on this host, where a real attack comes from other
machines: by default that process runs at nice 19 (`--attacker-nice`), so what the figure measures
is the server's own cost of the hostile bodies (reading, parsing, rendering, tokenizing, refusing),
not the attackers' cost of making them; `--attacker-nice 0` lets them compete for the cores as equals.

    python -m scripts.bench_hostile [--hostile 50] [--samples 20] [--attacker-nice 19] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import statistics
import time

import httpx2

from checkpoints.gguf import SMOLLM2_OUT_DIR
from protocol.limits import MAX_CHAT_MESSAGES
from router.config.loader import parse_config
from router.launch import LocalCluster

GOOD = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 2, "temperature": 0,
        "stream": True}


def hostile_body(max_prompt_bytes: int) -> bytes:
    """The largest chat the router accepts to look at: every message it allows, all the text it allows."""
    per_message = max_prompt_bytes // MAX_CHAT_MESSAGES
    messages = [{"role": ("user", "assistant")[i % 2], "content": "lorem ipsum " * (per_message // 12)}
                for i in range(MAX_CHAT_MESSAGES - 1)] + [{"role": "user", "content": "go"}]
    return json.dumps({"messages": messages, "max_tokens": 1}).encode()


async def good_ttft_ms(http: httpx2.AsyncClient, url: str) -> float:
    t0, ttft = time.perf_counter(), None
    async with http.stream("POST", f"{url}/chat/completions", json=GOOD, timeout=120) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():  # the whole stream, timing its first event
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - t0
    return ttft * 1e3


async def sample(http: httpx2.AsyncClient, url: str, n: int) -> list[float]:
    return [await good_ttft_ms(http, url) for _ in range(n)]


async def hostile(url: str, body: bytes, until: float, outcomes: collections.Counter) -> None:
    async with httpx2.AsyncClient(timeout=120) as http:
        while time.monotonic() < until:
            try:
                reply = await http.post(f"{url}/chat/completions", content=body,
                                        headers={"content-type": "application/json"})
                outcomes[str(reply.status_code)] += 1
            except httpx2.TransportError as e:
                outcomes[type(e).__name__] += 1


def flood(url: str, body: bytes, clients: int, seconds: float, niceness: int, results) -> None:
    """In a process of its own (the router's process must not pay for the attackers' uploads)."""
    os.nice(niceness)
    async def run() -> collections.Counter:
        outcomes: collections.Counter = collections.Counter()
        until = time.monotonic() + seconds
        await asyncio.gather(*(hostile(url, body, until, outcomes) for _ in range(clients)))
        return outcomes
    results.put(dict(asyncio.run(run())))


async def measure(url: str, max_prompt_bytes: int, hostile_clients: int, samples: int, niceness: int) -> dict:
    body = hostile_body(max_prompt_bytes)
    async with httpx2.AsyncClient() as http:
        await sample(http, url, 3)  # warm-up: connections, KV channels
        idle = await sample(http, url, samples)
        started = time.monotonic()
        results = multiprocessing.get_context("spawn").Queue()
        attackers = multiprocessing.get_context("spawn").Process(
            target=flood, args=(url, body, hostile_clients, 4.0 + samples * 3 * max(idle) / 1e3, niceness, results))
        attackers.start()
        await asyncio.sleep(4.0)  # every hostile client has a body in flight
        loaded = await sample(http, url, samples)
        outcomes = await asyncio.to_thread(results.get, True, max(120.0, time.monotonic() - started + 120))
        attackers.join(30)
    idle_ms, loaded_ms = statistics.median(idle), statistics.median(loaded)
    return {"hostile_clients": hostile_clients, "hostile_body_bytes": len(body), "samples": samples,
            "attacker_nice": niceness,
            "idle_ttft_ms_median": round(idle_ms, 2), "loaded_ttft_ms_median": round(loaded_ms, 2),
            "loaded_ttft_ms_max": round(max(loaded), 2), "ratio": round(loaded_ms / idle_ms, 2),
            "hostile_outcomes": dict(outcomes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2_OUT_DIR))
    parser.add_argument("--hostile", type=int, default=50, help="hostile clients, each with one body in flight")
    parser.add_argument("--samples", type=int, default=20, help="good requests measured idle and under load")
    parser.add_argument("--attacker-nice", type=int, default=19,
                        help="the attackers' process's nice value (default 19: they stand for other machines)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cfg = parse_config({"model": {"path": args.model}, "router": {"port": 0, "http_port": 0},
                        "prefill": {"replicas": 1, "num_cpus": 0.5}, "decode": {"replicas": 1, "num_cpus": 0.5},
                        "kv_cache": {"num_blocks": 512}})
    with LocalCluster(cfg) as cluster:
        figures = asyncio.run(measure(cluster.http_url, cfg.router.max_prompt_bytes, args.hostile, args.samples,
                                     args.attacker_nice))
    if args.json:
        print(json.dumps(figures))
        return
    print(f"good chat TTFT, median of {figures['samples']}: idle {figures['idle_ttft_ms_median']:.1f} ms, with "
          f"{figures['hostile_clients']} hostile {figures['hostile_body_bytes']}-byte chat bodies in flight "
          f"{figures['loaded_ttft_ms_median']:.1f} ms (max {figures['loaded_ttft_ms_max']:.1f} ms): "
          f"{figures['ratio']:.2f}x idle (target: at most 2x)")
    print(f"hostile bodies answered: {figures['hostile_outcomes']}")


if __name__ == "__main__":
    main()
