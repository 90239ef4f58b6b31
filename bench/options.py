"""`pdserve bench`'s and `pdserve simulate`'s shared command-line options: the typed argument
parsers, the option groups (clusters of --config, an OpenAI endpoint, the workload, the report) and
the workload options they give. bench/cli.py runs a bench from them; simulate/cli.py reuses the
workload and report groups.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from bench.arrangements import ARRANGEMENTS
from bench.capacity import CLAMP_OPTION
from bench.errors import WorkloadError
from bench.openai_client import DEFAULT_EXTRA_BODY
from bench.presets import PRESETS, WorkloadOptions
from bench.trace import parse_window
from bench.workload import DEFAULT_VOCAB
from router.config.schema import POLICIES

FALLBACK_MAX_CONTEXT = 2048  # prompt + output without --max-context or a model's limit


def typed(kind: Callable[[str], Any], check: Callable[[Any], bool], what: str) -> Callable:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from err
        if not check(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


positive_int = typed(int, lambda v: v > 0, "a positive integer")
positive_float = typed(float, lambda v: v > 0, "a positive number")


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("clusters of --config")
    group.add_argument("--arrangements", metavar="NAMES",
                       help=f"comma-separated, of {', '.join(ARRANGEMENTS)} (default: all four)")
    group.add_argument("--policies", metavar="NAMES",
                       help=f"comma-separated placement policies, of {', '.join(POLICIES)}: the "
                            "disaggregated cluster once per policy, instead of --arrangements")
    group.add_argument("--workers", type=positive_int, default=2,
                       help="total workers of every arrangement; with --policies split evenly "
                            "between prefill and decode (default 2)")
    group.add_argument("--prefill-workers", type=positive_int,
                       help="prefill workers of the --policies clusters, or of the disaggregated "
                            "--arrangements out of --workers, e.g. 2 of 8 for P:D 2:6 (default: half of --workers)")
    group.add_argument("--decode-workers", type=positive_int,
                       help="with --policies: decode workers (default: the rest of --workers)")
    group.add_argument("--prefix-caching", choices=("on", "off"),
                       help="set kv_cache.prefix_caching of every cluster (default: the config's)")
    group.add_argument("--pin-cpus", action="store_true",
                       help="pin worker i of each cluster to CPU core i (prefill workers first)")
    group.add_argument(CLAMP_OPTION, action="store_true",
                       help="cut requests whose prompt + output exceed a worker's KV pool to fit it "
                            "(default: refuse to run such a workload)")
    group.add_argument("--emulate", metavar="DEVICE:MODEL",
                       help="run every cluster at this device's timings for this model, e.g. h100:llama-3.1-8b "
                            "(the config's other emulate: keys apply; docs/architecture.md, Emulation)")
    group.add_argument("--emulate-time-scale", type=typed(float, lambda v: v >= 1, "a number >= 1"), metavar="K",
                       help="with --emulate: stretch modelled time and arrivals by K, report divided back "
                            "(default: the config's emulate.time_scale)")


def add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI endpoint (--endpoint)")
    group.add_argument("--model", help="the request's model field (default: the first of GET /v1/models)")
    group.add_argument("--tokenizer", metavar="DIR",
                       help="the server's tokenizer: prompts go as its text when the server refuses token ids")
    group.add_argument("--extra-body", type=json_object, default=dict(DEFAULT_EXTRA_BODY), metavar="JSON",
                       help=f"fields added to every request (default: {json.dumps(DEFAULT_EXTRA_BODY)}: exact "
                            "output lengths on pdserve, vLLM, SGLang)")


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--preset", choices=list(PRESETS), default="steady",
                       help="; ".join(f"{name}: {p.description}" for name, p in PRESETS.items())
                       .replace("%", "%%") + " (default: %(default)s)")
    group.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace to replay")
    group.add_argument("--length-scale", type=positive_float,
                       help="trace lengths divided by this (conversation preset: 16)")
    group.add_argument("--time-scale", type=positive_float,
                       help="trace timestamps divided by this (>1 replays faster)")
    group.add_argument("--window", default="0:", metavar="START:END",
                       help="seconds of the trace to replay (default all)")
    group.add_argument("--num-requests", type=positive_int, help="requests to send (default: the preset's)")
    group.add_argument("--rate", type=positive_float,
                       help="requests/s, Poisson or gamma (default: the preset's; none with --concurrency)")
    group.add_argument("--burstiness", type=positive_float, default=1.0,
                       help="gamma shape; 1 = Poisson, < 1 burstier (default 1)")
    group.add_argument("--concurrency", type=positive_int,
                       help="max requests in flight; without --rate: closed loop")
    group.add_argument("--input-len", type=positive_int, help="mean prompt tokens (default: the preset's)")
    group.add_argument("--output-len", type=positive_int,
                       help="output tokens of every request, exact (default: the preset's)")
    group.add_argument("--range-ratio", type=typed(float, lambda v: 0 <= v < 1, "in [0, 1)"),
                       help="prompt lengths uniform in mean*(1 +- r) (default: the preset's)")
    group.add_argument("--max-context", type=positive_int,
                       help="prompt + output limit (default: the model's, else 2048)")
    group.add_argument("--vocab-range", default=None, metavar="LOW:HIGH",
                       help=f"prompt token ids (default {DEFAULT_VOCAB[0]}:{DEFAULT_VOCAB[1]})")
    group.add_argument("--seed", type=int, default=0,
                       help="seeds arrivals, lengths and prompt tokens (default 0)")


def add_report_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("report")
    group.add_argument("--slo", default="", help="per-request objectives for goodput, e.g. ttft=1.0,tpot=50ms "
                                                  "(seconds or ms; keys ttft, tpot, e2e)")
    group.add_argument("--out", default="bench-out",
                       help="directory for summary.json, requests.jsonl and charts (default: %(default)s)")
    group.add_argument("--json", action="store_true",
                       help="print summary.json on stdout instead of the tables")
    group.add_argument("--plot", action="store_true",
                       help="also write PNG charts: TTFT and ITL CDFs, ITL over time (a panel per run)")
    group.add_argument("--connect-timeout", type=positive_float, default=10.0,
                       help="seconds to wait for each router or server (default 10)")
    group.add_argument("--no-progress", action="store_true",
                       help="no progress on stderr (a bar on a terminal, else a line every few seconds)")
    group.add_argument("--cost-per-worker-hour", type=positive_float, metavar="USD",
                       help="price of one worker for an hour: the ranking adds the cost per million output "
                            "tokens (all, and of requests that met the SLO)")
    group.add_argument("--report", metavar="FILE.html",
                       help="also write one self-contained HTML page: recommendation, ranking, limits, "
                            "latency tables and charts (charts need matplotlib)")


def parse_vocab(text: str | None, model_vocab: int | None) -> tuple[int, int]:
    if text is None:
        low, high = DEFAULT_VOCAB
        return low, min(high, model_vocab) if model_vocab else high
    low, sep, high = (part.strip() for part in text.partition(":"))
    if not (sep and low.isdigit() and high.isdigit()):
        raise WorkloadError(f"--vocab-range {text!r}: expected LOW:HIGH token ids")
    return int(low), int(high)


def workload_options(args: argparse.Namespace,
                      limits: tuple[int | None, int | None]) -> WorkloadOptions:
    max_positions, model_vocab = limits
    return WorkloadOptions(
        preset=args.preset, num_requests=args.num_requests, rate=args.rate,
        burstiness=args.burstiness, concurrency=args.concurrency, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio,
        max_context=args.max_context or max_positions or FALLBACK_MAX_CONTEXT,
        vocab=parse_vocab(args.vocab_range, model_vocab), seed=args.seed, trace=args.trace,
        length_scale=args.length_scale, time_scale=args.time_scale,
        window=parse_window(args.window),
    )
