"""Named workloads (docs/metrics.md): steady, morning-burst, long-context, shared-prefix, diurnal,
bursty, plateau (bench/swings.py: the autoscaler's cases), conversation.

`build_workload(WorkloadOptions)` is the one entry point: a preset supplies defaults, every
option the user gave overrides them, and the same options + seed give the same requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.errors import WorkloadError
from bench.swings import (
    BURSTY_HIGH_S,
    BURSTY_LOW_S,
    PLATEAU_S,
    bursts,
    bursty_rate,
    thinned_arrivals,
)
from bench.trace import TraceScaling, read_trace, trace_workload
from bench.workload import (
    DEFAULT_VOCAB,
    RequestSpec,
    Workload,
    arrival_times,
    make_workload,
    random_tokens,
    sample_lengths,
    synthetic_requests,
)

CONVERSATION_WINDOW = Path(__file__).parent / "data" / "conversation_window.jsonl"
BURST_WINDOW_S = 1.0
NUM_SHARED_PREFIXES = 4


@dataclass(frozen=True)
class PresetDefaults:
    """What a preset sends when the user gives no override (input_len None: near context)."""

    description: str
    num_requests: int
    rate: float | None
    input_len: int | None
    output_len: int
    range_ratio: float


PRESETS: dict[str, PresetDefaults] = {
    "steady": PresetDefaults("short chat at a steady Poisson rate", 200, 4.0, 128, 64, 0.5),
    "morning-burst": PresetDefaults(
        "streaming chat users; a burst of long prompts lands together 40% into the run",
        120, 2.0, 128, 256, 0.25),
    "long-context": PresetDefaults("prompts near the model's context", 32, 0.5, None, 64, 0.05),
    "shared-prefix": PresetDefaults(
        f"requests share one of {NUM_SHARED_PREFIXES} long prefixes (3/4 of the prompt)",
        200, 4.0, 512, 64, 0.25),
    "diurnal": PresetDefaults(
        "a day's swing in one run: the rate ramps from a fifth of --rate up to --rate and back down, "
        "with 3x --rate for a twentieth of the run at 60%", 2000, 20.0, 1024, 256, 0.5),
    "bursty": PresetDefaults(
        f"Dynamo #10528's burst: {BURSTY_LOW_S:g} s at a 24th of --rate, then {BURSTY_HIGH_S:g} s at --rate "
        "(1 <-> 24 req/s), repeated; 8,000-token prompts", 1560, 24.0, 8000, 200, 0.05),
    "plateau": PresetDefaults(
        f"one constant Poisson rate for {PLATEAU_S / 60:g} minutes (rate x {PLATEAU_S:g} s requests unless "
        "--num-requests): an autoscaler must settle and stay", 0, 8.0, 1024, 256, 0.5),
    "conversation": PresetDefaults(
        "a window of Mooncake's conversation trace, lengths / 16", 0, None, None, 0, 0.0),
}


@dataclass(frozen=True)
class WorkloadOptions:
    """Everything that decides a workload; None means "the preset's default"."""

    preset: str = "steady"
    num_requests: int | None = None
    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float | None = None
    max_context: int = 2048
    vocab: tuple[int, int] = DEFAULT_VOCAB
    seed: int = 0
    trace: str | None = None
    length_scale: float | None = None
    time_scale: float | None = None
    window: tuple[float, float | None] = (0.0, None)


def build_workload(opts: WorkloadOptions) -> Workload:
    """The preset's requests with the user's overrides; a trace path wins over any preset."""
    if opts.trace is not None or opts.preset == "conversation":
        return _trace(opts)
    if opts.preset not in PRESETS:
        raise WorkloadError(f"unknown preset {opts.preset!r}; known: {', '.join(PRESETS)}")
    builders = {"steady": _open_loop, "long-context": _open_loop,
                "morning-burst": _morning_burst, "shared-prefix": _shared_prefix, "diurnal": _diurnal,
                "bursty": _bursty, "plateau": _plateau}
    return builders[opts.preset](opts, PRESETS[opts.preset])


def _resolved(opts: WorkloadOptions, d: PresetDefaults) -> dict[str, Any]:
    output_len = opts.output_len or d.output_len
    near_context = int(opts.max_context * 0.9) - output_len
    return {
        "num_requests": d.num_requests if opts.num_requests is None else opts.num_requests,
        "rate": opts.rate if opts.rate is not None else (None if opts.concurrency else d.rate),
        "input_len": opts.input_len or d.input_len or max(1, near_context),
        "output_len": output_len,
        "range_ratio": d.range_ratio if opts.range_ratio is None else opts.range_ratio,
    }


def _metadata(opts: WorkloadOptions, r: dict[str, Any]) -> dict[str, Any]:
    return {"preset": opts.preset, "description": PRESETS[opts.preset].description,
            "seed": opts.seed, "burstiness": opts.burstiness, "max_context": opts.max_context,
            "vocab": list(opts.vocab)} | r


def _synthetic(opts: WorkloadOptions, r: dict[str, Any], prefix: str,
               rng: np.random.Generator, shared: tuple[int, ...] = ()) -> list[RequestSpec]:
    arrivals = arrival_times(r["num_requests"], r["rate"], opts.burstiness, rng)
    prompt_lens = sample_lengths(r["num_requests"], r["input_len"], r["range_ratio"], rng)
    output_lens = np.full(r["num_requests"], r["output_len"])
    return synthetic_requests(prefix, arrivals, prompt_lens, output_lens, opts.max_context,
                              opts.vocab, rng, shared)


def _open_loop(opts: WorkloadOptions, d: PresetDefaults) -> Workload:
    r = _resolved(opts, d)
    specs = _synthetic(opts, r, "req", np.random.default_rng(opts.seed))
    return make_workload(opts.preset, specs, opts.concurrency, _metadata(opts, r))


def _shared_prefix(opts: WorkloadOptions, d: PresetDefaults) -> Workload:
    """Each request opens with one of a few long prefixes (KV that a prefix cache can reuse);
    `shared_fraction` in the metadata is the share of all prompt tokens those prefixes make up."""
    r = _resolved(opts, d)
    rng = np.random.default_rng(opts.seed)
    prefix_len = max(1, r["input_len"] * 3 // 4)
    prefixes = [random_tokens(prefix_len, opts.vocab, rng) for _ in range(NUM_SHARED_PREFIXES)]
    group_sizes = np.bincount(rng.integers(NUM_SHARED_PREFIXES, size=r["num_requests"]),
                              minlength=NUM_SHARED_PREFIXES)
    specs: list[RequestSpec] = []
    for group, size in enumerate(group_sizes):
        group_opts = r | {"num_requests": int(size)}
        specs += _synthetic(opts, group_opts, f"prefix{group}", rng, prefixes[group])
    shared = sum(min(prefix_len, s.num_prompt_tokens) for s in specs)
    meta = _metadata(opts, r) | {"num_prefixes": NUM_SHARED_PREFIXES, "prefix_tokens": prefix_len,
                                 "shared_fraction": shared / max(1, sum(s.num_prompt_tokens for s in specs))}
    return make_workload(opts.preset, _interleave(specs, r, opts, rng), opts.concurrency, meta)


def _interleave(specs: list[RequestSpec], r: dict[str, Any], opts: WorkloadOptions,
                rng: np.random.Generator) -> list[RequestSpec]:
    """One arrival process for all groups: re-time the specs in a random order."""
    arrivals = arrival_times(len(specs), r["rate"], opts.burstiness, rng)
    order = rng.permutation(len(specs))
    return [RequestSpec(specs[i].request_id, float(arrivals[rank]), specs[i].prompt_token_ids,
                        specs[i].max_tokens) for rank, i in enumerate(order)]


def _morning_burst(opts: WorkloadOptions, d: PresetDefaults) -> Workload:
    """Streaming users at a steady rate; long prompts land together 40% into the run."""
    r = _resolved(opts, d)
    if r["rate"] is None:
        raise WorkloadError("morning-burst replays arrivals over time: give --rate, "
                            "not only --concurrency")
    rng = np.random.default_rng(opts.seed)
    specs = _synthetic(opts, r, "stream", rng)
    burst_start = round(0.4 * r["num_requests"] / r["rate"], 3)
    burst = {"num_requests": max(4, r["num_requests"] // 8), "rate": None, "input_len": int(opts.max_context * 0.75),
             "output_len": 16, "range_ratio": 0.1}
    burst_specs = [RequestSpec(s.request_id, burst_start + float(offset), s.prompt_token_ids,
                               s.max_tokens)
                   for s, offset in zip(_synthetic(opts, burst, "burst", rng),
                                        np.sort(rng.uniform(0, BURST_WINDOW_S, burst["num_requests"])),
                                        strict=True)]
    window = {"start_s": burst_start, "end_s": burst_start + BURST_WINDOW_S,
              "num_requests": burst["num_requests"], "prompt_tokens": burst["input_len"]}
    meta = _metadata(opts, r) | {"burst": window}
    return make_workload(opts.preset, specs + burst_specs, opts.concurrency, meta)


DIURNAL_LOW = 0.2  # the trough's rate, as a share of the peak (--rate)
DIURNAL_BURST = (0.6, 0.05, 3.0)  # the burst: where in the run, how long (shares of it), x the peak rate


def diurnal_rate(t: float, duration: float, peak: float) -> float:
    """Requests/s at `t` of a `duration`-second diurnal run: a cosine from the trough at both ends
    to `peak` halfway, and the burst on top."""
    at, length, times = DIURNAL_BURST
    if at * duration <= t < (at + length) * duration:
        return times * peak
    return peak * (DIURNAL_LOW + (1 - DIURNAL_LOW) * (1 - math.cos(2 * math.pi * t / duration)) / 2)


def _diurnal(opts: WorkloadOptions, d: PresetDefaults) -> Workload:
    """Arrivals of a non-homogeneous Poisson process (thinning) whose rate follows `diurnal_rate`;
    the run lasts as long as its mean rate takes to send `num_requests`."""
    r = _resolved(opts, d)
    if r["rate"] is None:
        raise WorkloadError("diurnal replays a rate that swings over time: give --rate (its peak)")
    peak, n = r["rate"], r["num_requests"]
    mean = peak * ((1 + DIURNAL_LOW) / 2 + DIURNAL_BURST[1] * (DIURNAL_BURST[2] - (1 + DIURNAL_LOW) / 2))
    duration = n / mean
    rng = np.random.default_rng(opts.seed)
    arrivals = thinned_arrivals(n, lambda t: diurnal_rate(t % duration, duration, peak), DIURNAL_BURST[2] * peak, rng)
    timed = _timed(opts, r, arrivals, rng)
    at, length, _ = DIURNAL_BURST
    meta = _metadata(opts, r) | {"period_s": duration, "burst": {
        "start_s": at * duration, "end_s": (at + length) * duration,
        "num_requests": sum(at * duration <= a < (at + length) * duration for a in arrivals)}}
    return make_workload(opts.preset, timed, opts.concurrency, meta)


def _timed(opts: WorkloadOptions, r: dict[str, Any], arrivals: list[float],
           rng: np.random.Generator) -> list[RequestSpec]:
    specs = _synthetic(opts, r | {"rate": None, "num_requests": len(arrivals)}, "req", rng)
    return [RequestSpec(s.request_id, a, s.prompt_token_ids, s.max_tokens) for s, a in zip(specs, arrivals, strict=True)]


def _bursty(opts: WorkloadOptions, d: PresetDefaults) -> Workload:
    """Dynamo #10528's square wave (bench/swings.py); --rate is the burst's rate."""
    r = _resolved(opts, d)
    if r["rate"] is None:
        raise WorkloadError("bursty replays a rate that swings over time: give --rate (the burst's)")
    rng = np.random.default_rng(opts.seed)
    arrivals = thinned_arrivals(r["num_requests"], lambda t: bursty_rate(t, r["rate"]), r["rate"], rng)
    meta = _metadata(opts, r) | {"low_s": BURSTY_LOW_S, "high_s": BURSTY_HIGH_S, "bursts": bursts(arrivals)}
    return make_workload(opts.preset, _timed(opts, r, arrivals, rng), opts.concurrency, meta)


def _plateau(opts: WorkloadOptions, d: PresetDefaults) -> Workload:
    """A constant Poisson rate for PLATEAU_S seconds (or --num-requests of it)."""
    r = _resolved(opts, d)
    if r["rate"] is None:
        raise WorkloadError("plateau holds one rate: give --rate")
    r["num_requests"] = opts.num_requests or max(1, round(r["rate"] * PLATEAU_S))
    rng = np.random.default_rng(opts.seed)
    arrivals = [round(float(a), 6) for a in arrival_times(r["num_requests"], r["rate"], opts.burstiness, rng)]
    return make_workload(opts.preset, _timed(opts, r, arrivals, rng), opts.concurrency, _metadata(opts, r))


def _trace(opts: WorkloadOptions) -> Workload:
    path = Path(opts.trace) if opts.trace is not None else CONVERSATION_WINDOW
    conversation = opts.preset == "conversation"
    default_scale = 16.0 if conversation else 1.0
    scaling = TraceScaling(
        length_scale=opts.length_scale or default_scale,
        time_scale=opts.time_scale or 1.0,
        window_start_s=opts.window[0],
        window_end_s=opts.window[1],
    )
    name = "conversation" if conversation else "trace"
    return trace_workload(read_trace(path), scaling, max_context=opts.max_context,
                          vocab=opts.vocab, seed=opts.seed, num_requests=opts.num_requests,
                          concurrency=opts.concurrency, name=name, source=str(path))
