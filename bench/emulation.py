"""`pdserve bench --emulate DEVICE:MODEL`: run the clusters at an emulated device's timings
(docs/architecture.md, "Emulation") and say how faithful the run was.

Time dilation: with `time_scale` k every modelled duration is k times longer on the workers, so
the workload's arrivals are stretched by k before the replay and every duration the client and
the workers measured is divided by k afterwards; the report reads in emulated seconds. Fidelity:
each worker counts the steps whose real work outlasted their modelled time x k (overruns); a run
with more than `FAITHFUL_OVERRUN_SHARE` of its steps overrun is marked not faithful, with the
time_scale that would have kept 99% of every worker's steps within their model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from bench.errors import BenchError
from bench.metrics import RequestRecord
from bench.workload import Workload
from protocol.deadline import within
from protocol.sizes import PlanError
from protocol.telemetry import EmulationStats
from router.config.checks import check_host_memory
from router.config.emulate import check_emulate, emulation
from router.config.schema import ClusterConfig
from router.config.typed_yaml import ConfigError
from sizing.devices import DEVICES
from sizing.memory import BUILTIN_SHAPES

FAITHFUL_OVERRUN_SHARE = 0.01


def parse_emulate(text: str) -> tuple[str, str]:
    """'h100:llama-3.1-8b' -> ('h100', 'llama-3.1-8b'), names checked."""
    device, sep, model = (part.strip() for part in text.partition(":"))
    if not sep or device not in DEVICES or model not in BUILTIN_SHAPES:
        raise BenchError(f"--emulate {text!r}: expected DEVICE:MODEL with DEVICE one of {', '.join(DEVICES)} "
                         f"and MODEL one of {', '.join(BUILTIN_SHAPES)}")
    return device, model


def emulated_config(base: ClusterConfig, device: str, model: str, time_scale: float | None,
                    where: str) -> ClusterConfig:
    """The base config with emulation on (its other emulate keys kept), checked like a loaded one."""
    sec = dataclasses.replace(base.emulate, device=device, model=model,
                              time_scale=base.emulate.time_scale if time_scale is None else time_scale)
    cfg = dataclasses.replace(base, emulate=sec)
    try:
        check_emulate(sec, cfg.kv_cache.block_size, where)
        check_host_memory(cfg, where)
    except ConfigError as err:
        raise BenchError(str(err)) from None
    return cfg


def assumptions(cfg: ClusterConfig) -> str:
    try:
        em = emulation(cfg.emulate)
    except PlanError as err:  # checked at load: not reached
        raise BenchError(str(err)) from None
    return em.assumptions() if em is not None else ""


# ---- time dilation ----------------------------------------------------------------------
def dilate(workload: Workload, k: float) -> Workload:
    """The same requests arriving k times further apart."""
    if k == 1:
        return workload
    return dataclasses.replace(workload, requests=tuple(
        dataclasses.replace(r, arrival_s=r.arrival_s * k) for r in workload.requests))


def contract_records(records: Sequence[RequestRecord], k: float) -> list[RequestRecord]:
    """Client times and the usage's durations (`*_ms`) divided by k: back to emulated seconds."""
    if k == 1:
        return list(records)
    return [dataclasses.replace(r, send_s=r.send_s / k, message_times_s=tuple(t / k for t in r.message_times_s),
                                usage={key: v / k if key.endswith("_ms") and isinstance(v, int | float) else v
                                       for key, v in r.usage.items()}) for r in records]


def contract_steps(workers: Mapping[str, Any], k: float) -> dict[str, Any]:
    """Worker step records (bench/bottleneck.collect_steps) with wall_s and t_s divided by k."""
    return {name: dict(w, steps=[dict(s, wall_s=s["wall_s"] / k, t_s=s["t_s"] / k) for s in w["steps"]])
            for name, w in workers.items()}


# ---- fidelity -------------------------------------------------------------------------
def collect_emulation(cluster: Any) -> dict[str, tuple[str, EmulationStats]]:
    """(pool, pacing counters) of every live emulating worker; one that does not answer is left out."""
    async def fetch() -> dict[str, tuple[str, EmulationStats]]:
        workers = [w for w in cluster.router.pools.all() if not w.stopped]
        replies = await asyncio.gather(*(within(w.actor.emulation.remote(), 30) for w in workers),
                                       return_exceptions=True)
        return {w.name: (w.info.pool, reply) for w, reply in zip(workers, replies, strict=True)
                if isinstance(reply, EmulationStats)}
    return cluster.call(fetch(), timeout=60)


def fidelity(workers: Mapping[str, tuple[str, EmulationStats]], assumed: str = "") -> dict[str, Any]:
    """summary.json's `emulation` of one run: the overrun shares of steps and KV transfers,
    lateness per stage (prefill and decode steps, kv_transfer; emulated ms), faithful or not, and
    the time_scale that would fix an unfaithful run."""
    stats = [s for _, s in workers.values()]
    steps, overruns = sum(s.steps for s in stats), sum(s.overruns for s in stats)
    share = overruns / steps if steps else 0.0
    scale = max((s.time_scale for s in stats), default=1.0)
    pools: dict[str, dict[str, float]] = {}
    for pool, s in workers.values():
        p = pools.setdefault(pool, {"steps": 0, "overruns": 0, "lateness_ms": 0.0, "max_lateness_ms": 0.0})
        p["steps"] += s.steps
        p["overruns"] += s.overruns
        p["lateness_ms"] += s.lateness_s / s.time_scale * 1e3
        p["max_lateness_ms"] = max(p["max_lateness_ms"], s.max_lateness_s / s.time_scale * 1e3)
    transfers, late_transfers = sum(s.transfers for s in stats), sum(s.transfer_overruns for s in stats)
    if transfers:
        pools["kv_transfer"] = {"steps": transfers, "overruns": late_transfers,
                                "lateness_ms": sum(s.transfer_lateness_s / s.time_scale for s in stats) * 1e3,
                                "max_lateness_ms": max(s.transfer_max_lateness_s / s.time_scale for s in stats) * 1e3}
    transfer_share = late_transfers / transfers if transfers else 0.0
    faithful = share <= FAITHFUL_OVERRUN_SHARE and transfer_share <= FAITHFUL_OVERRUN_SHARE
    needed = max([s.ratio_p99 for s in stats] + [s.transfer_ratio_max for s in stats
                                                if transfer_share > FAITHFUL_OVERRUN_SHARE], default=1.0)
    return {"assumptions": assumed, "time_scale": scale, "steps": steps, "overruns": overruns,
            "overrun_share": share, "transfers": transfers, "transfer_overrun_share": transfer_share,
            "faithful": faithful, "pools": pools,
            "suggested_time_scale": None if faithful else max(1.0, math.ceil(needed * 10) / 10)}


def format_fidelity(name: str, f: Mapping[str, Any]) -> str:
    """One line per run: modelled vs measured, and whether the run can be trusted."""
    late = ", ".join(f"{pool} {p['overruns']:,}/{p['steps']:,} late, {p['lateness_ms']:,.0f} ms in all "
                     f"(max {p['max_lateness_ms']:,.1f} ms)" for pool, p in f["pools"].items())
    verdict = ("faithful" if f["faithful"] else
               f"NOT faithful: rerun with time_scale {f['suggested_time_scale']:g}")
    return (f"{name:<24} {f['overruns']:,} of {f['steps']:,} steps overran their model ({f['overrun_share']:.1%}), "
            f"{f['transfer_overrun_share']:.1%} of KV transfers; {late}; {verdict}")
