"""Conditional disaggregation measured: `python -m simulate.conditional --json`.

For each trace, at N simulated devices, `pdserve simulate --sweep`'s study (every rate, scored
by the SLO: attainment, knee, goodput per device at SLO) over three families of arrangements:
colocated (chunked); pure disaggregation at each P:D split, with whole prompts (`disaggregated`)
and with chunked prefill (`disaggregated-chunked`); and conditional disaggregation, the chunked
split with `router.local_prefill` on (`conditional`: the decode worker prefills a request whose
uncached part is at most `--max-uncached` tokens, or whose prefill pool is backed up past
`--wait-factor` x the local cost). It prints, per trace, each arrangement's figures and the best
of each family: the target is conditional >= the better of pure disaggregation and colocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from typing import Any

from bench.arrangements import arrangement_config
from bench.metrics import parse_slo
from bench.presets import WorkloadOptions, build_workload
from router.config.loader import load_config
from router.config.schema import ClusterConfig
from simulate.cli import emulated
from simulate.sweep import _one, _score

SHIPPED = "conversation=bench/data/conversation_window.jsonl"  # Mooncake's conversation trace, first 120 s
FAMILIES = ("colocated", "disaggregated", "disaggregated-chunked", "conditional")


def family(name: str) -> str:
    return name.rsplit("-", 1)[0] if name.startswith(("disaggregated", "conditional")) else "colocated"


def with_local_prefill(cfg: ClusterConfig, max_uncached: int, wait: str | float) -> ClusterConfig:
    local = dataclasses.replace(cfg.router.local_prefill, max_uncached_tokens=max_uncached,
                                when_prefill_wait_exceeds=wait)
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, local_prefill=local))


def arrangements(base: ClusterConfig, n: int, splits: list[int], max_uncached: int,
                 wait: str | float, families: tuple[str, ...] = FAMILIES) -> dict[str, ClusterConfig]:
    out = {f"colocated-{n}": arrangement_config(base, "colocated-chunked", n)}
    for p in splits:
        split = f"{p}P{n - p}D"
        out[f"disaggregated-{split}"] = arrangement_config(base, "disaggregated", n, prefill_workers=p)
        chunked = arrangement_config(base, "disaggregated-chunked", n, prefill_workers=p)
        out[f"disaggregated-chunked-{split}"] = chunked
        out[f"conditional-{split}"] = with_local_prefill(chunked, max_uncached, wait)
    return {name: cfg for name, cfg in out.items() if family(name) in families}


def study(args: argparse.Namespace) -> dict[str, Any]:
    base = load_config(args.config)
    base, em = emulated(base, dataclasses.replace(base.emulate, device=args.device, model=args.model), args.config)
    slo = parse_slo(args.slo)
    wait = args.wait_factor if args.wait_factor in ("auto", "off") else float(args.wait_factor)
    configs = arrangements(base, args.devices, [int(p) for p in args.splits.split(",")], args.max_uncached, wait,
                           tuple(args.families.split(",")))
    rates = [float(r) for r in args.rates.split(",")]
    out: dict[str, Any] = {"devices": args.devices, "emulate": f"{args.device}:{args.model}", "slo": args.slo,
                           "local_prefill": {"max_uncached_tokens": args.max_uncached,
                                             "when_prefill_wait_exceeds": wait},
                           "window_s": args.window, "rates_per_device": rates, "traces": {}}
    for trace, _, path in (t.partition("=") for t in args.trace or [SHIPPED]):
        workload = build_workload(WorkloadOptions(trace=path, length_scale=1.0, window=(0.0, args.window),
                                                  max_context=131072))
        jobs = [(name, args.devices, rate, cfg, em, workload, slo, args.seed) for name, cfg in configs.items()
                for rate in rates]
        began = time.perf_counter()
        with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
            results = pool.map(_one, jobs, chunksize=1)
        arr: dict[str, dict[str, Any]] = {}
        for name, _n, rate, figures, host_s in results:
            entry = arr.setdefault(name, {"rates": {}, "host_s": 0.0})
            entry["rates"][f"{rate:g}"] = figures
            entry["host_s"] += host_s
        scored = _score(arr, args.devices, rates, 0.9)
        out["traces"][trace] = {"requests": len(workload.requests), "host_s": time.perf_counter() - began,
                                "best": best_of_families(scored["arrangements"]), **scored}
    return out


def best_of_families(arr: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per family, its best arrangement and goodput per device; and conditional against the better
    of pure disaggregation (either variant) and colocated."""
    best: dict[str, Any] = {}
    for name, a in arr.items():
        f = family(name)
        if f not in best or a["goodput_per_device"] > best[f]["goodput_per_device"]:
            best[f] = {"arrangement": name, "goodput_per_device": a["goodput_per_device"]}
    rivals = [best[f]["goodput_per_device"] for f in FAMILIES[:3] if f in best]
    top = max(rivals) if rivals else 0.0
    cond = best.get("conditional", {}).get("goodput_per_device", 0.0)
    best["conditional_over_best_rival"] = cond / top if top else None
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="simulate/gpu_cluster.yaml")
    p.add_argument("--device", default="h100")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--trace", action="append", metavar="NAME=PATH",
                   help="a Mooncake-format trace (kvcache-ai/Mooncake FAST25-release/traces), repeatable "
                        f"(default {SHIPPED})")
    p.add_argument("--window", type=float, default=90.0, help="the first S seconds of each trace")
    p.add_argument("--devices", type=int, default=16)
    p.add_argument("--splits", default="4,6,8,10,12", help="prefill devices of each P:D split")
    p.add_argument("--rates", default="0.5,1,2,3,4", help="requests/s per device")
    p.add_argument("--slo", default="ttft=5,tpot=50ms")
    p.add_argument("--max-uncached", type=int, default=512)
    p.add_argument("--wait-factor", default="auto")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    print(json.dumps(study(p.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
