"""`pdserve plan --trace FILE --slo ... --emulate DEVICE:MODEL`: the static arrangement the planner
would choose for a trace, for an operator who does not want autoscaling.

Both arrangements are sized on the planner's capacity profile from the emulated device's cost
model (router/autoscale/profile.py, source `cost_model`), and the cheaper is recommended
(colocated on a tie).

Disaggregated: decode workers by the planner's own sizing (router/autoscale/sizing.py `Sizer`)
for the trace's busiest `--peak-window` seconds (the highest prompt tokens/s of any window, and
its requests/s; mean prompt and output lengths of the whole trace) at the planner's
`target_utilization`. Prefill workers by replaying the whole trace: each prompt goes to the
worker free first (the router places on the least work ahead) and runs there at the profile's
full speed, one prompt on one worker; the fewest workers whose replay meets the TTFT SLO for the
SLO's percentile of requests (a 30 s mean hides how arrivals bunch within seconds; the replay
sees every bunch, so no utilization headroom is added).

Colocated: the fewest workers whose replay meets both SLOs (TTFT, and TPOT: a request's mean token
gap, against the ITL SLO) for the SLO's percentile of requests, the replay doing what `pdserve
simulate` does with a colocated pool. Each prompt is placed where its prefill finishes first
(router/pools/placement.py `Placer.pick_colocated`: the tokens queued there, those of prompts
without their first token yet, plus this prompt's tokens that worker's prefix cache does not hold;
ties to the one holding more of it, then to the fewest requests). Each worker steps as its engine
schedules (engine/scheduler.py): every decode row, then a chunk (at most `chunk_size`) of each
prompt in arrival order while the step's token budget lasts; a step takes the profile's time for
its shape (tokens, context read, attended pairs), so a worker's prompt chunks slow the decode rows
riding in the same steps, as a step of `pdserve simulate` does. A prompt's first token comes at the
end of the step that computes its last chunk; its TPOT is the mean of the steps it then decodes in.
Prefix caches are per worker, least recently used dropped beyond the worker's KV, keyed by
512-token blocks (a shorter shared prefix is not credited). Not modelled: the KV a worker's
requests hold (admission never waits for blocks), network and router delays. Runs of decode-only
steps are summed at once (their time is linear in the context), so a replay takes a fraction of a
second on the driver's traces.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.metrics import Slo
from bench.workload import Workload
from router.autoscale.observation import Observation, PoolObservation, WorkerSample
from router.autoscale.profile import CapacityProfile, CostStepModel
from router.autoscale.sizing import Load, Sizer, ceil_workers
from router.config.emulate import emulated_num_blocks
from router.config.schema import ClusterConfig
from sizing.cost_model import Emulation, StepTotals

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


PREFIX_BLOCK = 512  # tokens: the colocated replay's prefix-cache grain (a Mooncake trace's block, 32 KV blocks)


def prefix_keys(prompts: Sequence[Sequence[int]], block: int = PREFIX_BLOCK) -> list[list[int]]:
    """Per prompt, one key per full `block`, each naming its whole prefix (chained, as
    protocol/block_hash.py's hashes are, but Python's tuple hash: fast, and fixed for ints). A prompt
    whose first block no other prompt has shares no prefix: its first key alone."""
    first = [hash((0, hash(tuple(p[:block])))) if len(p) >= block else None for p in prompts]
    shared = {k for k, n in Counter(first).items() if n > 1}
    out = []
    for prompt, key in zip(prompts, first, strict=True):
        keys = [key] if key is not None else []
        for i in range(2 * block, len(prompt) + 1, block) if key in shared else ():
            key = hash((key, hash(prompt[i - block:i])))
            keys.append(key)
        out.append(keys)
    return out


class _Worker:
    """A colocated worker in the replay: its engine's prompts and decode rows, and the router's view of it."""

    __slots__ = ("t", "prefill", "held", "sampled", "rows", "ctx", "steps", "busy_s", "decoding", "cache", "count")

    def __init__(self) -> None:
        self.t = 0.0  # when its next step starts
        self.prefill: deque[list[int]] = deque()  # [request, tokens computed, prompt tokens, tokens to compute]
        self.held = 0  # tokens to compute of its prompts still prefilling (the router's `prefill_tokens`)
        self.sampled: list[int] = []  # those of the prompts whose first token the step ending at `t` samples
        self.rows = self.ctx = self.steps = self.count = 0  # decode rows, their context, steps run, requests
        self.busy_s = 0.0  # seconds of steps run
        self.decoding: list[tuple[int, int, float, int]] = []  # heap of (its last step, request, busy_s then, prompt)
        self.cache: OrderedDict[int, None] = OrderedDict()  # prefix keys held, least recently used first

    def queued(self, now: float) -> int:
        """What the router counts queued here at `now`: a prompt's tokens until its first token."""
        return self.held + (sum(self.sampled) if self.t > now else 0)


def colocated_met(workload: Workload, workers: int, profile: CapacityProfile, ttft_s: float, itl_s: float,
                  keys: list[list[int]] | None = None, cache_tokens: int = 0, stop_below: float = 0.0,
                  seen: dict[int, list] | None = None) -> float:
    """The share of requests meeting both the TTFT and the TPOT SLO on `workers` colocated workers
    (module docstring). `keys`: each prompt's `prefix_keys` (None: no prefix cache), a worker's
    cache holding `cache_tokens`. Stops early, returning the share so far (an upper bound), once
    more than 1 - `stop_below` of the requests have missed. `seen`: filled with each request's
    [TTFT, TPOT (None for one token), worker]."""
    reqs, budget, chunk = workload.requests, profile.budget_tokens, profile.chunk
    missed, allowed = bytearray(len(reqs)), len(reqs) - math.ceil(stop_below * len(reqs) - 1e-9)
    misses, room_keys, pool = 0, cache_tokens // PREFIX_BLOCK or math.inf, [_Worker() for _ in range(workers)]

    def miss(i: int) -> None:
        nonlocal misses
        misses += not missed[i]
        missed[i] = 1

    def decode_only(w: _Worker, until: float) -> None:
        """The decode steps that start before `until`, up to the next request's last token, summed at
        once: a step's time is linear in its context (the trapezoid of the first and last; the
        roofline's kink within a run costs a hair of overestimate)."""
        rows, ctx = w.rows, w.ctx

        def sum_s(k: int) -> float:  # the first k steps' seconds
            last = profile.step_s("decode", StepTotals(rows, ctx + k * rows, ctx + k * rows)) if k > 1 else first
            return k * (first + last) / 2

        first = profile.step_s("decode", StepTotals(rows, ctx + rows, ctx + rows))
        k = w.decoding[0][0] - w.steps
        if until < math.inf:
            k = min(k, max(1, math.ceil((until - w.t) / first)))
            while k > 1 and w.t + sum_s(k - 1) >= until:  # steps lengthen as their context grows
                k -= 1
        took = sum_s(k)
        w.t, w.busy_s, w.steps, w.ctx, w.sampled = w.t + took, w.busy_s + took, w.steps + k, ctx + k * rows, []

    def step(w: _Worker, until: float) -> None:
        """One engine step (engine/scheduler.py): every decode row, then chunks of the prompts in
        arrival order (each at most `chunk`) while the token budget lasts."""
        if not w.prefill:
            decode_only(w, until)
            finish(w)
            return
        room, tokens, context, chunks = budget - w.rows, w.rows, w.ctx + w.rows, []
        pairs = context  # a decode row attends to its whole context
        for item in w.prefill:
            if room <= 0:
                break
            c = min(item[2] - item[1], room, chunk)
            tokens, context, pairs = tokens + c, context + item[1] + c, pairs + c * item[1] + c * (c + 1) // 2
            room -= c
            chunks.append(c)
        took = profile.step_s("decode", StepTotals(tokens, context, pairs))
        w.t, w.busy_s, w.steps, w.ctx, w.sampled = w.t + took, w.busy_s + took, w.steps + 1, w.ctx + w.rows, []
        going_on = []
        for item, c in zip([w.prefill.popleft() for _ in chunks], chunks, strict=True):
            item[1] += c
            if item[1] < item[2]:
                going_on.append(item)
                continue
            i, out = item[0], reqs[item[0]].max_tokens  # its first token, at the step's end
            w.held -= item[3]
            w.sampled.append(item[3])
            if w.t - reqs[i].arrival_s > ttft_s:
                miss(i)
            if seen is not None:
                seen[i] = [w.t - reqs[i].arrival_s, None, pool.index(w)]
            if out > 1:
                heapq.heappush(w.decoding, (w.steps + out - 1, i, w.busy_s, item[2]))
                w.rows, w.ctx = w.rows + 1, w.ctx + item[2]
            else:
                w.count -= 1
        w.prefill.extendleft(reversed(going_on))
        finish(w)

    def finish(w: _Worker) -> None:
        while w.decoding and w.decoding[0][0] == w.steps:  # its last token: TPOT is its mean gap
            _, i, since, prompt = heapq.heappop(w.decoding)
            out = reqs[i].max_tokens
            w.rows, w.ctx, w.count = w.rows - 1, w.ctx - prompt - (out - 1), w.count - 1
            if (w.busy_s - since) / (out - 1) > itl_s:
                miss(i)
            if seen is not None:
                seen[i][1] = (w.busy_s - since) / (out - 1)

    def run(w: _Worker, until: float) -> None:
        while (w.prefill or w.rows) and w.t < until and misses <= allowed:
            step(w, until)

    for i, r in enumerate(reqs):
        n, best = r.num_prompt_tokens, None
        for k, w in enumerate(pool):
            run(w, r.arrival_s)
            hit = 0
            for key in keys[i][:(n - 1) // PREFIX_BLOCK] if keys is not None else ():
                if key not in w.cache:
                    break
                hit += PREFIX_BLOCK
            here = (w.queued(r.arrival_s) + n - hit, -hit, w.count, k, hit)  # ties: decode_candidates' order
            best = here if best is None or here < best else best
        if misses > allowed:
            return 1 - misses / len(reqs)
        w, hit = pool[best[3]], best[4]
        w.t = w.t if w.prefill or w.rows else max(w.t, r.arrival_s)
        w.prefill.append([i, hit, n, n - hit])
        w.held, w.count = w.held + n - hit, w.count + 1
        for key in keys[i] if keys is not None else ():
            w.cache[key] = None
            w.cache.move_to_end(key)
        while len(w.cache) > room_keys:
            w.cache.popitem(last=False)
    for w in pool:
        run(w, math.inf)
    return 1 - misses / len(reqs)


def _colocated_workers(workload: Workload, profile: CapacityProfile, auto, cache_tokens: int | None) -> int:
    """The fewest colocated workers whose replay meets both SLOs for the SLO percentile of requests:
    doubling from 1 until one does, then halving the gap (the share rises with the workers)."""
    keys = prefix_keys([r.prompt_token_ids for r in workload.requests]) if cache_tokens is not None else None
    share = auto.percentile / 100

    def met(n: int) -> bool:
        return colocated_met(workload, n, profile, auto.ttft_s, auto.itl_s, keys, cache_tokens or 0, share) >= share

    lo, hi = 0, 1
    while hi < MAX_WORKERS and not met(hi):
        lo, hi = hi, min(2 * hi, MAX_WORKERS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if met(mid) else (mid, hi)
    return hi


def _auto(config: ClusterConfig, slo: Slo):
    return dataclasses.replace(config.router.autoscale, **({"ttft_s": slo.ttft_s} if slo.ttft_s else {}),
                               **({"itl_s": slo.tpot_s} if slo.tpot_s else {}))


def _profile(config: ClusterConfig, em: Emulation, colocated: bool) -> CapacityProfile:
    sched = config.scheduler
    chunk = (sched.chunk_size or 64) if colocated else None  # as bench/arrangements.py sets them up
    return CapacityProfile("cost_model", CostStepModel(em.cost), config.step_tokens(config.decode), chunk,
                           sched.max_num_seqs)


def _kv_tokens(config: ClusterConfig) -> int:
    block = config.kv_cache.block_size
    return (emulated_num_blocks(config.emulate, block) or config.kv_cache.num_blocks or 0) * block


def _sizer(config: ClusterConfig, em: Emulation, slo: Slo, colocated: bool) -> tuple[Sizer, Observation]:
    """The planner's sizing on the cost-model profile, and an observation of one idle worker per pool."""
    block = config.kv_cache.block_size
    sample = WorkerSample("profile", math.inf, 0, _kv_tokens(config) // block, block, 0, 0)
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


def recommend(config: ClusterConfig, em: Emulation, workload: Workload, slo: Slo,
              window_s: float = PEAK_WINDOW_S) -> dict[str, Any]:
    """The static arrangement (a name as `pdserve simulate --statics` takes it) and the figures behind it."""
    load, auto = peak_load(workload, window_s), _auto(config, slo)
    p, d = _need(config, em, slo, load, colocated=False)
    _, n = _need(config, em, slo, load, colocated=True)
    by_window = f"{p}P{d}D", f"colocated-{n}"
    p = _replay_workers(workload, _profile(config, em, False), "prefill", auto)
    cache = _kv_tokens(config) if config.kv_cache.prefix_caching else None
    n = _colocated_workers(workload, _profile(config, em, True), auto, cache)
    name = f"colocated-{n}" if n <= p + d else f"{p}P{d}D"
    return {"recommended": name, "workers": min(n, p + d), "disaggregated": f"{p}P{d}D", "colocated": f"colocated-{n}",
            "peak_load": dataclasses.asdict(load), "peak_window_s": window_s, "by_peak_window": list(by_window),
            "profile": "cost_model",
            "target_utilization": config.router.autoscale.target_utilization, "percentile": auto.percentile}


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
          f"colocated: the fewest workers whose replay of the trace (each prompt where its prefill finishes "
          f"first, the engine's chunked steps) meets TTFT and TPOT for {found['percentile']:g}% of requests\n"
          f"disaggregated: prefill by a replay of the trace at the profile's full speed; decode for the "
          f"busiest {args.peak_window:g} s, {load['requests_per_s']:.2f} req/s, "
          f"{load['prompt_tokens_per_s']:.0f} prompt tokens/s (mean prompt {load['prompt_len']:.0f}, output "
          f"{load['output_len']:.0f}) at {found['target_utilization']:.0%} of the cost model's capacity")
    return 0
