"""Cluster overhead: the same requests through the engine alone and through a whole cluster.

On the tiny model, in one run: (a) `LLMEngine` in this process serves N requests submitted at
once (`ignore_eos`, exact lengths) -> output tok/s; (b) the same requests, all sent at once
over gRPC to a `LocalCluster` (router + Ray pools + KV channels) -> output tok/s, and the
ratio cluster / engine (target >= 0.8); (c) on the idle cluster, K single requests one at a
time: client TTFT minus the prefill time of the engine alone, in a process of its own (a Ray
actor with no cluster around it, like a worker's), for the same prompt, measured just before it
(side by side: a shared machine's load drifts on both alike; target median <= 10 ms, JSON key
`idle_ttft_overhead_ms`), split with the router's own Usage timings (queue, prefill, TTFT) into
gRPC, router + Ray, and worker-side overhead, the latter into waiting for the engine thread, the
worker's step wall time over the reference prefill, and the return. Two more figures say how far
to trust that: the same prefill in a second, identical reference process (two identical engines
differ by this much: on a shared 2-core host, tens of ms on a real model's 0.5-1 s prefill), and
the time outside the forward passes (client TTFT - the worker's own step time), which holds the
cluster's fixed costs without the compute noise. The same engine's prefill in this process is
shown too: it shares the process (and its GIL) with the router's threads, which makes it slower
than a worker's, so it is not the reference.

`--compare-early-prefill` measures instead what router.prefill_during_reserve takes off idle
TTFT: the same two-cluster, alternating method as `--compare-auth`.

`--compare-auth` measures instead what token authentication (router.auth) adds to idle TTFT:
two clusters of the same config side by side, one with a tokens file, K single requests sent to
each in turn (the order alternating per prompt, so drift and noise fall on both alike), and the
median of the per-prompt differences; plus the gate's own cost per call, in-process.

Equal CPU footing per engine: workers run with `torch_threads` 1 (the pool default), so the
in-process engine also gets one torch thread (`torch.set_num_threads(1)`); both use the
scheduler and KV pool of `cfg.engine_config(cfg.decode)`. Disaggregated, the prefill and the
decode engine can run on two cores at once; the client and the router share this process.

    python -m bench.cluster_overhead [--requests 64] [--mode colocated] [--prefill 1 --decode 1] [--json]
    python -m bench.cluster_overhead --compare-auth [--ttft-samples 60] [--json]
    python -m bench.cluster_overhead --compare-early-prefill [--ttft-samples 60] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpc  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from bench.client import replay  # noqa: E402
from bench.metrics import Slo, summarize_run  # noqa: E402
from bench.pairs import compare_auth, compare_early_prefill, one_ttft, print_auth, warm_up  # noqa: E402
from bench.workload import RequestSpec, make_workload  # noqa: E402
from checkpoints.tiny import ensure_model  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from proto import pdserve_pb2_grpc as pb_grpc  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402
from router.config.loader import parse_config  # noqa: E402
from router.config.schema import ClusterConfig  # noqa: E402
from router.launch import LocalCluster  # noqa: E402

TARGET_RATIO, TARGET_TTFT_OVERHEAD_MS = 0.8, 10.0
FIRST_TOKEN_ID = 3  # ids 0-2 are the tiny tokenizer's special tokens


def make_specs(n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
               vocab: int) -> list[RequestSpec]:
    """n requests, all arriving at 0: random prompts and exact output lengths, seeded."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        prompt = tuple(rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(rng.randint(*prompt_range)))
        specs.append(RequestSpec(f"r{i:04d}", 0.0, prompt, rng.randint(*output_range)))
    return specs


def cluster_config(args: argparse.Namespace, model: str) -> ClusterConfig:
    """1+1 disaggregated by default; port 0 lets the router pick a free port."""
    prefill = args.prefill if args.mode == "disaggregated" else 0
    return parse_config({
        "model": {"path": model}, "mode": args.mode,
        "router": {"host": "127.0.0.1", "port": 0, "metrics_port": None,
                   "prefill_during_reserve": not args.prefill_after_reserve},
        "prefill": {"replicas": prefill, "num_cpus": 1, "torch_threads": 1},
        "decode": {"replicas": args.decode, "num_cpus": 1, "torch_threads": 1},
        "kv_cache": {"block_size": 16, "num_blocks": args.num_blocks},
    }, where="bench_cluster")


# ---- (a) and the TTFT reference: the engine alone, in this process --------------------------
def engine_throughput(engine: LLMEngine, specs: list[RequestSpec]) -> dict:
    engine.generate([list(specs[0].prompt_token_ids)], SamplingParams(max_tokens=2, ignore_eos=True))  # warm
    t0 = time.perf_counter()
    for spec in specs:
        engine.add_request(f"tp-{spec.request_id}", prompt_token_ids=list(spec.prompt_token_ids),
                           sampling=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True))
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
    wall = time.perf_counter() - t0
    return {"output_tokens": produced, "seconds": wall, "tok_per_s": produced / wall}


def engine_prefill_s(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    """Idle engine: add_request to the first output of `rid` (then run it to the end)."""
    assert not engine.has_unfinished(), "the TTFT reference needs an idle engine"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        outputs = engine.step()
        if first is None and any(o.request_id == rid and o.token_ids for o in outputs):
            first = time.perf_counter() - t0
    assert first is not None, f"{rid} finished without a token"
    return first


# ---- (b) and (c): the cluster over gRPC ---------------------------------------------------
async def cluster_throughput(address: str, specs: list[RequestSpec]) -> dict:
    records = await replay(address, make_workload("cluster-overhead", specs, None, {}), "cluster",
                           show_progress=False)
    s = summarize_run(records, Slo())
    return {"output_tokens": s["output_tokens"], "seconds": s["wall_s"],
            "tok_per_s": s["output_tok_per_s"], "errors": s["num_errors"],
            "ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"],
            "errors_sample": [r.error for r in records if r.error][:3]}


@ray.remote
class ReferenceEngine:
    """The engine alone in a process of its own, like a worker's but with no cluster around it:
    the idle-TTFT reference. (An engine in the bench process shares it, and its GIL, with the
    router's threads, which slows its Python-heavy steps: too generous a reference.)"""

    def __init__(self, config) -> None:
        torch.set_num_threads(config.torch_threads or 1)
        self.engine = LLMEngine(config)
        self.calls = 0

    def prefill_ms(self, prompt: list[int]) -> float:
        self.calls += 1
        return 1e3 * engine_prefill_s(self.engine, f"ref-{self.calls}", prompt)


async def cluster_ttfts(address: str, prompts: list[list[int]], engine: LLMEngine, reference, twin) -> list[dict]:
    """One request at a time: client TTFT (ms) and the last message's Usage, per prompt, each
    right after the reference engine's prefill of the same prompt in its own process
    (`engine_prefill_ms`), in a second identical process (`twin_prefill_ms`: how far two
    identical engines differ, the resolution of the overhead) and in this one
    (`in_process_prefill_ms`): side by side, so the load of a shared machine drifts on all alike."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        # warm: first calls pay one-off costs
        await asyncio.gather(reference.prefill_ms.remote(prompts[0]), twin.prefill_ms.remote(prompts[0]))
        out = []
        for i, prompt in enumerate(prompts):
            own_ms = await reference.prefill_ms.remote(prompt)
            twin_ms = await twin.prefill_ms.remote(prompt)
            here_ms = 1e3 * engine_prefill_s(engine, f"ttft-{i}", prompt)
            out.append(await one_ttft(stub, prompt) | {"engine_prefill_ms": own_ms, "twin_prefill_ms": twin_ms,
                                                        "in_process_prefill_ms": here_ms})
        return out


# ---- the report ----------------------------------------------------------------------------
def ttft_breakdown(engine_ms: list[float], cluster: list[dict], colocated: bool) -> dict:
    """Medians over the K requests; `overhead` is the median of per-request differences."""
    def med(key: str) -> float:
        return statistics.median(c[key] for c in cluster)

    diffs = [c["client_ttft_ms"] - e for c, e in zip(cluster, engine_ms, strict=True)]
    worker = [c["prefill_ms"] - e for c, e in zip(cluster, engine_ms, strict=True)]
    twins = [c["twin_prefill_ms"] - e for c, e in zip(cluster, engine_ms, strict=True)]
    out = {"samples": len(cluster), "client_ttft_ms": med("client_ttft_ms"),
           "engine_prefill_ms": statistics.median(engine_ms), "overhead_ms": statistics.median(diffs),
           # two identical engines in processes of their own: the overhead cannot be read finer than this
           "twin_difference_ms": statistics.median(twins),
           "twin_abs_difference_ms": statistics.median(abs(d) for d in twins),
           "in_process_prefill_ms": med("in_process_prefill_ms"),
           "router_ttft_ms": med("router_ttft_ms"), "queue_ms": med("queue_ms"),
           "kv_transfer_ms": None if colocated else med("kv_transfer_ms"),
           "grpc_and_client_ms": statistics.median(c["client_ttft_ms"] - c["router_ttft_ms"] for c in cluster)}
    if colocated:  # no separate prefill call: router + Ray + worker loop are one figure
        router = [c["router_ttft_ms"] - e for c, e in zip(cluster, engine_ms, strict=True)]
        out |= {"prefill_ms": None, "worker_overhead_ms": None, "router_and_ray_ms": statistics.median(router)}
    else:
        out |= {"prefill_ms": med("prefill_ms"), "worker_overhead_ms": statistics.median(worker),
                "worker_queue_ms": med("prefill_queue_ms"),  # arrival -> its first step (engine thread's pickup)
                "worker_compute_over_engine_ms": statistics.median(  # its steps' wall time vs in-process
                    c["prefill_compute_ms"] - e for c, e in zip(cluster, engine_ms, strict=True)),
                "worker_after_token_ms": statistics.median(  # first token -> the prefill call returns
                    c["prefill_ms"] - c["prefill_queue_ms"] - c["prefill_compute_ms"] for c in cluster),
                "router_and_ray_ms": statistics.median(c["router_ttft_ms"] - c["queue_ms"] - c["prefill_ms"]
                                                       for c in cluster),
                # what the cluster adds outside the forward passes: client TTFT - the worker's own steps
                "outside_forward_ms": statistics.median(c["client_ttft_ms"] - c["prefill_compute_ms"]
                                                        for c in cluster)}
    return out


def print_table(r: dict) -> None:
    shape = (f"{r['prefill']} prefill + {r['decode']} decode" if r["mode"] == "disaggregated"
             else f"{r['decode']} colocated")
    print(f"{r['requests']} requests, prompts {r['prompt']}, outputs {r['output']}, {r['mode']} ({shape}), "
          f"1 torch thread per engine, {os.cpu_count()} CPUs (load average {r['load_average']:.1f}); "
          f"model {r['model']}")
    print(f"{'':28}{'output tok/s':>14}{'seconds':>10}{'tokens':>9}")
    for name, key in (("engine alone (in-process)", "engine"), ("cluster over gRPC", "cluster")):
        row = r[key]
        print(f"{name:28}{row['tok_per_s']:>14.1f}{row['seconds']:>10.2f}{row['output_tokens']:>9}")
    c = r["cluster"]
    print(f"ratio cluster / engine: {r['ratio']:.2f} (target >= {TARGET_RATIO}); under load: TTFT p50 "
          f"{c['ttft_ms']['p50']:.0f} ms, ITL p50 {c['itl_ms']['p50']:.1f} ms p99 {c['itl_ms']['p99']:.1f} ms"
          + (f"; {c['errors']} failed: {c['errors_sample']}" if c["errors"] else ""))
    t = r["ttft"]
    router_row = ("  router + Ray + worker (router TTFT - engine)" if r["mode"] == "colocated"
                  else "  router + Ray (router TTFT - queue - prefill)")
    print(f"\nidle TTFT, {t['samples']} single requests (max_tokens 2), medians in ms:")
    rows = [("client TTFT", t["client_ttft_ms"]), ("engine prefill (own process, reference)", t["engine_prefill_ms"]),
            ("engine prefill (this process, beside the router)", t["in_process_prefill_ms"]),
            ("overhead: client - engine", t["overhead_ms"]),
            ("  (a second engine process - the reference)", t["twin_difference_ms"]),
            ("  (the same, median |difference|)", t["twin_abs_difference_ms"]),
            ("outside the forward: client - worker's steps", t.get("outside_forward_ms")),
            ("  gRPC + client (client - router TTFT)", t["grpc_and_client_ms"]),
            (router_row, t["router_and_ray_ms"]),
            ("  router queue (decode reservation)", t["queue_ms"]),
            ("  worker side (worker prefill - engine)", t["worker_overhead_ms"]),
            ("    before its first step (usage.prefill_queue_ms)", t.get("worker_queue_ms")),
            ("    its steps' wall time - engine prefill", t.get("worker_compute_over_engine_ms")),
            ("    first token -> prefill call returns", t.get("worker_after_token_ms")),
            ("router TTFT (usage.ttft_ms)", t["router_ttft_ms"]),
            ("worker prefill (usage.prefill_ms)", t["prefill_ms"]),
            ("KV transfer, after the first token (usage)", t["kv_transfer_ms"])]
    for name, value in rows:
        print(f"{name:48}{'n/a' if value is None else f'{value:8.2f}':>8}")
    verdict = "met" if t["overhead_ms"] <= TARGET_TTFT_OVERHEAD_MS else "missed"
    print(f"overhead target <= {TARGET_TTFT_OVERHEAD_MS:g} ms: {verdict}")


# ---- main ----------------------------------------------------------------------------------
def _range(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(","))
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW,HIGH with 1 <= LOW <= HIGH")
    return low, high


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=_positive, default=64)
    ap.add_argument("--prompt", type=_range, default=(16, 256), help="prompt length range LOW,HIGH")
    ap.add_argument("--output", type=_range, default=(32, 128), help="output length range LOW,HIGH")
    ap.add_argument("--ttft-samples", type=_positive, default=30, help="single requests for the idle TTFT")
    ap.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    ap.add_argument("--prefill", type=_positive, default=1, help="prefill workers (disaggregated)")
    ap.add_argument("--decode", type=_positive, default=1, help="decode workers")
    ap.add_argument("--num-blocks", type=_positive, default=2048, help="KV blocks per engine")
    ap.add_argument("--model", help="checkpoint dir (default: the tiny model, created if absent)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--prefill-after-reserve", action="store_true",
                    help="router.prefill_during_reserve off: each prefill waits for its decode reservation")
    ap.add_argument("--compare-early-prefill", action="store_true",
                    help="idle TTFT with router.prefill_during_reserve off vs on (two clusters, alternating)")
    ap.add_argument("--compare-auth", action="store_true",
                    help="measure what token authentication adds to idle TTFT instead (two clusters, alternating)")
    return ap.parse_args(argv)


def run_engine(cfg: ClusterConfig, specs: list[RequestSpec]) -> tuple[dict, LLMEngine]:
    """The throughput of (a); the engine stays for the idle TTFT's side-by-side reference."""
    torch.set_num_threads(1)  # the workers' torch_threads (LLMEngine sets it too, from the config)
    engine = LLMEngine(cfg.engine_config(cfg.decode))
    return engine_throughput(engine, specs), engine


def run_cluster(cfg: ClusterConfig, specs: list[RequestSpec], prompts: list[list[int]],
                engine: LLMEngine) -> tuple[dict, list[dict]]:
    needed = cfg.prefill.replicas * cfg.prefill.num_cpus + cfg.decode.replicas * cfg.decode.num_cpus
    ray.init(num_cpus=max(4, int(needed)), include_dashboard=False, object_store_memory=128 << 20,
             log_to_driver=False)
    try:
        with LocalCluster(cfg) as cluster:
            asyncio.run(warm_up(cluster.address, specs[:8]))
            throughput = asyncio.run(cluster_throughput(cluster.address, specs))
            engine_cfg = cfg.engine_config(cfg.prefill if cfg.prefill.replicas else cfg.decode)
            reference, twin = (ReferenceEngine.options(num_cpus=0).remote(engine_cfg) for _ in range(2))
            ttfts = asyncio.run(cluster_ttfts(cluster.address, prompts, engine, reference, twin))
            ray.kill(reference)
            ray.kill(twin)
    finally:
        ray.shutdown()
    return throughput, ttfts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load = os.getloadavg()[0]  # other work on the machine skews both sides; shown with the table
    model = args.model or str(ensure_model(Path(tempfile.gettempdir()) / "pdserve-tiny-llama", size="tiny"))
    cfg = cluster_config(args, model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    specs = make_specs(args.requests, args.seed, args.prompt, args.output, vocab)
    ttft_specs = make_specs(args.ttft_samples, args.seed + 1, args.prompt, (2, 2), vocab)
    prompts = [list(s.prompt_token_ids) for s in ttft_specs]
    if args.compare_early_prefill:
        early = compare_early_prefill(cfg, specs, prompts)
        print(json.dumps(early) if args.json else
              f"idle TTFT, {early['samples']} single requests to each (alternating), medians in ms: prefill after "
              f"the reservation {early['after_reserve_ms']:.2f}, during it {early['during_reserve_ms']:.2f}; "
              f"median per-prompt difference {early['difference_ms']:+.2f}")
        return
    if args.compare_auth:
        auth = compare_auth(cfg, specs, prompts)
        if args.json:
            print(json.dumps(auth))
        else:
            print_auth(auth)
        return
    engine, reference = run_engine(cfg, specs)
    gc.collect()
    cluster, ttfts = run_cluster(cfg, specs, prompts, reference)
    engine_prefill_ms = [t["engine_prefill_ms"] for t in ttfts]
    result = {"model": model, "load_average": load, "mode": args.mode,
              "prefill": cfg.prefill.replicas, "decode": cfg.decode.replicas,
              "requests": args.requests, "prompt": list(args.prompt), "output": list(args.output),
              "engine": engine, "cluster": cluster, "ratio": cluster["tok_per_s"] / engine["tok_per_s"],
              "ttft": ttft_breakdown(engine_prefill_ms, ttfts, args.mode == "colocated")}
    result["idle_ttft_overhead_ms"] = result["ttft"]["overhead_ms"]
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
