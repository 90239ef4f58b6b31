"""Idle TTFT on two clusters side by side, for `bench/cluster_overhead.py`: one request at a time,
alternating which cluster goes first, so a shared machine's drift falls on both alike. Two uses:
what token authentication adds (`--compare-auth`), and what router.prefill_during_reserve takes
off (`--compare-early-prefill`). Also the single-request TTFT probe and the warm-up both
benches share."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import ray

from bench.client import replay
from bench.workload import RequestSpec, make_workload
from client.credentials import Target
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.config.schema import ClusterConfig
from router.frontdoor.access import Gate, Need
from router.launch import LocalCluster


async def one_ttft(stub: pb_grpc.GenerationStub, prompt: list[int], metadata=()) -> dict:
    request = pb.GenerateRequest(prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    t0 = time.perf_counter()
    first, last = None, None
    async for message in stub.Generate(request, timeout=60, metadata=metadata):
        if first is None and message.token_ids:
            first = time.perf_counter() - t0
        last = message
    u = last.usage
    return {"client_ttft_ms": first * 1e3, "router_ttft_ms": u.ttft_ms, "queue_ms": u.queue_ms,
            "prefill_ms": u.prefill_ms, "kv_transfer_ms": u.kv_transfer_ms,
            "prefill_queue_ms": u.prefill_queue_ms, "prefill_compute_ms": u.prefill_compute_ms}


async def warm_up(address: str | Target, specs: list[RequestSpec]) -> None:
    """Opens the KV channels and the gRPC connection; first calls pay one-off costs."""
    short = [RequestSpec(f"warm-{s.request_id}", 0.0, s.prompt_token_ids[:16], 4) for s in specs]
    await replay(address, make_workload("warm-up", short, None, {}), "warm-up", show_progress=False)


TARGET_AUTH_MS = 1.0
BENCH_TOKEN = "bench-cluster-token-0123456789"


async def alternating_ttfts(targets: list[Target], prompts: list[list[int]]) -> list[list[float]]:
    """Client TTFT (ms) of each prompt on each target, one request at a time, alternating who goes first."""
    channels = [t.aio_channel() for t in targets]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    out: list[list[float]] = [[] for _ in targets]
    try:
        for i, prompt in enumerate(prompts):
            order = range(len(targets)) if i % 2 == 0 else reversed(range(len(targets)))
            for k in order:
                out[k].append((await one_ttft(stubs[k], prompt, targets[k].metadata))["client_ttft_ms"])
    finally:
        for channel in channels:
            await channel.close()
    return out


def gate_cost_us(tokens_file: str, calls: int = 20000) -> float:
    """One allowed token check in-process: what the gRPC interceptor adds on top of its call."""
    gate, header = Gate(tokens_file), f"Bearer {BENCH_TOKEN}"
    t0 = time.perf_counter()
    for _ in range(calls):
        gate.check(Need.TRAFFIC, header)
    return (time.perf_counter() - t0) / calls * 1e6


def two_clusters(cfg_a: ClusterConfig, cfg_b: ClusterConfig, specs: list[RequestSpec], prompts: list[list[int]],
                 token_b: str | None = None) -> tuple[list[float], list[float]]:
    """Client TTFTs (ms) of the prompts on two clusters side by side, alternating who goes first."""
    needed = 2 * (cfg_a.prefill.replicas * cfg_a.prefill.num_cpus + cfg_a.decode.replicas * cfg_a.decode.num_cpus)
    ray.init(num_cpus=max(4, int(needed)), include_dashboard=False, object_store_memory=128 << 20,
             log_to_driver=False)
    try:
        with LocalCluster(cfg_a) as a, LocalCluster(cfg_b) as b:
            targets = [Target(a.address), Target(b.address, token_b)]
            for target in targets:
                asyncio.run(warm_up(target, specs[:8]))
            a_ms, b_ms = asyncio.run(alternating_ttfts(targets, prompts))
    finally:
        ray.shutdown()
    return a_ms, b_ms


def compare_early_prefill(cfg: ClusterConfig, specs: list[RequestSpec], prompts: list[list[int]]) -> dict:
    """router.prefill_during_reserve off vs on (the prefill sent with the reservation in flight)."""
    after = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, prefill_during_reserve=False))
    after_ms, during_ms = two_clusters(after, cfg, specs, prompts)
    return {"samples": len(prompts), "after_reserve_ms": statistics.median(after_ms),
            "during_reserve_ms": statistics.median(during_ms),
            "difference_ms": statistics.median(b - a for a, b in zip(after_ms, during_ms, strict=True))}


def compare_auth(cfg: ClusterConfig, specs: list[RequestSpec], prompts: list[list[int]]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tokens = Path(d) / "tokens.txt"
        tokens.write_text(BENCH_TOKEN + "\n")
        with_auth = dataclasses.replace(cfg, router=dataclasses.replace(
            cfg.router, auth=dataclasses.replace(cfg.router.auth, tokens_file=str(tokens))))
        off_ms, on_ms = two_clusters(cfg, with_auth, specs, prompts, token_b=BENCH_TOKEN)
        gate_us = gate_cost_us(str(tokens))
    diffs = [b - a for a, b in zip(off_ms, on_ms, strict=True)]
    return {"samples": len(prompts), "off_ms": statistics.median(off_ms), "on_ms": statistics.median(on_ms),
            "difference_ms": statistics.median(diffs), "p90_off_ms": _p90(off_ms), "p90_on_ms": _p90(on_ms),
            "gate_us": gate_us, "target_ms": TARGET_AUTH_MS}


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def print_auth(r: dict) -> None:
    print(f"idle TTFT, token authentication off vs on, {r['samples']} single requests to each (alternating), "
          f"medians in ms:")
    print(f"{'auth off (p90)':48}{r['off_ms']:8.2f} ({r['p90_off_ms']:.2f})")
    print(f"{'auth on, router.auth.tokens_file (p90)':48}{r['on_ms']:8.2f} ({r['p90_on_ms']:.2f})")
    worst = max(r["difference_ms"], r["on_ms"] - r["off_ms"])
    verdict = "met" if worst <= r["target_ms"] else "missed"
    print(f"{'on - off, median of per-prompt differences':48}{r['difference_ms']:8.2f}")
    print(f"{'on - off, difference of the medians':48}{r['on_ms'] - r['off_ms']:8.2f}   target <= "
          f"{r['target_ms']:g} ms: {verdict}")
    print(f"{'the gate alone, one allowed check (us)':48}{r['gate_us']:8.2f}")
