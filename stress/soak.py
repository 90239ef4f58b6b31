"""Soak (issue 23, item 13): hours of mixed, partly hostile traffic must not grow any process.

    python -m stress.soak --minutes N [--sample-s S] [--concurrency C] [--seed K] [--model DIR] [--json]

Starts a real 2 prefill + 2 decode cluster (the tiny random model of checkpoints/tiny.py unless
--model; Ray, the router, gRPC and the OpenAI HTTP door) and drives it for N minutes from a
process of its own (stress/soak_load.py: the router's process pays only for serving): gRPC streams, HTTP
completions and chats streamed and whole, clients that cancel mid-stream, bad requests that must
get their precise status (INVALID_ARGUMENT, 400, 404), and prompts that share prefixes. The
first `--sample-s` seconds (default 60) warm up; then, and every `--sample-s` after, the RSS of
the router's process (this one) and of every worker actor is sampled. After the load, the
workers' block accounting must come back whole (used 0, free == total: blocks the prefix cache
keeps are free, evictable). The tokens of the first CHECKED greedy requests (gRPC and HTTP
completions) must be the tokens an in-process engine with the cluster's own engine config
produces for them afterwards (a request that finished with the right count but wrong tokens is
no success).

`--json` prints {"minutes", "samples": {proc: [MB, ...]}, "rss_growth_mb": {proc: last - first},
"rss_growth_pct", "completed", "cancelled", "sent", "errors_by_status": {status: n},
"unexpected_errors": {"kind status": n}, "tokens_checked", "tokens_wrong": [{prompt, max_tokens, got,
reference}, ...], "leaked_blocks": {worker: used}, "integrity_errors",
"pools_at_end", "targets_met", "missed_targets"}. Targets (exit 0 when all hold, 1 otherwise):
every process's RSS grows at most 5% after the warm-up, 0 leaked blocks, no error but the
expected statuses, every checked greedy request token-exact, every pool at its size at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import queue
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402

from checkpoints.tiny import make_tiny_model  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402
from router.config.loader import parse_config  # noqa: E402
from router.config.schema import ClusterConfig  # noqa: E402
from router.launch import LocalCluster  # noqa: E402
from stress.chaos import ChaosOptions, ChaosReport, _ready_views, settle  # noqa: E402
from stress.soak_load import REQUEST_TIMEOUT_S, Target, _load_process  # noqa: E402

GROWTH_PCT = 5.0  # the most any process's RSS may grow after the warm-up
START_TIMEOUT_S = 300.0  # four workers on a shared 2-core host can take minutes to start
LOAD_START_S = 120.0


def cluster_config(model: str) -> ClusterConfig:
    raw = {"model": {"path": model}, "mode": "disaggregated",
           "router": {"host": "127.0.0.1", "port": 0, "http_port": 0, "metrics_port": None, "shutdown_grace_s": 5},
           "prefill": {"replicas": 2, "num_cpus": 0.5}, "decode": {"replicas": 2, "num_cpus": 0.5},
           "kv_cache": {"block_size": 16, "num_blocks": 256}, "kv_transfer": {"timeout_s": 10}}
    return parse_config(raw, where="soak")


def wrong_tokens(cluster: LocalCluster, greedy: list[tuple[list[int], int, list[int]]]) -> list[dict]:
    """Each greedy request whose tokens are not what an engine of the cluster's config produces."""
    engine = LLMEngine(cluster.cfg.engine_config(cluster.cfg.decode))
    wrong = []
    for start in range(0, len(greedy), 16):  # 16 at a time: no preemption in the reference
        batch = greedy[start:start + 16]
        for i, (prompt, max_tokens, _) in enumerate(batch):
            engine.add_request(f"ref-{start + i}", prompt_token_ids=prompt,
                               sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        reference: dict[str, list[int]] = collections.defaultdict(list)
        while engine.has_unfinished():
            for out in engine.step():
                reference[out.request_id] += out.token_ids
        wrong += [{"prompt": prompt, "max_tokens": max_tokens, "got": got, "reference": reference[f"ref-{start + i}"]}
                  for i, (prompt, max_tokens, got) in enumerate(batch) if got != reference[f"ref-{start + i}"]]
    return wrong


# ---- the sampler, in the router's process -----------------------------------------------------
def rss_sample(cluster: LocalCluster) -> dict[str, float]:
    """MB resident (Linux /proc): this process (the router's) and every ready worker actor,
    each read in its own process."""
    def rss_mb(actor=None) -> float:  # a closure, so Ray pickles it by value: workers need not import this
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    views = cluster.call(_ready_views(cluster), 10)
    sizes = ray.get([v.actor.__ray_call__.remote(rss_mb) for v in views], timeout=60)
    return {"router": rss_mb()} | {v.name: mb for v, mb in zip(views, sizes, strict=True)}


@dataclass(frozen=True)
class SoakOptions:
    minutes: float = 1.0
    sample_s: float = 60.0  # the warm-up, then the sampling period
    concurrency: int = 4
    seed: int = 0


def drive(cluster: LocalCluster, opts: SoakOptions) -> tuple[dict, dict[str, list[float]]]:
    """The load for opts.minutes in a spawned process; RSS sampled after the warm-up and every
    sample_s, on the load's clock (from when it connected)."""
    seconds = opts.minutes * 60
    ctx = multiprocessing.get_context("spawn")
    results, started = ctx.Queue(), ctx.Event()
    target = Target(cluster.address, cluster.http_url, Path(cluster.cfg.model.path).name)
    load = ctx.Process(target=_load_process, args=(target, seconds, opts.concurrency, opts.seed, started, results))
    samples: dict[str, list[float]] = collections.defaultdict(list)
    load.start()
    try:
        if not started.wait(LOAD_START_S):  # the spawned process imports torch, Ray and gRPC first
            raise TimeoutError(f"the load process did not connect within {LOAD_START_S:.0f} s")
        t0 = time.monotonic()
        at = opts.sample_s
        while at <= seconds + 1e-6:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            for proc, mb in rss_sample(cluster).items():
                samples[proc].append(round(mb, 1))
            at += opts.sample_s
        tally = _result(load, results, t0 + seconds + REQUEST_TIMEOUT_S + 30)
    finally:
        load.join(30)
        if load.is_alive():
            load.kill()
    return tally, dict(samples)


def _result(load, results, deadline: float) -> dict:
    """The load's tally, once its last request ended; an error at once if the process died."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not load.is_alive():
                raise RuntimeError(f"the load process died (exit code {load.exitcode})") from None
            if time.monotonic() > deadline:
                raise TimeoutError("the load did not end by its deadline") from None


def run(model_dir: str, opts: SoakOptions) -> dict:
    """The whole soak against a fresh cluster (Ray must be initialized or is started by it)."""
    with LocalCluster(cluster_config(model_dir), start_timeout_s=START_TIMEOUT_S) as cluster:
        return soak(cluster, opts)


def soak(cluster: LocalCluster, opts: SoakOptions) -> dict:
    """The load, the samples, then the pools and block accounting once it drained: the report."""
    tally, samples = drive(cluster, opts)
    greedy = tally.pop("greedy")
    wrong = wrong_tokens(cluster, greedy)
    ended = ChaosReport(pools_target=dict(cluster.router.pools.targets))
    settle(cluster, ended, ChaosOptions(heal_timeout_s=30, drain_timeout_s=15))
    growth = {p: round(s[-1] - s[0], 1) for p, s in samples.items()}
    doc = {"minutes": opts.minutes, "sample_s": opts.sample_s, "concurrency": opts.concurrency,
           "samples": samples, "rss_growth_mb": growth,
           "rss_growth_pct": {p: round(100 * growth[p] / s[0], 2) for p, s in samples.items()},
           **tally, "tokens_checked": len(greedy), "tokens_wrong": wrong, "leaked_blocks": ended.leaked_blocks, "integrity_errors": ended.integrity_errors,
           "pools_at_end": ended.pools_at_end}
    missed = missed_targets(doc, ended.pools_target)
    return doc | {"targets_met": not missed, "missed_targets": missed}


def missed_targets(doc: dict, pools_target: dict[str, int]) -> list[str]:
    grown = {p: pct for p, pct in doc["rss_growth_pct"].items() if pct > GROWTH_PCT}
    checks = [(not grown, f"RSS grew over {GROWTH_PCT}% after the warm-up: {grown}"),
              (doc["completed"] > 0, "no request completed"),
              (not any(doc["leaked_blocks"].values()), f"leaked blocks {doc['leaked_blocks']}"),
              (not doc["integrity_errors"], f"KV integrity errors {doc['integrity_errors']}"),
              (not doc["unexpected_errors"], f"unexpected errors {doc['unexpected_errors']}"),
              (doc["tokens_checked"] > 0, "no greedy request's tokens were checked"),
              (not doc["tokens_wrong"], f"{len(doc['tokens_wrong'])} of {doc['tokens_checked']} greedy requests' "
                                        "tokens differ from the reference"),
              (doc["pools_at_end"] == pools_target, f"pools {doc['pools_at_end']} != {pools_target}")]
    return [why for ok, why in checks if not ok]


def summary(doc: dict) -> str:
    lines = [f"{doc['minutes']} min, {doc['sent']} sent: {doc['completed']} completed, {doc['cancelled']} cancelled, "
             f"errors {doc['errors_by_status']}, unexpected {doc['unexpected_errors'] or 'none'}; "
             f"{doc['tokens_checked']} greedy requests checked, {len(doc['tokens_wrong'])} wrong"]
    lines += [f"{p:12} RSS {s[0]:.1f} -> {s[-1]:.1f} MB ({doc['rss_growth_pct'][p]:+.2f}%)"
              for p, s in doc["samples"].items()]
    lines.append(f"leaked blocks {doc['leaked_blocks']}; pools at end {doc['pools_at_end']}")
    lines.append("targets met" if doc["targets_met"] else "targets missed: " + "; ".join(doc["missed_targets"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stress.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="minutes of load (fractions allowed)")
    ap.add_argument("--sample-s", type=float, default=60.0, help="warm-up, then RSS sampling period, seconds")
    ap.add_argument("--concurrency", type=int, default=4, help="clients, each with one request at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="checkpoint directory (default: a fresh tiny llama)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.sample_s <= 0 or args.concurrency < 1:
        ap.error("--minutes and --sample-s must be > 0, --concurrency >= 1")
    if args.sample_s * 2 > args.minutes * 60 + 1e-6:
        ap.error(f"--minutes {args.minutes} leaves fewer than two samples {args.sample_s} s apart")
    opts = SoakOptions(args.minutes, args.sample_s, args.concurrency, args.seed)
    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
            model = args.model or str(make_tiny_model(os.path.join(tmp, "tiny"), arch="llama", size="tiny", seed=0))
            doc = run(model, opts)
    finally:
        ray.shutdown()
    print(json.dumps(doc) if args.json else summary(doc))
    return 0 if doc["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
