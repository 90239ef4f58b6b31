"""`pdserve bench`: replay one seeded workload and report TTFT, ITL, TPOT, E2E, goodput and
the prefix cache's hit rate against the ideal.

Measure a running router (`--router HOST:PORT`, gRPC), any OpenAI-compatible server
(`--endpoint openai:URL`: streaming /v1/completions), or start clusters of `--config` one
after another, replay the same requests against each and stop it: each arrangement at the
same total worker count (`--arrangements`), or the disaggregated cluster once per placement
policy at the same prefill + decode workers (`--policies`), every one with cold caches.
The report names what limits each run's p99 TTFT and ITL, ranks the runs at equal worker count
(goodput, SLO attainment, tokens per worker-second, cost with --cost-per-worker-hour) and
recommends one; `--report FILE.html` writes it as one page. `--autoscale` replays once with the
planner on and once per `--statics` arrangement (bench/autoscale_live.py). Input and connection
problems exit 2 with one line.
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

from bench import autoscale_live
from bench.arrangements import ARRANGEMENTS
from bench.bottleneck import collect_steps
from bench.capacity import fit, worker_capacity
from bench.client import fetch_status, replay
from bench.decision import rank, worker_counts
from bench.emulation import (
    assumptions,
    collect_emulation,
    contract_records,
    contract_steps,
    dilate,
    emulated_config,
    fidelity,
    format_fidelity,
    parse_emulate,
)
from bench.errors import BenchError
from bench.metrics import RequestRecord, ideal_hit_rate, parse_slo
from bench.openai_client import Endpoint, parse_endpoint, replay_openai
from bench.options import (
    add_cluster_options,
    add_endpoint_options,
    add_report_options,
    add_workload_options,
    workload_options,
)
from bench.presets import build_workload
from bench.report import build_summary, format_report, summarize_arrangements, write_report
from bench.workload import Workload
from client import credentials
from router.config.checks import check_host_memory
from router.config.schema import POLICIES
from router.observability.request_log import block_ids

RAY_START_S = 60.0  # a local Ray instance and the router's channels, on top of the workers' start

DEFAULT_BLOCK_SIZE = 16  # requests.jsonl's block ids without --config: kv_cache.block_size's default


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `bench` on the `pdserve` subcommand parser."""
    parser = subparsers.add_parser(
        "bench", help="replay a workload, report TTFT/ITL/TPOT/E2E and goodput",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--router", metavar="HOST:PORT", help="measure this running router over gRPC")
    target.add_argument("--endpoint", metavar="openai:URL",
                        help="measure this OpenAI-compatible server, e.g. openai:http://127.0.0.1:8000/v1")
    target.add_argument("--config", metavar="YAML", help="start each arrangement (or policy) of this cluster")
    add_cluster_options(parser)
    parser.add_argument("--label", help="the name in the report for --router / --endpoint "
                                        "(default: router / endpoint)")
    add_endpoint_options(parser)
    credentials.add_flags(parser)
    add_workload_options(parser)
    add_report_options(parser)
    autoscale_live.add_options(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Builds the workload, measures, prints the tables (or summary.json with `--json`), writes
    the report; 2 on bad input. The ideal hit rate needs the block size, so only with --config."""
    try:
        slo = parse_slo(args.slo)
        runs = _cluster_runs(args)
        base = _load_base_config(args.config) if args.config else None
        if args.emulate:
            base = emulated_config(base, *parse_emulate(args.emulate), args.emulate_time_scale, args.config)
        workload = _fitted(args, build_workload(workload_options(args, _model_limits(base))), base, runs)
        if args.autoscale:
            return autoscale_live.run(args, base, workload, slo)
        records, cluster, steps = _measure(args, workload, base, runs)
    except BenchError as err:
        print(f"pdserve bench: {err}", file=sys.stderr)
        return 2
    described, by_policy = workload.describe(), args.policies is not None
    block_size = base.kv_cache.block_size if base is not None else None
    ideal = None if block_size is None else ideal_hit_rate((r.prompt_token_ids for r in workload.requests), block_size)
    summaries = summarize_arrangements(records, slo, described.get("burst"), ideal, steps)
    for name, emulated in cluster.pop("emulation", {}).items():
        summaries[name]["emulation"] = emulated
    summary = build_summary(summaries, workload, slo, cluster, "policies" if by_policy else "arrangements")
    workers = worker_counts(cluster, list(summaries), by_config=args.config is not None)
    summary["decision"] = rank(summaries, workers, args.cost_per_worker_hour, summary["slo"])
    label = "policy" if by_policy else "arrangement"
    print(json.dumps(summary, indent=2) if args.json else format_report(summaries, label, described,
                                                                          summary["decision"]))
    if not args.json and any("emulation" in s for s in summaries.values()):
        print(_emulation_lines(summaries))
    blocks = block_size or DEFAULT_BLOCK_SIZE
    prompt_blocks = (blocks, {r.request_id: block_ids(r.prompt_token_ids, blocks) for r in workload.requests})
    written = write_report(Path(args.out), summary, records, args.plot, steps, prompt_blocks)
    if args.report:
        from bench.html_report import write_html  # matplotlib (charts) is slow to import

        written.append(write_html(Path(args.report), summary, records, steps, label))
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _emulation_lines(summaries: dict[str, Any]) -> str:
    """What was modelled (the assumptions) and how faithful each run kept to it."""
    emulated = {name: s["emulation"] for name, s in summaries.items() if "emulation" in s}
    first = next(iter(emulated.values()))
    lines = ["", f"modelled: {first['assumptions']}; measured: tokens, scheduling, queues, routing "
                 "(durations above are emulated seconds)"]
    return "\n".join(lines + [format_fidelity(name, f) for name, f in emulated.items()])


def _fitted(args: argparse.Namespace, workload: Workload, base: Any, runs: list[str]) -> Workload:
    """The workload checked against the KV pool of the clusters the bench starts (bench/capacity.py)."""
    capacity = worker_capacity(base) if runs else None
    return workload if capacity is None else fit(workload, capacity, args.clamp_to_capacity)


def _load_base_config(path: str) -> Any:
    from router.config.loader import load_config

    try:
        return load_config(path)
    except (OSError, ValueError) as err:
        raise BenchError(f"--config {path}: {err}") from err


def _model_limits(base: Any) -> tuple[int | None, int | None]:
    """(max context, vocab size) of the cluster's model: `model.max_model_len`, else its
    config.json (creating the embedded tiny model first when the config asks for it)."""
    if base is None:
        return None, None
    from router.launch import ensure_model

    try:
        ensure_model(base)
        config = json.loads((Path(base.model.path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BenchError(f"model {base.model.path}: {err}") from err
    max_context = base.model.max_model_len or config.get("max_position_embeddings")
    return max_context, config.get("vocab_size")


def _names(flag: str, text: str, known: tuple[str, ...]) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    twice = sorted({name for name in names if names.count(name) > 1})
    if unknown or twice or not names:
        problem = f"unknown {unknown}" if unknown else f"twice {twice}" if twice else "none given"
        raise BenchError(f"{flag}: {problem}; choose from {', '.join(known)}")
    return names


def _cluster_runs(args: argparse.Namespace) -> list[str]:
    """The arrangements or policies to start, checked before anything starts; [] without --config."""
    given = [flag for flag, value in (("--arrangements", args.arrangements), ("--policies", args.policies),
                                      ("--prefix-caching", args.prefix_caching)) if value is not None]
    if args.policies is None and args.decode_workers:
        raise BenchError("--decode-workers sizes the --policies clusters (--arrangements: --workers "
                         "and --prefill-workers; the rest decode)")
    if args.emulate_time_scale is not None and not args.emulate:
        raise BenchError("--emulate-time-scale needs --emulate")
    if autoscale_live.check_flags(args):
        return ["autoscaled"]
    if not args.config:
        if args.emulate:
            given.append("--emulate")
        if given:
            raise BenchError(f"{given[0]} needs --config: the bench starts the clusters it compares")
        return []
    if args.policies is not None:
        if args.arrangements is not None:
            raise BenchError("--policies and --arrangements exclude each other: give one")
        return _names("--policies", args.policies, POLICIES)
    return _names("--arrangements", args.arrangements or ",".join(ARRANGEMENTS), ARRANGEMENTS)


def _measure(args: argparse.Namespace, workload: Workload, base: Any, runs: list[str]
             ) -> tuple[dict[str, list[RequestRecord]], dict[str, Any], dict[str, dict[str, Any]]]:
    """(records per run, what the report says about the server, step records per run and worker:
    only for clusters the bench starts itself)."""
    if args.router:
        label = args.label or "router"
        records, status = asyncio.run(_measure_address(args, args.router, label, workload))
        return {label: records}, {"router": args.router, "status": status}, {}
    if args.endpoint:
        label = args.label or "endpoint"
        url = parse_endpoint(args.endpoint)
        endpoint = Endpoint(url, args.model, args.extra_body, args.tokenizer, credentials.target_from_args(url, args))
        records, server = asyncio.run(replay_openai(endpoint, workload, label,
                                                    connect_timeout_s=args.connect_timeout,
                                                    show_progress=not args.no_progress))
        return {label: records}, server, {}
    return _measure_clusters(args, workload, *_cluster_configs(args, base, runs))


async def _measure_address(args: argparse.Namespace, address: str, label: str,
                           workload: Workload) -> tuple[list[RequestRecord], dict[str, Any]]:
    target = credentials.target_from_args(address, args)
    records = await replay(target, workload, label, connect_timeout_s=args.connect_timeout,
                           show_progress=not args.no_progress)
    return records, await fetch_status(target)


def _cluster_configs(args: argparse.Namespace, base: Any,
                     runs: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config of every cluster to start (each on its own free port, so a `pdserve serve`
    of the same config can keep running), and what the report says about them."""
    from bench.arrangements import arrangement_config, policy_config

    if args.prefix_caching is not None:
        base = dataclasses.replace(base, kv_cache=dataclasses.replace(
            base.kv_cache, prefix_caching=args.prefix_caching == "on"))
    info = {"config": args.config, "block_size": base.kv_cache.block_size,
            "prefix_caching": base.kv_cache.prefix_caching}
    if args.policies is not None:
        prefill = args.prefill_workers or args.workers // 2
        decode = args.decode_workers or max(1, args.workers - prefill)
        info |= {"prefill_workers": prefill, "decode_workers": decode}
        flag, make = "--policies", lambda name: policy_config(base, name, prefill, decode, args.pin_cpus)
    else:
        info |= {"workers": args.workers} | ({"prefill_workers": args.prefill_workers} if args.prefill_workers else {})
        flag, make = "--arrangements", lambda name: arrangement_config(base, name, args.workers, args.pin_cpus,
                                                                       args.prefill_workers)
    configs = {}
    for name in runs:
        try:
            cfg = make(name)
        except ValueError as err:
            raise BenchError(f"{flag} {name}: {err}") from err
        if cfg.emulate.device:  # this run's worker count: its emulated pools must fit this host
            try:
                check_host_memory(cfg, f"{flag} {name}")
            except ValueError as err:
                raise BenchError(str(err)) from err
        configs[name] = dataclasses.replace(cfg, router=dataclasses.replace(
            cfg.router, port=0, metrics_port=None, http_port=None))
    return configs, info


def _measure_clusters(args: argparse.Namespace, workload: Workload, configs: dict[str, Any], info: dict[str, Any]
                      ) -> tuple[dict[str, list[RequestRecord]], dict[str, Any], dict[str, dict[str, Any]]]:
    """Each cluster in turn: start it (cold caches), replay the same requests, collect its
    workers' step records, stop it."""
    from router.launch import LocalCluster

    records: dict[str, list[RequestRecord]] = {}
    statuses: dict[str, Any] = {}
    steps: dict[str, dict[str, Any]] = {}
    emulated: dict[str, dict[str, Any]] = {}
    for name, cfg in configs.items():
        k = cfg.emulate.time_scale if cfg.emulate.device else 1.0  # time dilation (bench/emulation.py)
        # the router gives each worker worker_start_timeout_s (an emulated weights load included)
        # before it gives up on it; Ray's own start comes on top, many workers on few cores are slow
        with LocalCluster(cfg, start_timeout_s=cfg.router.worker_start_timeout_s + RAY_START_S) as cluster:
            started = time.time()  # the replay's clock starts within the channel's setup (ms) of this
            replayed, statuses[name] = asyncio.run(
                _measure_address(args, cluster.address, name, dilate(workload, k)))
            records[name] = contract_records(replayed, k)
            steps[name] = contract_steps(collect_steps(cluster, started), k)
            if cfg.emulate.device:
                emulated[name] = fidelity(collect_emulation(cluster), assumptions(cfg))
    return records, info | {"status": statuses} | ({"emulation": emulated} if emulated else {}), steps

