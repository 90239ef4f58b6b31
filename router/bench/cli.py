"""`pdserve bench`: replay one seeded workload and report TTFT, ITL, TPOT, E2E and goodput.

Measure a running router (`--router HOST:PORT`, gRPC), any OpenAI-compatible server
(`--endpoint openai:URL`: streaming /v1/completions), or start each arrangement of `--config`
in turn at the same total worker count (`--arrangements`), replay the same requests against
it and stop it. Input and connection problems exit 2 with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.bench.client import fetch_status, replay
from router.bench.errors import BenchError, WorkloadError
from router.bench.metrics import RequestRecord, parse_slo
from router.bench.openai_client import DEFAULT_EXTRA_BODY, Endpoint, parse_endpoint, replay_openai
from router.bench.presets import PRESETS, WorkloadOptions, build_workload
from router.bench.report import build_summary, format_report, summarize_arrangements, write_report
from router.bench.trace import parse_window
from router.bench.workload import DEFAULT_VOCAB, Workload

ARRANGEMENTS = ("colocated", "colocated-chunked", "disaggregated", "disaggregated-chunked")
FALLBACK_MAX_CONTEXT = 2048


def _typed(kind: Callable[[str], Any], check: Callable[[Any], bool], what: str) -> Callable:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from err
        if not check(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


_positive_int = _typed(int, lambda v: v > 0, "a positive integer")
_positive_float = _typed(float, lambda v: v > 0, "a positive number")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `bench` on the `pdserve` subcommand parser."""
    parser = subparsers.add_parser(
        "bench", help="replay a workload, report TTFT/ITL/TPOT/E2E and goodput",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--router", metavar="HOST:PORT", help="measure this running router over gRPC")
    target.add_argument("--endpoint", metavar="openai:URL",
                        help="measure this OpenAI-compatible server, e.g. openai:http://127.0.0.1:8000/v1")
    target.add_argument("--config", metavar="YAML", help="start each arrangement of this cluster")
    parser.add_argument("--arrangements", default=",".join(ARRANGEMENTS),
                        help="comma-separated, with --config (default: all four)")
    parser.add_argument("--workers", type=_positive_int, default=2,
                        help="total workers of every arrangement (default 2)")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="with --arrangements: pin worker i of each arrangement to CPU core i")
    parser.add_argument("--label", help="the name in the report for --router / --endpoint "
                                        "(default: router / endpoint)")
    _add_endpoint_options(parser)
    _add_workload_options(parser)
    _add_report_options(parser)
    parser.set_defaults(func=run)
    return parser


def _add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI endpoint (--endpoint)")
    group.add_argument("--model", help="the request's model field (default: the first of GET /v1/models)")
    group.add_argument("--tokenizer", metavar="DIR",
                       help="the server's tokenizer: prompts go as its text when the server refuses token ids")
    group.add_argument("--extra-body", type=_json_object, default=dict(DEFAULT_EXTRA_BODY), metavar="JSON",
                       help=f"fields added to every request (default: {json.dumps(DEFAULT_EXTRA_BODY)}: exact "
                            "output lengths on pdserve, vLLM, SGLang)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--preset", choices=list(PRESETS), default="steady",
                       help="; ".join(f"{name}: {p.description}" for name, p in PRESETS.items())
                       .replace("%", "%%") + " (default: %(default)s)")
    group.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace to replay")
    group.add_argument("--length-scale", type=_positive_float,
                       help="trace lengths divided by this (conversation preset: 16)")
    group.add_argument("--time-scale", type=_positive_float,
                       help="trace timestamps divided by this (>1 replays faster)")
    group.add_argument("--window", default="0:", metavar="START:END",
                       help="seconds of the trace to replay (default all)")
    group.add_argument("--num-requests", type=_positive_int, help="requests to send (default: the preset's)")
    group.add_argument("--rate", type=_positive_float,
                       help="requests/s, Poisson or gamma (default: the preset's; none with --concurrency)")
    group.add_argument("--burstiness", type=_positive_float, default=1.0,
                       help="gamma shape; 1 = Poisson, < 1 burstier (default 1)")
    group.add_argument("--concurrency", type=_positive_int,
                       help="max requests in flight; without --rate: closed loop")
    group.add_argument("--input-len", type=_positive_int, help="mean prompt tokens (default: the preset's)")
    group.add_argument("--output-len", type=_positive_int,
                       help="output tokens of every request, exact (default: the preset's)")
    group.add_argument("--range-ratio", type=_typed(float, lambda v: 0 <= v < 1, "in [0, 1)"),
                       help="prompt lengths uniform in mean*(1 +- r) (default: the preset's)")
    group.add_argument("--max-context", type=_positive_int,
                       help="prompt + output limit (default: the model's, else 2048)")
    group.add_argument("--vocab-range", default=None, metavar="LOW:HIGH",
                       help=f"prompt token ids (default {DEFAULT_VOCAB[0]}:{DEFAULT_VOCAB[1]})")
    group.add_argument("--seed", type=int, default=0,
                       help="seeds arrivals, lengths and prompt tokens (default 0)")


def _add_report_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("report")
    group.add_argument("--slo", default="", help="per-request objectives for goodput, e.g. ttft=1.0,tpot=50ms "
                                                  "(seconds or ms; keys ttft, tpot, e2e)")
    group.add_argument("--out", default="bench-out",
                       help="directory for summary.json, requests.jsonl and charts (default: %(default)s)")
    group.add_argument("--plot", action="store_true",
                       help="also write PNG charts: TTFT and ITL CDFs, ITL over time (a panel per arrangement)")
    group.add_argument("--connect-timeout", type=_positive_float, default=10.0,
                       help="seconds to wait for each router or server (default 10)")
    group.add_argument("--no-progress", action="store_true",
                       help="no progress on stderr (a bar on a terminal, else a line every few seconds)")


def run(args: argparse.Namespace) -> int:
    """Builds the workload, measures, prints the tables, writes the report; 2 on bad input."""
    try:
        slo = parse_slo(args.slo)
        base = _load_base_config(args.config) if args.config else None
        workload = build_workload(_workload_options(args, _model_limits(base)))
        records, cluster = _measure(args, workload, base)
    except BenchError as err:
        print(f"pdserve bench: {err}", file=sys.stderr)
        return 2
    summaries = summarize_arrangements(records, slo, workload.describe().get("burst"))
    print(format_report(summaries))
    summary = build_summary(summaries, workload, slo, cluster)
    for path in write_report(Path(args.out), summary, records, args.plot):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _parse_vocab(text: str | None, model_vocab: int | None) -> tuple[int, int]:
    if text is None:
        low, high = DEFAULT_VOCAB
        return low, min(high, model_vocab) if model_vocab else high
    low, sep, high = (part.strip() for part in text.partition(":"))
    if not (sep and low.isdigit() and high.isdigit()):
        raise WorkloadError(f"--vocab-range {text!r}: expected LOW:HIGH token ids")
    return int(low), int(high)


def _workload_options(args: argparse.Namespace,
                      limits: tuple[int | None, int | None]) -> WorkloadOptions:
    max_positions, model_vocab = limits
    return WorkloadOptions(
        preset=args.preset, num_requests=args.num_requests, rate=args.rate,
        burstiness=args.burstiness, concurrency=args.concurrency, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio,
        max_context=args.max_context or max_positions or FALLBACK_MAX_CONTEXT,
        vocab=_parse_vocab(args.vocab_range, model_vocab), seed=args.seed, trace=args.trace,
        length_scale=args.length_scale, time_scale=args.time_scale,
        window=parse_window(args.window),
    )


def _load_base_config(path: str) -> Any:
    from router.config import load_config

    try:
        return load_config(path)
    except (OSError, ValueError) as err:
        raise BenchError(f"--config {path}: {err}") from err


def _model_limits(base: Any) -> tuple[int | None, int | None]:
    """(max context, vocab size) of the cluster's model: `model.max_model_len`, else its
    config.json (creating the embedded tiny model first when the config asks for it)."""
    if base is None:
        return None, None
    from router.launcher import ensure_model

    try:
        ensure_model(base)
        config = json.loads((Path(base.model.path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BenchError(f"model {base.model.path}: {err}") from err
    max_context = base.model.max_model_len or config.get("max_position_embeddings")
    return max_context, config.get("vocab_size")


def _measure(args: argparse.Namespace, workload: Workload,
             base: Any) -> tuple[dict[str, list[RequestRecord]], dict[str, Any]]:
    if args.router:
        label = args.label or "router"
        records, status = asyncio.run(_measure_address(args, args.router, label, workload))
        return {label: records}, {"router": args.router, "status": status}
    if args.endpoint:
        label = args.label or "endpoint"
        endpoint = Endpoint(parse_endpoint(args.endpoint), args.model, args.extra_body, args.tokenizer)
        records, server = asyncio.run(replay_openai(endpoint, workload, label,
                                                    connect_timeout_s=args.connect_timeout,
                                                    show_progress=not args.no_progress))
        return {label: records}, server
    return _measure_arrangements(args, workload, base)


async def _measure_address(args: argparse.Namespace, address: str, label: str,
                           workload: Workload) -> tuple[list[RequestRecord], dict[str, Any]]:
    records = await replay(address, workload, label, connect_timeout_s=args.connect_timeout,
                           show_progress=not args.no_progress)
    return records, await fetch_status(address)


def _measure_arrangements(args: argparse.Namespace, workload: Workload,
                          base: Any) -> tuple[dict[str, list[RequestRecord]], dict[str, Any]]:
    """Each arrangement: start it, replay the same requests, stop it."""
    from router.launcher import LocalCluster, arrangement_config

    names = [name.strip() for name in args.arrangements.split(",") if name.strip()]
    unknown = sorted(set(names) - set(ARRANGEMENTS))
    if unknown or not names:
        raise BenchError(f"--arrangements: unknown {unknown}; choose from {', '.join(ARRANGEMENTS)}")
    records: dict[str, list[RequestRecord]] = {}
    statuses: dict[str, Any] = {}
    for name in names:
        try:
            cfg = arrangement_config(base, name, args.workers, pin_cpus=args.pin_cpus)
        except ValueError as err:
            raise BenchError(f"--arrangements {name}: {err}") from err
        # its own free port, so a `pdserve serve` of the same config can keep running
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, port=0, metrics_port=None,
                                                                  http_port=None))
        with LocalCluster(cfg) as cluster:
            records[name], statuses[name] = asyncio.run(
                _measure_address(args, cluster.address, name, workload))
    return records, {"config": args.config, "workers": args.workers, "status": statuses}
