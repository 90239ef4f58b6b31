"""`pdserve bench --autoscale`: the planner against static arrangements, on the live cluster.

The workload is replayed once on `--config`'s cluster with `router.autoscale.enabled` (the
router's own `Autoscaler` runs the same `Planner` as `pdserve simulate --autoscale`, applying its
decisions through the pool manager) and once on each static arrangement of `--statics`, each a
fresh cluster (`LocalCluster`: new router and workers, cold caches). Every worker's life is
recorded at the pool manager's start and kill calls (bench/accounting.py `RecordingActors`), and
each run is scored by the same `figures` into the same `--json` schema as the simulated one.

Under `--emulate` at time_scale K the router's clock is real: the arrivals are stretched by K,
and so are the planner's SLOs and pacing (interval, cooldowns, warm-up) and its cost-model
profile (the emulated device with K times less bandwidth and FLOP/s and K times the per-step
overhead, handed to it as a `measured` profile); every figure is divided back to emulated seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.accounting import USD_PER_HOUR, RecordingActors, figures, timeline
from bench.autoscale_compare import (
    AUTOSCALED,
    autoscaled_config,
    format_comparison,
    named_statics,
    static_shapes,
    verdict,
)
from bench.client import replay
from bench.emulation import assumptions, collect_emulation, contract_records, dilate, fidelity
from bench.errors import BenchError
from bench.metrics import Slo, parse_slo
from bench.workload import Workload
from router.config.emulate import device_profile
from router.config.schema import ClusterConfig

RAY_START_S = 60.0  # a local Ray instance and the router's channels, on top of the workers' start
STRETCHED = ("ttft_s", "itl_s", "interval_s", "scale_up_cooldown_s", "scale_down_cooldown_s", "warmup_s")


def add_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the planner against static arrangements (--autoscale, with --config)")
    group.add_argument("--autoscale", action="store_true",
                       help="replay once with --config's router.autoscale on and once per --statics arrangement "
                            "(each a fresh cluster); needs --slo")
    group.add_argument("--statics", metavar="NAMES",
                       help="with --autoscale: the static arrangements, e.g. 1P1D,2P1D,colocated-2")
    group.add_argument("--attainment", type=float, default=0.9,
                       help="with --autoscale: the SLO attainment a static arrangement must reach (default 0.9)")


def check_flags(args: argparse.Namespace) -> bool:
    """True when this is an --autoscale run; BenchError for flags that do not fit it."""
    if not args.autoscale:
        if args.statics is not None:
            raise BenchError("--statics names the static arrangements of --autoscale: give --autoscale too")
        return False
    if not args.config:
        raise BenchError("--autoscale needs --config: the bench starts the clusters it compares")
    for flag, value in (("--arrangements", args.arrangements), ("--policies", args.policies)):
        if value is not None:
            raise BenchError(f"--autoscale compares the planner with --statics; {flag} does not apply")
    if not args.statics:
        raise BenchError("--autoscale needs --statics, e.g. 1P1D,2P1D: the static arrangements to compare with")
    static_shapes(args.statics)
    slo = parse_slo(args.slo)
    if not slo.ttft_s and not slo.tpot_s and not slo.e2e_s:
        raise BenchError("--autoscale scores every run by its SLO: give --slo, e.g. ttft=2,tpot=50ms")
    if not 0 < args.attainment <= 1:
        raise BenchError(f"--attainment {args.attainment:g}: must be in (0, 1]")
    return True


def run(args: argparse.Namespace, base: ClusterConfig, workload: Workload, slo: Slo) -> int:
    """Every run in turn, then the table (or the --json result); autoscale.json under --out."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = {AUTOSCALED: planner_config(base, out)} | {name: _own_ports(cfg)
                                                         for name, cfg in named_statics(base, args.statics).items()}
    price = args.cost_per_worker_hour or USD_PER_HOUR.get(base.emulate.device or "")
    rows, timelines, emulated = {}, {}, {}
    for name, cfg in configs.items():
        rows[name], timelines[name], emulated[name] = measure(name, cfg, workload, slo, price, args)
    result = verdict(rows.pop(AUTOSCALED), rows, args.attainment)
    print(json.dumps(result, indent=2) if args.json else format_comparison(result, args.attainment))
    record = result | {"timeline": timelines[AUTOSCALED], "workload": workload.describe(),
                       "usd_per_worker_hour": price, "attainment_target": args.attainment,
                       "emulation": {name: f for name, f in emulated.items() if f is not None},
                       "planner": dataclasses.asdict(configs[AUTOSCALED].router.autoscale)}
    (out / "autoscale.json").write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {out / 'autoscale.json'}", file=sys.stderr)
    return 0


def planner_config(base: ClusterConfig, out: Path) -> ClusterConfig:
    """`base` with its planner on; at time_scale K its SLOs, pacing and cost-model profile stretched by K."""
    k = base.emulate.time_scale if base.emulate.device else 1.0
    auto = base.router.autoscale
    changes: dict[str, Any] = {key: getattr(auto, key) * k for key in STRETCHED} if k != 1 else {}
    if k != 1 and auto.profile == "cost_model":
        changes |= {"profile": "measured", "measured_profile": str(_stretched_profile(base, k, out))}
    return _own_ports(autoscaled_config(base, **changes))


def _stretched_profile(base: ClusterConfig, k: float, out: Path) -> Path:
    """The emulated device as the router's clock sees it at time_scale k: every step k times longer."""
    em, device = base.emulate, device_profile(base.emulate)
    section = {"device": "custom", "model": em.model, "dtype": em.dtype, "memory": device.memory,
               "bandwidth": f"{device.bandwidth / k:.9e}", "flops": f"{device.flops / k:.9e}",
               "bandwidth_efficiency": em.bandwidth_efficiency, "compute_efficiency": em.compute_efficiency,
               "step_overhead_s": em.step_overhead_s * k, "overhead": em.overhead}
    path = out / f"planner_profile_x{k:g}.yaml"
    path.write_text(yaml.safe_dump({"emulate": section}))
    return path.resolve()


def _own_ports(cfg: ClusterConfig) -> ClusterConfig:
    """Free ports of its own, so a `pdserve serve` of the same config can keep running."""
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, port=0, metrics_port=None, http_port=None))


def measure(name: str, cfg: ClusterConfig, workload: Workload, slo: Slo, price: float | None,
            args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """One fresh cluster: (its row S, its timeline, its emulation fidelity or None)."""
    from router.launch import LocalCluster
    from router.pools.actors import RayActors

    k = cfg.emulate.time_scale if cfg.emulate.device else 1.0
    actors = RecordingActors(RayActors())
    with LocalCluster(cfg, start_timeout_s=cfg.router.worker_start_timeout_s + RAY_START_S, actors=actors) as cluster:
        t0 = time.monotonic()  # the router's clock (protocol.clock: its loop's, monotonic); the replay starts now
        replayed = asyncio.run(replay(cluster.address, dilate(workload, k), name, connect_timeout_s=args.connect_timeout,
                                      show_progress=not args.no_progress))
        end = time.monotonic()
        autoscaler = cluster.router.autoscaler
        decisions = None if autoscaler is None else [_back(dataclasses.asdict(d), t0, k) for d in autoscaler.decisions
                                                     if d.at <= end]
        emulated = fidelity(collect_emulation(cluster), assumptions(cfg)) if cfg.emulate.device else None
    ledger, end = actors.ledger.contracted(t0, k), t0 + (end - t0) / k
    row = figures(contract_records(replayed, k), slo, ledger, t0, end, decisions, price,
                  workload.describe().get("bursts"))
    return row, timeline(ledger, t0, end, decisions) | {"lives": [dataclasses.asdict(life) for life in ledger.lives],
                                                        "t0": t0}, emulated


def _back(decision: dict[str, Any], t0: float, k: float) -> dict[str, Any]:
    return decision | {"at": t0 + (decision["at"] - t0) / k}
