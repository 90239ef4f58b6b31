"""Chaos soak: 2 prefill + 2 decode workers on the tiny model, seeded streaming traffic, a worker
killed every `--kill-every` s, KV transfers failed and delayed; every streamed token is checked
against an undisturbed in-process reference run of the same requests.

    python -m stress.chaos [--duration 120] [--seed 0] [--kill-every 15] [--model DIR] [--json]

Targets (exit 0 when all hold, 1 otherwise, 2 for usage errors): 0 hung, 0 leaked KV blocks,
0 token mismatches, completion_rate = completed / (sent - cancelled) >= 0.99, and every pool
back at its configured size. A stream that fails with a gRPC status is counted in
`failed_by_status`; its tokens, like a cancelled stream's, must still be a prefix of the reference.
Report keys: sent, completed, cancelled, completion_rate, failed_by_status, hung, token_mismatches
(+ mismatch_examples), migrated, leaked_blocks, integrity_errors, pools_at_end, pools_target,
duration_s, kills, seed, targets_met, failed_targets. Tests call `run(model_dir, ChaosOptions(...))`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpc  # noqa: E402
import ray  # noqa: E402

from checkpoints.tiny import make_tiny_model  # noqa: E402
from proto import pdserve_pb2 as pb  # noqa: E402
from proto import pdserve_pb2_grpc as pb_grpc  # noqa: E402
from router.config.loader import parse_config  # noqa: E402
from router.config.schema import ClusterConfig  # noqa: E402
from router.launch import LocalCluster  # noqa: E402
from router.lifecycle import worker_calls  # noqa: E402
from router.pools.worker_view import WorkerState  # noqa: E402
from stress.chaos_requests import Outcome, Spec, make_specs, mismatch, to_proto  # noqa: E402

TARGET_COMPLETION = 0.99


@dataclass(frozen=True)
class ChaosOptions:
    duration_s: float = 120.0
    seed: int = 0
    kill_every_s: float = 15.0  # 0 = no kills
    concurrency: int = 12
    deadline_s: float = 60.0  # a stream not ended by then is hung
    cancel_rate: float = 0.1
    transfer_fail_rate: float = 0.05
    transfer_delay_rate: float = 0.1
    transfer_delay_s: float = 0.2
    heal_timeout_s: float = 60.0  # after the load: pools back at target within this
    drain_timeout_s: float = 5.0  # then KV usage back to 0 within this


@dataclass
class ChaosReport:
    seed: int = 0
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    token_mismatches: int = 0
    migrated: int = 0
    failed_by_status: dict[str, int] = field(default_factory=dict)
    hung: int = 0
    leaked_blocks: dict[str, int] = field(default_factory=dict)
    integrity_errors: dict[str, str] = field(default_factory=dict)  # worker -> its check() failure
    pools_at_end: dict[str, int] = field(default_factory=dict)
    pools_target: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    kills: list[dict] = field(default_factory=list)
    mismatch_examples: list[str] = field(default_factory=list)

    @property
    def completion_rate(self) -> float:
        expected = self.sent - self.cancelled
        return self.completed / expected if expected > 0 else 0.0

    def failed_targets(self) -> list[str]:
        checks = [(self.hung == 0, f"{self.hung} hung"),
                  (not any(self.leaked_blocks.values()), f"leaked blocks {self.leaked_blocks}"),
                  (not self.integrity_errors, f"KV integrity errors {self.integrity_errors}"),
                  (self.token_mismatches == 0, f"{self.token_mismatches} token mismatches"),
                  (self.completion_rate >= TARGET_COMPLETION,
                   f"completion rate {self.completion_rate:.3f} < {TARGET_COMPLETION}"),
                  (self.pools_at_end == self.pools_target, f"pools {self.pools_at_end} != {self.pools_target}")]
        return [why for ok, why in checks if not ok]

    def to_dict(self) -> dict:
        failed = self.failed_targets()
        return dataclasses.asdict(self) | {"completion_rate": round(self.completion_rate, 4),
                                           "targets_met": not failed, "failed_targets": failed}


def cluster_config(model: str, opts: ChaosOptions) -> ClusterConfig:
    raw = {"model": {"path": model}, "mode": "disaggregated",
           "router": {"host": "127.0.0.1", "port": 0, "metrics_port": None, "shutdown_grace_s": 5},
           "prefill": {"replicas": 2, "num_cpus": 0.5}, "decode": {"replicas": 2, "num_cpus": 0.5},
           "kv_cache": {"block_size": 16, "num_blocks": 256}, "kv_transfer": {"timeout_s": 5},
           "faults": {"seed": opts.seed, "transfer_fail_rate": opts.transfer_fail_rate,
                      "transfer_delay_rate": opts.transfer_delay_rate, "transfer_delay_s": opts.transfer_delay_s}}
    return parse_config(raw, where="chaos")


# ---- the load and the killer --------------------------------------------------------------
class Soak:
    def __init__(self, cluster: LocalCluster, specs: list[Spec], opts: ChaosOptions):
        self.cluster, self.specs, self.opts = cluster, specs, opts
        self.report = ChaosReport(seed=opts.seed, pools_target={"prefill": cluster.cfg.prefill.replicas,
                                                                "decode": cluster.cfg.decode.replicas})
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    async def drive(self) -> None:
        async with grpc.aio.insecure_channel(self.cluster.address) as channel:
            await asyncio.wait_for(channel.channel_ready(), 10)
            stub = pb_grpc.GenerationStub(channel)
            slots, tasks = asyncio.Semaphore(self.opts.concurrency), set()
            self.t0 = time.monotonic()
            killer = asyncio.create_task(self.kill_loop(random.Random(f"kill-{self.opts.seed}")))
            while self.elapsed() < self.opts.duration_s:
                await slots.acquire()
                if self.elapsed() >= self.opts.duration_s:
                    break
                tasks.add(asyncio.create_task(self.one(stub, self.report.sent, slots)))
                self.report.sent += 1
            await asyncio.gather(*tasks)  # each is bounded by its own deadline
            self.report.duration_s = round(self.elapsed(), 1)
            await killer

    async def one(self, stub: pb_grpc.GenerationStub, n: int, slots: asyncio.Semaphore) -> None:
        spec, rng = self.specs[n % len(self.specs)], random.Random(f"cancel-{self.opts.seed}-{n}")
        cancel = rng.random() < self.opts.cancel_rate  # after 1-4 messages or after 0.05-1.5 s
        after_msgs = rng.randint(1, 4) if cancel and rng.random() < 0.5 else None
        wait_s = rng.uniform(0.05, 1.5) if cancel and after_msgs is None else self.opts.deadline_s
        request = pb.GenerateRequest(request_id=f"chaos-{self.opts.seed}-{n}", prompt_token_ids=spec.prompt,
                                     sampling=to_proto(spec.sampling))
        call, got = stub.Generate(request), Outcome()
        try:
            await asyncio.wait_for(self.read(call, got, after_msgs), wait_s)
        except TimeoutError:
            call.cancel()
            got.status = "CANCELLED_BY_CLIENT" if cancel else "HUNG"
        except grpc.aio.AioRpcError as e:
            got.status = e.code().name
        finally:
            slots.release()
        self.record(request.request_id, spec, got)

    @staticmethod
    async def read(call, got: Outcome, after_msgs: int | None) -> None:
        received = 0
        async for msg in call:
            got.tokens.extend(msg.token_ids)
            got.text += msg.text
            got.finish = msg.finish_reason or got.finish
            got.migrations = max(got.migrations, getattr(msg.usage, "migrations", 0))
            received += 1
            if not got.finish and after_msgs is not None and received >= after_msgs:
                call.cancel()
                got.status = "CANCELLED_BY_CLIENT"
                return

    def record(self, rid: str, spec: Spec, got: Outcome) -> None:
        r = self.report
        r.migrated += got.migrations > 0
        if got.status == "OK":
            r.completed += 1
        elif got.status == "CANCELLED_BY_CLIENT":
            r.cancelled += 1
        elif got.status == "HUNG":
            r.hung += 1
        else:
            r.failed_by_status[got.status] = r.failed_by_status.get(got.status, 0) + 1
        why = mismatch(spec, got)
        if why is not None:
            r.token_mismatches += 1
            if len(r.mismatch_examples) < 5:
                r.mismatch_examples.append(f"{rid}: {why}")

    async def kill_loop(self, rng: random.Random) -> None:
        """Kills a random ready worker every kill_every_s, alternating pools, until the duration ends."""
        if self.opts.kill_every_s <= 0:
            return
        pools = ["prefill", "decode"]
        rng.shuffle(pools)
        killed: set[str] = set()
        while self.elapsed() + self.opts.kill_every_s < self.opts.duration_s:
            await asyncio.sleep(self.opts.kill_every_s)
            views = await asyncio.to_thread(self.cluster.call, _ready_views(self.cluster), 10)
            live = [v for v in views if v.name not in killed]
            pick = [v for v in live if v.info.pool == pools[0]] or live
            pools.reverse()
            if pick:
                victim = rng.choice(pick)
                killed.add(victim.name)
                await asyncio.to_thread(ray.kill, victim.actor, no_restart=True)
                self.report.kills.append({"worker": victim.name, "t": round(self.elapsed(), 1)})


async def _ready_views(cluster: LocalCluster) -> list:
    return [v for v in cluster.router.pools.all() if v.state is WorkerState.READY]


# ---- after the load: pools healed, blocks freed ---------------------------------------------
def probe(cluster: LocalCluster) -> tuple[dict[str, str], dict[str, dict | str]]:
    """Pool and check() (block counts, or the error it raised) of every live ready worker."""
    views = cluster.call(_ready_views(cluster), 10)
    pools, checks = {}, {}
    for v in views:
        try:
            checks[v.name] = ray.get(v.actor.check.remote(), timeout=10)
        except worker_calls.CALL_FAILURES as e:
            if worker_calls.outcome(e) is worker_calls.Outcome.REPLACE:
                continue  # dead: not part of the pool
            checks[v.name] = worker_calls.short(e)
        pools[v.name] = v.info.pool
    return pools, checks


def settle(cluster: LocalCluster, report: ChaosReport, opts: ChaosOptions) -> None:
    def counts(pools: dict[str, str]) -> dict[str, int]:
        return {p: sum(1 for q in pools.values() if q == p) for p in report.pools_target}

    end = time.monotonic() + opts.heal_timeout_s
    pools, checks = probe(cluster)
    while counts(pools) != report.pools_target and time.monotonic() < end:
        time.sleep(0.5)
        pools, checks = probe(cluster)
    end = time.monotonic() + opts.drain_timeout_s
    while any(isinstance(c, str) or c["used"] for c in checks.values()) and time.monotonic() < end:
        time.sleep(0.25)
        pools, checks = probe(cluster)
    report.pools_at_end = counts(pools)
    report.leaked_blocks = {n: c["used"] for n, c in checks.items() if isinstance(c, dict)}
    report.integrity_errors = {n: c for n, c in checks.items() if isinstance(c, str)}


def run(model_dir: str, opts: ChaosOptions) -> ChaosReport:
    """The whole soak against a fresh cluster (Ray must be initialized or is started by it)."""
    cfg = cluster_config(model_dir, opts)
    specs = make_specs(cfg, opts.seed)
    with LocalCluster(cfg) as cluster:
        soak = Soak(cluster, specs, opts)
        asyncio.run(soak.drive())
        settle(cluster, soak.report, opts)
    return soak.report


# ---- the command --------------------------------------------------------------------------
def format_table(r: ChaosReport) -> str:
    d = r.to_dict()
    rows = [(k, d[k]) for k in ("seed", "duration_s", "sent", "completed", "cancelled", "completion_rate",
                                "failed_by_status", "hung", "token_mismatches", "migrated", "leaked_blocks",
                                "integrity_errors", "pools_at_end", "pools_target")]
    rows.append(("kills", ", ".join(f"{k['worker']}@{k['t']}s" for k in r.kills) or "none"))
    lines = [f"{k:18}{v}" for k, v in rows] + [f"mismatch: {m}" for m in r.mismatch_examples]
    verdict = "all targets met" if d["targets_met"] else "FAILED: " + "; ".join(d["failed_targets"])
    return "\n".join([*lines, verdict])


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ChaosOptions]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-every", type=float, default=15.0, help="seconds between kills (0 = none)")
    parser.add_argument("--concurrency", type=int, default=12, help="streams in flight")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds before a stream counts as hung")
    parser.add_argument("--cancel-rate", type=float, default=0.1)
    parser.add_argument("--transfer-fail-rate", type=float, default=0.05)
    parser.add_argument("--transfer-delay-rate", type=float, default=0.1)
    parser.add_argument("--transfer-delay-s", type=float, default=0.2)
    parser.add_argument("--model", help="checkpoint directory (default: a fresh tiny llama in a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    problems = [(args.duration > 0, "--duration must be > 0"), (args.kill_every >= 0, "--kill-every must be >= 0"),
                (args.concurrency >= 1, "--concurrency must be >= 1"), (args.deadline > 0, "--deadline must be > 0"),
                (args.transfer_delay_s >= 0, "--transfer-delay-s must be >= 0")]
    problems += [(0 <= getattr(args, k) <= 1, f"--{k.replace('_', '-')} must be in [0, 1]")
                 for k in ("cancel_rate", "transfer_fail_rate", "transfer_delay_rate")]
    if args.model and not os.path.exists(os.path.join(args.model, "config.json")):
        problems.append((False, f"--model {args.model} has no config.json"))
    for ok, why in problems:
        if not ok:
            parser.error(why)
    return args, ChaosOptions(
        duration_s=args.duration, seed=args.seed, kill_every_s=args.kill_every, concurrency=args.concurrency,
        deadline_s=args.deadline, cancel_rate=args.cancel_rate, transfer_fail_rate=args.transfer_fail_rate,
        transfer_delay_rate=args.transfer_delay_rate, transfer_delay_s=args.transfer_delay_s)


def main(argv: list[str] | None = None) -> int:
    args, opts = parse_args(argv)
    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
            model = args.model or str(make_tiny_model(os.path.join(tmp, "tiny-llama"), arch="llama", size="tiny"))
            report = run(model, opts)
    finally:
        ray.shutdown()
    print(json.dumps(report.to_dict()) if args.json else format_table(report))
    return 0 if not report.failed_targets() else 1


if __name__ == "__main__":
    sys.exit(main())
