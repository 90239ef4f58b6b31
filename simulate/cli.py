"""`pdserve simulate`: the cluster of a config, on an emulated device, on a virtual clock.

    pdserve simulate --config cluster.yaml --emulate h100:llama-3.1-8b --trace T.jsonl --workers 16
    pdserve simulate --config cluster.yaml --emulate h100:llama-3.1-8b --preset steady --rate 40 --duration 60
    pdserve simulate --config cluster.yaml --emulate h100:llama-3.1-8b --preset diurnal --rate 32 \
        --autoscale --sizes 16 --splits eighths --slo ttft=2,tpot=50ms

Each arrangement (`--arrangements`, at `--workers` devices, as `pdserve bench` rearranges them)
runs in this process on a virtual clock: the router's own admission, placement and request
lifecycle, and each worker's own scheduler and KV cache manager (simulate/__init__.py). A step
takes the cost model's time for its shape, a KV piece the link model's. The report is bench's:
the same tables, summary.json (`--json`: bench's schema), requests.jsonl, plots and HTML, with
`simulation` added (simulated and host seconds, and the error docs/simulate.md measured). Two
runs with one `--seed` print the same JSON. `--sweep` runs the seed's study (simulate/sweep.py);
`--autoscale` the planner against each static arrangement (simulate/autoscale.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.arrangements import ARRANGEMENTS, arrangement_config
from bench.decision import rank
from bench.emulation import parse_emulate
from bench.errors import BenchError
from bench.metrics import ideal_hit_rate, parse_slo
from bench.options import (
    add_report_options,
    add_workload_options,
    positive_float,
    positive_int,
    workload_options,
)
from bench.presets import build_workload
from bench.report import build_summary, format_report, summarize_arrangements, write_report
from bench.workload import Workload
from protocol.sizes import PlanError, parse_bytes
from router.config.emulate import CUSTOM, EmulateSection, check_emulate, emulation
from router.config.schema import ClusterConfig
from router.config.typed_yaml import ConfigError
from simulate.host import serving_fit
from sizing.cost_model import Emulation

if TYPE_CHECKING:
    from simulate.run import SimRun

FIDELITY = Path(__file__).with_name("fidelity.json")  # written by `python -m simulate.fidelity --record`


def measured_error() -> dict[str, Any]:
    """The simulator's last measured error (docs/simulate.md, Fidelity), as recorded with the
    date, host and commands; {} before any was recorded."""
    try:
        return json.loads(FIDELITY.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="the cluster's own router and schedulers on a virtual clock: 8-64 emulated devices",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, metavar="YAML", help="the cluster to simulate")
    parser.add_argument("--emulate", required=True, metavar="DEVICE:MODEL",
                        help="e.g. h100:llama-3.1-8b; `host`: this host measured running the config's checkpoint; "
                             "`steps:FILE[@ARRANGEMENT]`: this host fitted to a real run's steps.jsonl (pdserve bench); "
                             "`run:DIR[@ARRANGEMENT]`: the same, and the host's serving path fitted to the run's "
                             "requests (simulate/serving.py); "
                             "`config`: the config's own emulate: section")
    parser.add_argument("--arrangements", metavar="NAMES",
                        help=f"comma-separated, of {', '.join(ARRANGEMENTS)} (default: the config's own cluster)")
    parser.add_argument("--workers", type=positive_int, help="devices of every arrangement (with --arrangements)")
    parser.add_argument("--prefill-workers", type=positive_int,
                        help="prefill devices of a disaggregated arrangement (default half of --workers)")
    parser.add_argument("--duration", type=positive_float, metavar="S",
                        help="simulated seconds of arrivals: a trace's first S seconds, or rate x S requests")
    parser.add_argument("--rpc-latency", type=float, default=None, metavar="S",
                        help="one-way router <-> worker call latency (default 0.0002)")
    sweep = parser.add_argument_group("the study (--sweep): every arrangement at every size and rate")
    sweep.add_argument("--sweep", action="store_true",
                       help="colocated (chunked) and disaggregated at every P:D split, at each --sizes and --rates; "
                            "needs --slo")
    sweep.add_argument("--sizes", default="8,16,32,64", metavar="N,N", help="devices per cluster (default 8,16,32,64)")
    sweep.add_argument("--rates", default="0.25,0.5,1,2,4,8", metavar="R,R",
                       help="requests/s per device, the workload's arrivals scaled to each (default 0.25,...,8)")
    sweep.add_argument("--splits", choices=("all", "eighths"), default="all",
                       help="P:D splits: every P from 1 to N-1, or P in N/8 steps (default all)")
    sweep.add_argument("--attainment", type=positive_float, default=0.9,
                       help="the share of requests within the SLO a rate must keep (default 0.9)")
    sweep.add_argument("--processes", type=positive_int, help="runs at once (default: this host's cores)")
    scaled = parser.add_argument_group("the planner (--autoscale) against static arrangements of --sizes / --splits")
    scaled.add_argument("--autoscale", action="store_true",
                        help="replay once with the config's router.autoscale on and once per static arrangement; "
                             "needs --slo")
    scaled.add_argument("--statics", metavar="NAMES",
                        help="the static arrangements, e.g. colocated-16,8P8D,10P6D (default: every arrangement "
                             "of --sizes by --splits)")
    add_workload_options(parser)
    add_report_options(parser)
    parser.set_defaults(func=run, out="simulate-out")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        slo = parse_slo(args.slo)
        base = _load(args.config)
        base, em = emulated(base, _emulate_section(base, args.emulate), args.config)
        serving = serving_fit(args.emulate, em)
        configs = cluster_configs(base, args.arrangements, args.workers, args.prefill_workers)
        workload = build_workload(workload_options(_with_duration(args), (em.cost.shape.max_positions,
                                                                           em.cost.shape.vocab_size)))
    except (BenchError, ConfigError, ValueError) as err:
        print(f"pdserve simulate: {err}", file=sys.stderr)
        return 2
    if args.sweep:
        return _sweep(args, base, em, workload, slo)
    if args.autoscale:
        from simulate.autoscale_cli import run_autoscale

        return run_autoscale(args, base, em, workload, slo)
    from simulate.run import simulate  # the router's own code: imported for a run, not for --help

    runs = {name: simulate(cfg, em, workload, name, args.seed, args.rpc_latency, serving=serving)
            for name, cfg in configs.items()}
    summary, records, steps = report(runs, workload, slo, base, em, configs, args.cost_per_worker_hour)
    if serving is not None:
        summary["simulation"]["serving"] = serving.describe()
    print(json.dumps(summary, indent=2) if args.json else
          format_report({n: summary["arrangements"][n] for n in runs}, "arrangement", workload.describe(),
                        summary["decision"]) + "\n" + format_speed(summary["simulation"]))
    for name, r in runs.items():  # host time varies from run to run: not in the JSON, which a seed fixes
        print(f"simulate: {name}: {r.simulated_s:.1f} simulated s in {r.host_s:.1f} host s "
              f"({r.simulated_s / max(r.host_s, 1e-9):.2f}x real time)", file=sys.stderr)
    written = write_report(Path(args.out), summary, records, args.plot, steps)
    if args.report:
        from bench.html_report import write_html

        written.append(write_html(Path(args.report), summary, records, steps, "arrangement"))
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _sweep(args: argparse.Namespace, base: ClusterConfig, em: Emulation, workload: Workload, slo: Any) -> int:
    from simulate.sweep import format_sweep, plot_sweep, sweep

    try:
        sizes = [int(v) for v in args.sizes.split(",")]
        rates = [float(v) for v in args.rates.split(",")]
        if not slo.ttft_s and not slo.tpot_s and not slo.e2e_s:
            raise BenchError("--sweep scores arrangements by their SLO: give --slo, e.g. ttft=2,tpot=50ms")
        if any(n < 2 for n in sizes) or any(r <= 0 for r in rates):
            raise BenchError("--sizes need at least 2 devices each and --rates positive values")
    except ValueError as err:
        print(f"pdserve simulate: --sizes / --rates: {err}", file=sys.stderr)
        return 2
    except BenchError as err:
        print(f"pdserve simulate: {err}", file=sys.stderr)
        return 2
    result = sweep(base, em, workload, sizes, rates, slo, args.seed, args.splits, args.attainment, args.processes)
    result["workload"], result["assumptions"] = workload.describe(), em.assumptions()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if args.json else format_sweep(result))
    try:
        print(f"wrote {plot_sweep(result, str(out / 'sweep.png'))}", file=sys.stderr)
    except ImportError:
        print("pdserve simulate: no plot (matplotlib is not installed: pip install pdserve[plot])", file=sys.stderr)
    print(f"wrote {out / 'sweep.json'}", file=sys.stderr)
    return 0


def _load(path: str) -> ClusterConfig:
    from router.config.loader import load_config

    try:
        return load_config(path)
    except (OSError, ValueError) as err:
        raise BenchError(f"--config {path}: {err}") from err


def _emulate_section(base: ClusterConfig, text: str) -> EmulateSection:
    """DEVICE:MODEL; `host`: this host measured running the config's checkpoint (simulate/host.py);
    `config`: the config's own emulate: section as it is (a custom device, a saved host fit)."""
    if text == "host" or text.startswith(("steps:", "run:")):
        from simulate.host import host_section, recorded_run

        return host_section(base, steps=None if text == "host" else recorded_run(text))[0]
    if text == "config":
        if base.emulate.device is None:
            raise BenchError("--emulate config: the config has no emulate: section (emulate.device is null)")
        return base.emulate
    device, model = parse_emulate(text)
    return dataclasses.replace(base.emulate, device=device, model=model)


def emulated(base: ClusterConfig, sec: EmulateSection, where: str) -> tuple[ClusterConfig, Emulation]:
    """The config emulating `sec`, at time_scale 1 (simulated time is emulated time), with the
    KV pool the emulated device leaves; and the resolved emulation. No host memory check: a
    simulation allocates no KV."""
    sec = dataclasses.replace(sec, time_scale=1.0)
    try:
        check_emulate(sec, base.kv_cache.block_size, where)
        em = emulation(sec)
    except (ConfigError, PlanError) as err:
        raise BenchError(str(err)) from None
    kv = base.kv_cache
    if sec.device == CUSTOM and kv.memory and not kv.num_blocks:  # the host itself: the config's own pool
        block_bytes = kv.block_size * em.cost.kv_bytes_per_token
        kv = dataclasses.replace(kv, memory=None, num_blocks=parse_bytes(kv.memory) // block_bytes)
    elif sec.device != CUSTOM:  # an emulated device's pool: what the model leaves of its memory
        kv = dataclasses.replace(kv, memory=None, num_blocks=None)
    return dataclasses.replace(base, emulate=sec, kv_cache=kv), em


def cluster_configs(base: ClusterConfig, arrangements: str | None, workers: int | None,
                    prefill_workers: int | None) -> dict[str, ClusterConfig]:
    """The config's own cluster (named by its mode), or each arrangement at `workers` devices."""
    if arrangements is None:
        if workers or prefill_workers:
            raise BenchError("--workers and --prefill-workers size --arrangements; without it the config's "
                             "pools run as they are")
        return {base.mode: base}
    names = [n.strip() for n in arrangements.split(",") if n.strip()]
    out = {}
    for name in names:
        label = name if not name.startswith("disaggregated") or prefill_workers is None else \
            f"{name}-{prefill_workers}P{(workers or 2) - prefill_workers}D"
        try:
            out[label] = arrangement_config(base, name, workers or 2, False, prefill_workers)
        except ValueError as err:
            raise BenchError(f"--arrangements {name}: {err}") from err
    return out


def _with_duration(args: argparse.Namespace) -> argparse.Namespace:
    """--duration as bench's options: a trace's window end, or a preset's request count."""
    if args.duration is None:
        return args
    if args.trace or args.preset == "conversation":
        start = float(args.window.partition(":")[0] or 0)
        return argparse.Namespace(**vars(args) | {"window": f"{start:g}:{start + args.duration:g}"})
    if args.rate is None:
        raise BenchError("--duration with a preset needs --rate (requests = rate x duration)")
    return argparse.Namespace(**vars(args) | {"num_requests": max(1, round(args.rate * args.duration))})


def report(runs: dict[str, SimRun], workload: Workload, slo: Any, base: ClusterConfig, em: Emulation,
           configs: dict[str, ClusterConfig], cost_per_worker_hour: float | None = None) -> tuple[dict[str, Any], dict, dict]:
    """bench's summary of the runs, with `simulation`: what each run simulated and what it cost."""
    records = {name: r.records for name, r in runs.items()}
    steps = {name: r.steps for name, r in runs.items()}
    ideal = ideal_hit_rate((r.prompt_token_ids for r in workload.requests), base.kv_cache.block_size)
    summaries = summarize_arrangements(records, slo, workload.describe().get("burst"), ideal, steps)
    info = {"config": "simulated", "block_size": base.kv_cache.block_size,
            "prefix_caching": base.kv_cache.prefix_caching}
    summary = build_summary(summaries, workload, slo, info, "arrangements")
    workers = {name: cfg.decode.replicas + (cfg.prefill.replicas if cfg.mode == "disaggregated" else 0)
               for name, cfg in configs.items()}
    summary["decision"] = rank(summaries, workers, cost_per_worker_hour, summary["slo"])
    summary["created_unix_s"] = None  # a seed fixes the whole JSON; the files' own times say when it ran
    summary["simulation"] = {
        "assumptions": em.assumptions(), "error": measured_error(),
        "runs": {name: {"workers": workers[name], "simulated_s": round(r.simulated_s, 6),
                        "kv_pieces": r.link["pieces"], "kv_link_busy_s": round(r.link["busy_s"], 6)}
                 for name, r in runs.items()}}
    return summary, records, steps


def format_error(error: dict[str, Any]) -> list[str]:
    """The recorded error, one line per reference: the worst of its arrangements per figure."""
    if not error:
        return ["error: not measured yet (python -m simulate.fidelity --record)"]
    lines = [f"measured error of this simulator ({error.get('measured', '?')}; docs/simulate.md, Fidelity):"]
    for ref, key, label in (("vs_emulated", "arrangements", "vs the emulated cluster"),
                            ("vs_real", "arrangements", "vs the real CPU cluster, host profile"),
                            ("vs_real", "calibrated", "vs the real CPU cluster, profile fitted to its steps"),
                            ("vs_real", "served", "vs the real CPU cluster, steps and serving path fitted")):
        rows = (error.get(ref) or {}).get(key) or {}
        fair = {name: r for name, r in rows.items() if not r.get("reference_disturbed")}
        if fair:
            worst = {k: max((r[k]["error"] for r in fair.values() if r[k]["error"] is not None), key=abs)
                     for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}
            lines.append(f"  {label} (worst arrangement): " + ", ".join(f"{k} {v:+.0%}" for k, v in worst.items()))
        lines += [f"  {label}, {name}: left out, the reference run was disturbed ({r['reference_disturbed']})"
                  for name, r in rows.items() if r.get("reference_disturbed")]
    return lines


def format_speed(sim: dict[str, Any]) -> str:
    lines = ["", f"simulated: {sim['assumptions']}", *format_error(sim["error"])]
    for name, r in sim["runs"].items():
        lines.append(f"{name:<28} {r['workers']} devices, {r['simulated_s']:.1f} simulated s")
    return "\n".join(lines)
