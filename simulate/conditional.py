"""Conditional disaggregation measured: `python -m simulate.conditional --json`.

For each workload (a Mooncake-format trace's first `--window` s, or a preset, `--preset`), at N
simulated devices, `pdserve simulate --sweep`'s study (every rate, scored by the SLO: attainment,
knee, goodput per device at SLO) over these families of arrangements: colocated (chunked); pure
disaggregation at each P:D split, with whole prompts (`disaggregated`), with chunked prefill
(`disaggregated-chunked`), and chunked with router.decode_reservation: after_prefill
(`disaggregated-after`; with whole prompts, as `--sweep`'s splits: `disaggregated-whole-after`); and conditional disaggregation, the chunked split with
`router.local_prefill` on (`conditional`: the decode worker prefills a request whose uncached part
is at most `--max-uncached` tokens, or whose prefill pool is backed up past `--wait-factor` x the
local cost), also with after_prefill (`conditional-after`). It prints, per workload, each
arrangement's figures and the best of each family: the target is the best conditional family >=
the best of the others (pure disaggregation of any kind, and colocated). `--partial FILE` appends
each run's figures as a JSON line as it finishes (a stopped study keeps what it ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

from bench.arrangements import arrangement_config
from bench.metrics import parse_slo
from bench.presets import WorkloadOptions, build_workload
from bench.workload import Workload
from router.config.loader import load_config
from router.config.schema import ClusterConfig
from simulate.cli import emulated
from simulate.parallel import run_jobs
from simulate.sweep import _one, _score

SHIPPED = "conversation=bench/data/conversation_window.jsonl"  # Mooncake's conversation trace, first 120 s
FAMILIES = ("colocated", "disaggregated", "disaggregated-chunked", "disaggregated-after", "disaggregated-whole-after",
            "conditional", "conditional-after")
RIVALS = FAMILIES[:5]  # conditional disaggregation is measured against the best of these


def family(name: str) -> str:
    return name.rsplit("-", 1)[0] if name.startswith(("disaggregated", "conditional")) else "colocated"


def with_local_prefill(cfg: ClusterConfig, max_uncached: int, wait: str | float) -> ClusterConfig:
    local = dataclasses.replace(cfg.router.local_prefill, max_uncached_tokens=max_uncached,
                                when_prefill_wait_exceeds=wait)
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, local_prefill=local))


def after_prefill(cfg: ClusterConfig) -> ClusterConfig:
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, decode_reservation="after_prefill"))


def arrangements(base: ClusterConfig, n: int, splits: list[int], max_uncached: int,
                 wait: str | float, families: tuple[str, ...] = FAMILIES) -> dict[str, ClusterConfig]:
    out = {f"colocated-{n}": arrangement_config(base, "colocated-chunked", n)}
    for p in splits:
        split = f"{p}P{n - p}D"
        out[f"disaggregated-{split}"] = arrangement_config(base, "disaggregated", n, prefill_workers=p)
        chunked = arrangement_config(base, "disaggregated-chunked", n, prefill_workers=p)
        out[f"disaggregated-chunked-{split}"] = chunked
        out[f"disaggregated-after-{split}"] = after_prefill(chunked)
        out[f"disaggregated-whole-after-{split}"] = after_prefill(out[f"disaggregated-{split}"])  # as the sweep's splits
        out[f"conditional-{split}"] = with_local_prefill(chunked, max_uncached, wait)
        out[f"conditional-after-{split}"] = after_prefill(out[f"conditional-{split}"])
    return {name: cfg for name, cfg in out.items() if family(name) in families}


def workloads(args: argparse.Namespace) -> list[tuple[str, Workload]]:
    """The traces' windows (full lengths), then the presets (`NAME=PRESET,REQUESTS,INPUT,OUTPUT`)."""
    out = [(name, build_workload(WorkloadOptions(trace=path, length_scale=1.0, window=(0.0, args.window),
                                                 max_context=131072)))
           for name, _, path in (t.partition("=") for t in args.trace or ([] if args.preset else [SHIPPED]))]
    for spec in args.preset or []:
        name, _, fields = spec.partition("=")
        preset, num, inp, outp = fields.split(",")
        out.append((name, build_workload(WorkloadOptions(preset=preset, num_requests=int(num), rate=10.0,
                                                         input_len=int(inp), output_len=int(outp),
                                                         max_context=131072))))
    return out


def _run_all(jobs: list[tuple], processes: int, partial: str | None) -> list[tuple]:
    """Every job's `_one`, on `processes` processes; each result appended to `partial` as it ends."""
    def keep(result: tuple) -> tuple:
        if partial:
            name, n, rate, figures, host_s = result
            with open(partial, "a") as f:
                f.write(json.dumps({"arrangement": name, "devices": n, "rate": rate, "host_s": host_s,
                                    **figures}) + "\n")
        return result
    return [keep(result) for result in run_jobs(_one, jobs, processes, ordered=False)]


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
    for trace, workload in workloads(args):
        jobs = [(name, args.devices, rate, cfg, em, workload, slo, args.seed) for name, cfg in configs.items()
                for rate in rates]
        began = time.perf_counter()
        results = _run_all(jobs, args.processes, args.partial and f"{args.partial}.{trace}")
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
    """Per family, its best arrangement and goodput per device; and the best conditional family
    against the best of pure disaggregation (any variant) and colocated."""
    best: dict[str, Any] = {}
    for name, a in arr.items():
        f = family(name)
        if f not in best or a["goodput_per_device"] > best[f]["goodput_per_device"]:
            best[f] = {"arrangement": name, "goodput_per_device": a["goodput_per_device"]}
    rivals = [best[f]["goodput_per_device"] for f in RIVALS if f in best]
    top = max(rivals) if rivals else 0.0
    cond = max((best[f]["goodput_per_device"] for f in FAMILIES if f not in RIVALS and f in best), default=0.0)
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
    p.add_argument("--preset", action="append", metavar="NAME=PRESET,REQUESTS,INPUT,OUTPUT",
                   help="a preset workload (bench/presets.py), repeatable: e.g. prompts=diurnal,800,4096,64")
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
    p.add_argument("--partial", metavar="FILE", help="append each run's figures to FILE.<workload> as it ends")
    print(json.dumps(study(p.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
