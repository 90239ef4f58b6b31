"""A good client's TTFT, and the router's memory, under each hostile-client attack (issues 23, 46).

Starts a 1 + 1 cluster with the OpenAI door (the router runs in this process, so this process's
RSS is the router's: the attackers run in a process of their own). Measures a short chat's
client-side TTFT (streamed, time to the first content event), one request at a time, while idle,
then under each attack of stress/hostile_attacks.py in turn (`--attacks`, default all):
bodies (maximal chat bodies), slots (an early reply, then one byte and silence), memory
(`--memory-clients` maximal token-id bodies at once) and nonreading (`--nonreading-clients`
streams nobody reads).
For each: the good TTFT median against idle (target: at most 2x), good requests refused
(target: 0), what the attackers got, and the router's peak RSS during it (target under the
memory attack: at most 1 GiB). `--json` prints it all as one JSON object.

The attackers' process runs at nice 19 (`--attacker-nice`), standing for other machines: what
the figure measures is the server's own cost of the attack, not the attackers' cost of making it.

    python -m stress.hostile [--model DIR] [--attacks bodies,slots,memory,nonreading]
        [--clients 50] [--memory-clients 500] [--nonreading-clients 10] [--samples 20]
        [--attacker-nice 19] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import threading
import time

import httpx2

from checkpoints.gguf import SMOLLM2_OUT_DIR
from router.config.loader import parse_config
from router.launch import LocalCluster
from stress import hostile_attacks

GOOD = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 2, "temperature": 0,
        "stream": True}
SETTLE_S = 4.0  # the attack is under way before the good client measures


class PeakRss:
    """This process's resident memory, sampled every 20 ms; `peak()` since the last `reset()`."""

    def __init__(self) -> None:
        self._peak, self._stop = 0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._peak = max(self._peak, self.now())

    def reset(self) -> None:
        self._peak = self.now()

    def peak(self) -> int:
        return self._peak


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what Python knows of the machine."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


async def good_ttft_ms(http: httpx2.AsyncClient, url: str) -> float | None:
    """The TTFT of one good streamed chat; None when it was refused or failed."""
    t0, ttft = time.perf_counter(), None
    try:
        async with http.stream("POST", f"{url}/chat/completions", json=GOOD, timeout=120) as reply:
            if reply.status_code != 200:
                return None
            async for line in reply.aiter_lines():  # the whole stream, timing its first event
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - t0
    except httpx2.TransportError:
        return None
    return None if ttft is None else ttft * 1e3


async def sample(url: str, n: int) -> list[float | None]:
    async with httpx2.AsyncClient() as http:  # a fresh connection: an attack may have spent the others
        return [await good_ttft_ms(http, url) for _ in range(n)]


def attackers(attack: str, url: str, max_prompt_bytes: int, clients: int, seconds: float, stream_tokens: int,
              niceness: int, results) -> None:
    """In a process of its own (the router's process must not pay for the attackers' work)."""
    os.nice(niceness)
    results.put(asyncio.run(hostile_attacks.run(attack, url, max_prompt_bytes, clients, seconds, stream_tokens)))


async def under_attack(attack: str, url: str, args, cfg, model_len: int, idle_ms: float, rss: PeakRss) -> dict:
    clients = {"memory": args.memory_clients, "nonreading": args.nonreading_clients}.get(attack, args.clients)
    stream_tokens = min(2000, model_len - 8)
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    seconds = SETTLE_S + args.samples * 3 * idle_ms / 1e3 + 10.0
    process = spawn.Process(target=attackers, args=(attack, url, cfg.router.max_prompt_bytes, clients, seconds,
                                                    stream_tokens, args.attacker_nice, results))
    rss.reset()
    process.start()
    await asyncio.sleep(SETTLE_S)
    loaded = await sample(url, args.samples)
    outcomes = await asyncio.to_thread(results.get, True, seconds + 300)
    process.join(30)
    good = [t for t in loaded if t is not None]
    median = statistics.median(good) if good else float("nan")
    return {"clients": clients, "good_ttft_ms_median": round(median, 2), "ratio": round(median / idle_ms, 2),
            "good_refused": len(loaded) - len(good), "router_peak_rss_mib": round(rss.peak() / 2**20, 1),
            "attacker_outcomes": outcomes}


async def measure(url: str, args, cfg, model_len: int) -> dict:
    rss = PeakRss()
    await sample(url, 3)  # warm-up: connections, KV channels
    rss.reset()
    idle = [t for t in await sample(url, args.samples) if t is not None]
    idle_ms = statistics.median(idle)
    r = cfg.router
    figures = {"cpu": cpu_name(), "samples": args.samples,
               "attacker_nice": args.attacker_nice, "idle_ttft_ms_median": round(idle_ms, 2),
               "idle_router_rss_mib": round(rss.peak() / 2**20, 1),
               "config": {"max_body_bytes_in_flight": r.max_body_bytes_in_flight, "max_connections": r.max_connections,
                          "read_timeout_s": r.read_timeout_s, "write_timeout_s": r.write_timeout_s,
                          "max_concurrent_calls": r.max_concurrent_calls,
                          "max_connections_per_address": r.max_connections_per_address,
                          "attackers_per_address": hostile_attacks.ATTACKERS_PER_ADDRESS}, "attacks": {}}
    for attack in args.attacks:
        figures["attacks"][attack] = await under_attack(attack, url, args, cfg, model_len, idle_ms, rss)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2_OUT_DIR))
    parser.add_argument("--attacks", type=lambda s: s.split(","), default=list(hostile_attacks.ATTACKS))
    parser.add_argument("--clients", type=int, default=50, help="hostile clients of each attack but memory")
    parser.add_argument("--memory-clients", type=int, default=500, help="maximal bodies at once (memory)")
    parser.add_argument("--nonreading-clients", type=int, default=10, help="streams nobody reads (nonreading)")
    parser.add_argument("--samples", type=int, default=20, help="good requests measured idle and per attack")
    parser.add_argument("--attacker-nice", type=int, default=19,
                        help="the attackers' process's nice value (default 19: they stand for other machines)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    unknown = set(args.attacks) - set(hostile_attacks.ATTACKS)
    if unknown:
        parser.error(f"--attacks: unknown {sorted(unknown)}; choose from {','.join(hostile_attacks.ATTACKS)}")
    cfg = parse_config({"model": {"path": args.model}, "router": {"port": 0, "http_port": 0},
                        "prefill": {"replicas": 1, "num_cpus": 0.5}, "decode": {"replicas": 1, "num_cpus": 0.5},
                        "kv_cache": {"num_blocks": 512}})
    with LocalCluster(cfg) as cluster:
        figures = asyncio.run(measure(cluster.http_url, args, cfg, cluster.router.validator.max_model_len))
    if args.json:
        print(json.dumps(figures))
        return
    print(f"good chat TTFT idle: {figures['idle_ttft_ms_median']:.1f} ms (median of {args.samples}); router RSS "
          f"{figures['idle_router_rss_mib']} MiB")
    for attack, f in figures["attacks"].items():
        print(f"{attack:>10}: {f['clients']} clients: TTFT {f['good_ttft_ms_median']:.1f} ms = {f['ratio']:.2f}x idle "
              f"(target <= 2x), {f['good_refused']} good refused, router peak RSS {f['router_peak_rss_mib']} MiB; "
              f"attackers got {f['attacker_outcomes']}")


if __name__ == "__main__":
    main()
