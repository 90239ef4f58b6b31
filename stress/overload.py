"""Overload: the morning-burst preset past saturation, on a small cluster of the tiny model.

    python -m stress.overload [--quick] [--json] [--mode disaggregated|colocated] [--model DIR]
                               [--duration S] [--start-rate R] [--slo ttft=2,tpot=0.25]

The tiny random model (checkpoints/tiny.py), not SmolLM2: what overload tests is the router's
behaviour (admission, migration, refusal), and on a shared CPU host the tiny model reaches
saturation within seconds per rate, so the sweep and the 2x / 4x runs fit in a few minutes; the
figures are this host's, not a GPU's.

Finding saturation: the preset (a fresh seed per run, so no run reuses another's prefix cache)
is replayed at rates start, start x STEP, ...; every run lasts the same `--duration` of arrivals
(rate x duration requests), so a faster rate is not a shorter run whose start-up and drain weigh
more; each run's goodput is the requests that met the SLO per second of the run (first send to
last token). The cluster is saturated at the last rate
whose goodput still grew by GROWTH over the rate before (the next step adds arrivals but no
goodput). Then the same preset runs at 2x and 4x that rate. The router refuses what it predicts
would wait longer than router.queue_timeout_s, set to half the TTFT objective (at most 0.9 s, so
that a request refused at its queue deadline still hears within the 1 s bound): a request that
would miss the SLO anyway is told at once, with Retry-After, instead of served late.

`--json` prints {"rates": [saturation, 2x, 4x], "goodput": [...], "failed_by_status": {status:
count over the three runs}, "refusal_latency_p99_s": ..., "migrations": ..., and the detail:
"failed_by_migration", "worker_failures", "refusal_latency_max_s_by_status", "failure_details"
(one client-side message per status), "search" (rate, goodput, requests per step), "slo", "mode",
"duration_s", "requests" (per run, in the order of "rates")}. A refusal is every failure but a migration's, whatever its status. Targets (exit 0 when all hold, 1 otherwise): no request fails by migration when no
worker failed; every refusal reaches the client within 1 s of arrival; goodput at 2x and 4x is at
least 0.9 x goodput at saturation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpc  # noqa: E402

from bench.metrics import Slo, parse_slo  # noqa: E402
from bench.presets import WorkloadOptions, build_workload  # noqa: E402
from bench.workload import RequestSpec  # noqa: E402
from checkpoints.tiny import make_tiny_model  # noqa: E402
from proto import pdserve_pb2 as pb  # noqa: E402
from proto import pdserve_pb2_grpc as pb_grpc  # noqa: E402
from router.config.loader import parse_config  # noqa: E402
from router.config.schema import ClusterConfig  # noqa: E402
from router.launch import LocalCluster  # noqa: E402

STEP = 1.5  # the saturation search multiplies the rate by this
GROWTH = 1.1  # goodput must grow by this factor for a rate to count as not yet saturated
MAX_STEPS = 8
GOODPUT_KEPT = 0.9  # goodput at 2x and 4x over goodput at saturation
REFUSAL_S = 1.0  # every refusal within this of arrival
QUEUE_MARGIN_S = 0.1  # router.queue_timeout_s this much under REFUSAL_S: the reply's own way back
MAX_CONTEXT = 512  # the burst's prompts are 3/4 of it


@dataclass
class Sent:
    """One request as the client saw it: seconds since its arrival."""

    token_times: list[float] = field(default_factory=list)
    status: str = "OK"
    details: str = ""
    ended_s: float = 0.0
    migrations: int = 0

    def meets(self, slo: Slo) -> bool:
        if self.status != "OK" or not self.token_times:
            return False
        ttft = self.token_times[0]
        tpot = (self.token_times[-1] - ttft) / (len(self.token_times) - 1) if len(self.token_times) > 1 else 0.0
        return (slo.ttft_s is None or ttft <= slo.ttft_s) and (slo.tpot_s is None or tpot <= slo.tpot_s)


@dataclass
class Run:
    rate: float
    sent: list[Sent]
    wall_s: float
    migrations: int
    worker_failures: int

    def goodput(self, slo: Slo) -> float:
        return sum(s.meets(slo) for s in self.sent) / self.wall_s if self.wall_s > 0 else 0.0

    def failed(self) -> list[Sent]:
        return [s for s in self.sent if s.status != "OK"]


def queue_timeout_s(slo: Slo) -> float:
    """Half the TTFT objective, and QUEUE_MARGIN_S under the refusal bound: a request refused at
    its queue deadline reaches the client a little after it (1.013 s at a 1 s timeout here)."""
    return min((slo.ttft_s or 4.0) / 2, REFUSAL_S - QUEUE_MARGIN_S)


def cluster_config(model: str, mode: str, slo: Slo) -> ClusterConfig:
    decode = 2 if mode == "colocated" else 1
    raw = {"model": {"path": model}, "mode": mode,
           "router": {"host": "127.0.0.1", "port": 0, "metrics_port": None, "shutdown_grace_s": 5,
                      "queue_timeout_s": queue_timeout_s(slo)},
           "prefill": {"replicas": 1 if mode == "disaggregated" else 0, "num_cpus": 0.5},
           "decode": {"replicas": decode, "num_cpus": 0.5},
           "kv_cache": {"block_size": 16, "num_blocks": 256}, "kv_transfer": {"timeout_s": 10}}
    return parse_config(raw, where="overload")


def workload(rate: float, requests: int, output_len: int, seed: int) -> list[RequestSpec]:
    opts = WorkloadOptions(preset="morning-burst", num_requests=requests, rate=rate, output_len=output_len,
                           max_context=MAX_CONTEXT, vocab=(10, 2000), seed=seed)
    return list(build_workload(opts).requests)


async def replay(address: str, specs: list[RequestSpec]) -> tuple[list[Sent], float]:
    """Every spec sent at its arrival time; (what each got, wall seconds from first send to last end)."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)
        stub = pb_grpc.GenerationStub(channel)
        t0 = time.perf_counter()
        tasks = []
        for spec in specs:
            delay = spec.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(stub, spec)))
        sent = await asyncio.gather(*tasks)
        return list(sent), time.perf_counter() - t0


async def _one(stub: pb_grpc.GenerationStub, spec: RequestSpec) -> Sent:
    request = pb.GenerateRequest(prompt_token_ids=spec.prompt_token_ids, sampling=pb.SamplingParams(
        max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True))
    got, start = Sent(), time.perf_counter()
    try:
        async for msg in stub.Generate(request, timeout=600):
            if msg.token_ids:
                got.token_times.append(time.perf_counter() - start)
            if msg.HasField("usage"):
                got.migrations = msg.usage.migrations
    except grpc.aio.AioRpcError as e:
        got.status, got.details = e.code().name, e.details() or ""
    got.ended_s = time.perf_counter() - start
    return got


def _replay_process(address: str, specs: list[RequestSpec]) -> tuple[list[Sent], float]:
    return asyncio.run(replay(address, specs))


def run_at(cluster: LocalCluster, rate: float, duration_s: float, output_len: int, seed: int,
           client: ProcessPoolExecutor) -> Run:
    """`rate` x `duration_s` requests of the preset, replayed at `rate` from `client`'s process:
    in the router's own process, the client's work past saturation would take the router's turns."""
    metrics = cluster.router.metrics.registry
    before = _counts(metrics)
    requests = max(4, round(rate * duration_s))
    sent, wall = client.submit(_replay_process, cluster.address, workload(rate, requests, output_len, seed)).result()
    after = _counts(metrics)
    deadline = time.monotonic() + 30
    while cluster.router.lives and time.monotonic() < deadline:  # aborts land; the next run starts idle
        time.sleep(0.1)
    return Run(rate, sent, wall, int(after[0] - before[0]), int(after[1] - before[1]))


def _counts(registry) -> tuple[float, float]:
    """(migrations, worker failures) so far."""
    migrations = registry.get_sample_value("pdserve_request_migrations_total") or 0.0
    failures = sum(registry.get_sample_value("pdserve_worker_failures_total", {"pool": p}) or 0.0
                   for p in ("prefill", "decode"))
    return migrations, failures


def find_saturation(cluster: LocalCluster, args, slo: Slo, log,
                    client: ProcessPoolExecutor) -> tuple[Run, list[dict]]:
    """The run at the last rate whose goodput still grew by GROWTH (see the module docstring)."""
    rate, best, search = args.start_rate, None, []
    for step in range(MAX_STEPS):
        run = run_at(cluster, rate, args.duration, args.output_len, seed=step, client=client)
        search.append({"rate": round(rate, 3), "goodput": round(run.goodput(slo), 3), "requests": len(run.sent)})
        log(f"search: {rate:.2f} req/s -> goodput {run.goodput(slo):.2f}/s, {len(run.failed())} failed")
        if best is not None and run.goodput(slo) < GROWTH * best.goodput(slo):
            return best, search
        best, rate = run, rate * STEP
    return best, search


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def report(runs: list[Run], search: list[dict], slo: Slo, args) -> dict:
    failed = [s for r in runs for s in r.failed()]
    by_status: dict[str, int] = {}
    for s in failed:
        by_status[s.status] = by_status.get(s.status, 0) + 1
    # a refusal is every failure but a migration's: RESOURCE_EXHAUSTED at arrival, and any other
    # status the router ends a request with (UNAVAILABLE after a wait would show here as slow)
    refusals = [s for s in failed if "failed on" not in s.details]
    return {
        "rates": [round(r.rate, 3) for r in runs],
        "goodput": [round(r.goodput(slo), 3) for r in runs],
        "failed_by_status": by_status,
        "refusal_latency_p99_s": round(p99([s.ended_s for s in refusals]), 4),
        "refusal_latency_max_s_by_status": {status: round(max(s.ended_s for s in refusals if s.status == status), 4)
                                            for status in sorted({s.status for s in refusals})},
        "failure_details": {status: next(s.details for s in failed if s.status == status) for status in by_status},
        "migrations": sum(r.migrations for r in runs),
        "failed_by_migration": sum("failed on" in s.details for s in failed),
        "worker_failures": sum(r.worker_failures for r in runs),
        "search": search, "slo": slo.as_dict(), "mode": args.mode, "duration_s": args.duration,
        "requests": [len(r.sent) for r in runs],
    }


def missed_targets(doc: dict) -> list[str]:
    sat, *over = doc["goodput"]
    checks = [
        (doc["failed_by_migration"] == 0 or doc["worker_failures"] > 0,
         f"{doc['failed_by_migration']} requests failed by migration with no worker failed"),
        (doc["refusal_latency_p99_s"] <= REFUSAL_S, f"refusal p99 {doc['refusal_latency_p99_s']} s > {REFUSAL_S} s"),
        (all(g >= GOODPUT_KEPT * sat for g in over), f"goodput {over} below {GOODPUT_KEPT} x {sat}"),
    ]
    return [why for ok, why in checks if not ok]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stress.overload", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs of shorter requests (about 3 minutes)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    ap.add_argument("--model", help="checkpoint directory (default: a fresh tiny llama)")
    ap.add_argument("--duration", type=float, help="seconds of arrivals per run (default 30, --quick 12)")
    ap.add_argument("--output-len", type=int, help="output tokens per streaming request (default 256, --quick 64)")
    ap.add_argument("--start-rate", type=float, default=2.0, help="first rate of the search, requests/s")
    ap.add_argument("--slo", default="ttft=2,tpot=0.25", help="objectives a good request meets")
    args = ap.parse_args(argv)
    args.duration = args.duration or (12.0 if args.quick else 30.0)
    args.output_len = args.output_len or (64 if args.quick else 256)
    slo = parse_slo(args.slo)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model(os.path.join(tmp, "tiny"), arch="llama", size="tiny", seed=0))
        with (LocalCluster(cluster_config(model, args.mode, slo)) as cluster,
              ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as client):
            saturated, search = find_saturation(cluster, args, slo, log, client)
            runs = [saturated]
            for factor in (2, 4):
                runs.append(run_at(cluster, saturated.rate * factor, args.duration, args.output_len,
                                   seed=100 + factor, client=client))
                log(f"{factor}x: {runs[-1].rate:.2f} req/s -> goodput {runs[-1].goodput(slo):.2f}/s, "
                    f"{len(runs[-1].failed())} failed")
    doc = report(runs, search, slo, args)
    missed = missed_targets(doc)
    doc |= {"targets_met": not missed, "missed_targets": missed}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"saturation {doc['rates'][0]} req/s ({args.mode}), goodput {doc['goodput']} at {doc['rates']}")
        print(f"failed by status {doc['failed_by_status']}; refusal p99 {doc['refusal_latency_p99_s']} s; "
              f"migrations {doc['migrations']}; worker failures {doc['worker_failures']}")
        print("targets met" if not missed else "targets missed: " + "; ".join(missed))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
