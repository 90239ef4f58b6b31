"""`pdserve plan --trace FILE --slo ... --emulate DEVICE:MODEL`: the static arrangement the planner
would choose for a trace, for an operator who does not want autoscaling.

The planner's own sizing (router/autoscale/sizing.py `Sizer`) on its capacity profile from the
emulated device's cost model (router/autoscale/profile.py, source `cost_model`), fed the trace's
busiest `--peak-window` seconds (the highest prompt tokens/s of any window, and its requests/s;
mean prompt and output lengths of the whole trace) as the load to carry, at the planner's
`target_utilization`: decode workers for a disaggregated cluster (its prefill workers by the
replay below), workers for a colocated one (chunked prefill), and the cheaper of the two
(colocated on a tie). The window
(default 30 s) is what a static cluster must carry without queueing past a TTFT SLO of seconds.
A TTFT SLO also needs headroom for how arrivals bunch within seconds, which a 30 s mean hides.
Disaggregated, the prefill pool is sized by replaying the whole trace instead: each prompt goes to
the worker free first (the router places on the least work ahead) and runs there at the profile's
full speed, one prompt on one worker (a long prompt holds its worker while the others go on); the
fewest workers whose replay meets the TTFT SLO for the SLO's percentile of requests. The replay
sees every bunch of the trace, so no utilization headroom is added (on the driver's traces it
predicts the simulated attainment of each P within 1-6 points). Colocated, the prefill capacity is
sized by a fluid queue (the pool's prompt tokens/s at `target_utilization`, first come first
served, each prompt's own prefill added to its wait), with the decode load's share of the workers set aside
and enough workers that the prefill landing on one during a request's decode (chunks of prompts
arriving meanwhile, each step several decode steps long) keeps that request's token gaps within
the ITL SLO at the SLO percentile.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.metrics import Slo
from bench.workload import Workload
from router.autoscale.observation import Observation, PoolObservation, WorkerSample
from router.autoscale.profile import CapacityProfile, CostStepModel
from router.autoscale.sizing import Load, Need, Sizer, ceil_workers
from router.config.emulate import emulated_num_blocks
from router.config.schema import ClusterConfig
from sizing.cost_model import Emulation

PEAK_WINDOW_S = 30.0
MAX_WORKERS = 1024  # the replay's search gives up here (a trace no cluster serves)
GPU_CLUSTER = Path(__file__).resolve().parent.parent / "simulate" / "gpu_cluster.yaml"


def peak_load(workload: Workload, window_s: float = PEAK_WINDOW_S) -> Load:
    """The busiest `window_s` of the workload (by prompt tokens/s, windows starting at each arrival)."""
    reqs = workload.requests
    times = [r.arrival_s for r in reqs]
    span = max(window_s, 1e-9) if times[-1] - times[0] >= window_s else max(times[-1] - times[0], 1.0)
    best, best_n, j, tokens = 0.0, 0, 0, 0
    for i, r in enumerate(reqs):  # a sliding window [t_i, t_i + span)
        while j < len(reqs) and times[j] < times[i] + span:
            tokens += reqs[j].num_prompt_tokens
            j += 1
        if tokens > best:
            best, best_n = tokens, j - i
        tokens -= r.num_prompt_tokens
    prompt = sum(r.num_prompt_tokens for r in reqs) / len(reqs)
    output = sum(r.max_tokens for r in reqs) / len(reqs)
    return Load(best_n / span, best / span, prompt, output)


def replay_ttft_met(workload: Workload, workers: int, profile: CapacityProfile, pool: str, ttft_s: float) -> float:
    """The share of requests whose TTFT meets `ttft_s` when each prompt goes to the worker free
    first and takes its tokens / the profile's prompt tokens/s there, its TTFT the wait plus its
    own prefill time."""
    free_at, met = [0.0] * workers, 0
    for r in workload.requests:
        start = max(heapq.heappop(free_at), r.arrival_s)
        heapq.heappush(free_at, start + r.num_prompt_tokens / profile.prefill_rate(pool, r.num_prompt_tokens))
        met += start - r.arrival_s + profile.prefill_time_s(pool, r.num_prompt_tokens) <= ttft_s
    return met / len(workload.requests)


def _replay_workers(workload: Workload, profile: CapacityProfile, pool: str, auto) -> int:
    """The fewest prefill workers whose replay meets the TTFT SLO for the SLO percentile of requests."""
    n = 1
    while n < MAX_WORKERS and replay_ttft_met(workload, n, profile, pool, auto.ttft_s) < auto.percentile / 100:
        n += 1
    return n


def fluid_ttft_met(workload: Workload, tokens_per_s: float, own_s: list[float], ttft_s: float) -> float:
    """The share of requests whose TTFT meets `ttft_s` when the trace's prompts queue first come
    first served for `tokens_per_s` of prefill capacity (a fluid queue) and each also takes its own
    prefill time `own_s[i]` (one prompt runs on one worker)."""
    free_at, met = -math.inf, 0
    for r, own in zip(workload.requests, own_s, strict=True):
        wait = max(0.0, free_at - r.arrival_s)
        free_at = r.arrival_s + wait + r.num_prompt_tokens / tokens_per_s
        met += wait + own <= ttft_s
    return met / len(workload.requests)


def _fluid_workers(workload: Workload, profile: CapacityProfile, pool: str, auto,
                   tokens_per_s: Callable[[int, float], float]) -> int:
    """The fewest workers whose prefill capacity (`tokens_per_s(n, one worker's prompt tokens/s)`)
    meets the TTFT SLO for the SLO percentile of requests in the fluid replay."""
    prompt = sum(r.num_prompt_tokens for r in workload.requests) / len(workload.requests)
    rate = profile.prefill_rate(pool, prompt)
    own = [profile.prefill_time_s(pool, r.num_prompt_tokens) for r in workload.requests]
    n = 1
    while n < MAX_WORKERS and (tokens_per_s(n, rate) <= 0 or fluid_ttft_met(
            workload, tokens_per_s(n, rate), own, auto.ttft_s) < auto.percentile / 100):
        n += 1
    return n


def _colocated_prefill(profile: CapacityProfile, auto, load: Load, decode: Need,
                       workload: Workload) -> Callable[[int, float], float]:
    """A colocated pool's prefill capacity at n workers: what the decode load leaves of them, and 0
    (too few) while the prefill its worker computes during one request's decode would stretch
    that request's token gaps past the ITL SLO at the SLO percentile. A request decoding
    `output_len` tokens within itl_s each has output_len x (itl_s - decode step) to spare; the
    prefill time that lands on its worker meanwhile is a compound Poisson sum (its worker's share
    of the arrivals x each prompt's own prefill), taken at mean + z x its deviation."""
    context = load.prompt_len + load.output_len / 2
    concurrent = decode.figures.get("decode_concurrent", 0.0)
    own = [profile.prefill_time_s("decode", r.num_prompt_tokens) for r in workload.requests]
    first, second = sum(own) / len(own), sum(t * t for t in own) / len(own)
    z = max(0.0, statistics.NormalDist().inv_cdf(min(auto.percentile, 99.9) / 100))

    def tokens_per_s(n: int, rate: float) -> float:
        step = profile.decode_step_s("decode", max(1, math.ceil(concurrent / n)), context)
        spare = load.output_len * (auto.itl_s - step)
        arrivals = load.requests_per_s / n * load.output_len * auto.itl_s  # onto its worker meanwhile
        if spare <= 0 or arrivals * first + z * math.sqrt(arrivals * second) > spare:
            return 0.0
        return (n * auto.target_utilization - (decode.load or 0.0)) * rate
    return tokens_per_s


def _auto(config: ClusterConfig, slo: Slo):
    return dataclasses.replace(config.router.autoscale, **({"ttft_s": slo.ttft_s} if slo.ttft_s else {}),
                               **({"itl_s": slo.tpot_s} if slo.tpot_s else {}))


def _profile(config: ClusterConfig, em: Emulation, colocated: bool) -> CapacityProfile:
    sched = config.scheduler
    chunk = (sched.chunk_size or 64) if colocated else None  # as bench/arrangements.py sets them up
    return CapacityProfile("cost_model", CostStepModel(em.cost), config.step_tokens(config.decode), chunk,
                           sched.max_num_seqs)


def _sizer(config: ClusterConfig, em: Emulation, slo: Slo, colocated: bool) -> tuple[Sizer, Observation]:
    """The planner's sizing on the cost-model profile, and an observation of one idle worker per pool."""
    block = config.kv_cache.block_size
    blocks = emulated_num_blocks(config.emulate, block) or config.kv_cache.num_blocks or 0
    sample = WorkerSample("profile", math.inf, 0, blocks, block, 0, 0)
    pools = {p: PoolObservation(p, 1, 0, 0, 0, (sample,)) for p in ("prefill", "decode")}
    obs = Observation(now=0.0, window_s=PEAK_WINDOW_S, mode="colocated" if colocated else "disaggregated",
                      pools=pools)
    return Sizer(_auto(config, slo), _profile(config, em, colocated)), obs


def _need(config: ClusterConfig, em: Emulation, slo: Slo, load: Load, colocated: bool) -> tuple[int, int]:
    """(prefill workers, decode workers) the planner's sizing asks for this load; (0, N) colocated."""
    sizer, obs = _sizer(config, em, slo, colocated)
    u = sizer.cfg.target_utilization
    if colocated:
        return 0, max(1, ceil_workers(sizer.colocated(obs, load).load or 0.0, u))
    return (max(1, ceil_workers(sizer.prefill(obs, load).load or 0.0, u)),
            max(1, ceil_workers(sizer.decode(obs, load).load or 0.0, u)))


def _decode_need(config: ClusterConfig, em: Emulation, slo: Slo, load: Load) -> Need:
    """The decode share of a colocated pool's load (workers at full capacity, and its figures)."""
    sizer, obs = _sizer(config, em, slo, colocated=True)
    return sizer.decode(obs, load, "decode")


def recommend(config: ClusterConfig, em: Emulation, workload: Workload, slo: Slo,
              window_s: float = PEAK_WINDOW_S) -> dict[str, Any]:
    """The static arrangement (a name as `pdserve simulate --statics` takes it) and the figures behind it."""
    load, auto = peak_load(workload, window_s), _auto(config, slo)
    p, d = _need(config, em, slo, load, colocated=False)
    _, n = _need(config, em, slo, load, colocated=True)
    by_window = f"{p}P{d}D", f"colocated-{n}"
    p = _replay_workers(workload, _profile(config, em, False), "prefill", auto)
    coloc = _profile(config, em, True)
    prefill = _colocated_prefill(coloc, auto, load, _decode_need(config, em, slo, load), workload)
    n = max(n, _fluid_workers(workload, coloc, "decode", auto, prefill))
    name = f"colocated-{n}" if n <= p + d else f"{p}P{d}D"
    return {"recommended": name, "workers": min(n, p + d), "disaggregated": f"{p}P{d}D", "colocated": f"colocated-{n}",
            "peak_load": dataclasses.asdict(load), "peak_window_s": window_s, "by_peak_window": list(by_window),
            "profile": "cost_model",
            "target_utilization": config.router.autoscale.target_utilization}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("static recommendation for a trace (--trace; no --model needed)")
    group.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace the cluster must serve")
    group.add_argument("--slo", default="", help="e.g. ttft=2,tpot=50ms (default: router.autoscale's)")
    group.add_argument("--emulate", default="h100:llama-3.1-8b", metavar="DEVICE:MODEL",
                       help="the device and model of the profile (default %(default)s)")
    group.add_argument("--config", default=str(GPU_CLUSTER), metavar="YAML",
                       help="the cluster's scheduler, KV and router.autoscale (default simulate/gpu_cluster.yaml)")
    group.add_argument("--length-scale", type=float, default=1.0, help="trace lengths divided by this (default 1)")
    group.add_argument("--time-scale", type=float, default=1.0, help="trace arrivals divided by this (default 1)")
    group.add_argument("--window", default="0:", metavar="START:END", help="seconds of the trace (default all)")
    group.add_argument("--peak-window", type=float, default=PEAK_WINDOW_S, metavar="S",
                       help="the busiest this-long window is the load to carry (default %(default)s)")


def run_trace(args: argparse.Namespace) -> int:
    """Prints the recommendation (one JSON object with --json); 2 with a message for bad input."""
    from bench.emulation import parse_emulate
    from bench.errors import BenchError
    from bench.metrics import parse_slo
    from bench.presets import WorkloadOptions, build_workload
    from bench.trace import parse_window
    from router.config.emulate import check_emulate, emulation
    from router.config.loader import load_config
    from router.config.typed_yaml import ConfigError

    try:
        slo = parse_slo(args.slo)
        base = load_config(args.config)
        device, model = parse_emulate(args.emulate)
        sec = dataclasses.replace(base.emulate, device=device, model=model, time_scale=1.0)
        check_emulate(sec, base.kv_cache.block_size, args.config)
        config, em = dataclasses.replace(base, emulate=sec), emulation(sec)
        workload = build_workload(WorkloadOptions(
            trace=args.trace, length_scale=args.length_scale, time_scale=args.time_scale,
            window=parse_window(args.window), max_context=em.cost.shape.max_positions or 131_072,
            vocab=(1000, em.cost.shape.vocab_size or 32_000)))
        if args.peak_window <= 0:
            raise BenchError("--peak-window must be positive seconds")
    except (BenchError, ConfigError, OSError, ValueError) as err:  # a PlanError is a ValueError
        print(f"pdserve plan: {err}", file=sys.stderr)
        return 2
    found = recommend(config, em, workload, slo, args.peak_window)
    load = found["peak_load"]
    print(json.dumps(found) if args.json else
          f"recommended: {found['recommended']} ({found['workers']} x {args.emulate}; disaggregated would be "
          f"{found['disaggregated']}, colocated {found['colocated']})\n"
          f"load carried: the busiest {args.peak_window:g} s, {load['requests_per_s']:.2f} req/s, "
          f"{load['prompt_tokens_per_s']:.0f} prompt tokens/s (mean prompt {load['prompt_len']:.0f}, output "
          f"{load['output_len']:.0f}) at {found['target_utilization']:.0%} of the cost model's capacity")
    return 0
