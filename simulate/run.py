"""One simulated run: a cluster config and a workload in, `pdserve bench`'s records out.

The router is built with simulated workers (simulate/actors.py), a validator holding the
emulated model's limits (no tokenizer: requests are token ids), and attempt nonces from the
seed. The client side does what the gRPC door and bench's client do: each request arrives at
its time, is accepted (`Router.accept`: the request checks the door runs) and streamed
(`Router.generate`); every message's arrival is stamped on the virtual clock and a refusal is
recorded with the gRPC status the door would send. Afterwards every worker's step records are
read through its `telemetry` call, as the bench reads a live cluster's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import looptime

from bench.accounting import RecordingActors, WorkerLedger
from bench.bottleneck import step_records_to_dicts
from bench.metrics import RequestRecord
from bench.workload import RequestSpec, Workload
from protocol import clock
from protocol.sampling import SamplingParams
from protocol.validation import RequestValidator
from router.config.schema import ClusterConfig
from router.frontdoor.grpc_server import STATUS
from router.lifecycle.service import Router
from simulate.actors import SimActors
from simulate.serving import ServingFit
from sizing.cost_model import Emulation
from sizing.memory import ModelShape

log = logging.getLogger(__name__)
T = TypeVar("T")
HORIZON_S = 3600.0  # simulated seconds past the last arrival after which a request still open is a failure


@dataclass
class SimRun:
    """What one run produced: the client's records, each worker's step records (bench's
    `collect_steps` shape), and what it cost: simulated and host seconds."""

    records: list[RequestRecord]
    steps: dict[str, Any]
    simulated_s: float
    host_s: float
    workers: dict[str, str]  # name -> pool, every worker that ran
    link: dict[str, float]
    checks: dict[str, dict] = dataclasses.field(default_factory=dict)  # each worker's block accounting at the end
    ledger: WorkerLedger = dataclasses.field(default_factory=WorkerLedger)  # every worker's life, virtual clock
    t0: float = 0.0  # the virtual clock at the workload's time 0 (after the first workers started)
    decisions: list[dict] | None = None  # the planner's, when router.autoscale ran one (else None)

    @property
    def end(self) -> float:
        return self.t0 + self.simulated_s


def simulate(config: ClusterConfig, emulation: Emulation, workload: Workload, label: str, seed: int = 0,
             rpc_s: float | None = None, check: bool = True, serving: ServingFit | None = None) -> SimRun:
    """Runs `workload` on `config`'s cluster on a fresh virtual clock; deterministic for a seed.
    `check`: every worker's block accounting at the end (`SimRun.checks`; a pass over its pool).
    `serving`: a real host's serving path (simulate/serving.py): its door and call latencies, and
    the spread of its steps and token deliveries, drawn by the seed."""
    began = time.perf_counter()
    run = run_virtual(lambda: _run(config, emulation, workload, label, seed, rpc_s, check, serving))
    run.host_s = time.perf_counter() - began
    return run


def run_virtual(main: Callable[[], Awaitable[T]]) -> T:
    """`main()` on a fresh virtual clock (looptime: time jumps to the next timer when nothing is
    ready; ns resolution, so no step time is rounded away), then, as `asyncio.run` does, every task
    still pending (a worker's loop, a poll; an error ended `main` early) cancelled and let end
    before the loop closes, so none is left to be destroyed pending."""
    loop = looptime.new_event_loop(start=0.0, noop_cycles=0, resolution=1e-9)
    loop.unix_epoch = 0.0  # step records' end_unix: simulated seconds (protocol.clock.unix)
    try:
        return loop.run_until_complete(main())
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()


async def _run(config: ClusterConfig, emulation: Emulation, workload: Workload, label: str, seed: int,
               rpc_s: float | None, check: bool, serving: ServingFit | None) -> SimRun:
    shape = emulation.cost.shape
    if rpc_s is None and serving is not None:
        rpc_s = serving.rpc_s
    spread = None if serving is None else functools.partial(serving.step_factor, seed)
    handoff = None if serving is None else functools.partial(serving.handoff, seed)
    actors = SimActors(emulation, shape, config.kv_cache.block_size, **({} if rpc_s is None else {"rpc_s": rpc_s}),
                       spread=spread, handoff=handoff)
    recording = RecordingActors(actors)  # every worker's life, for the worker-hours
    rng = random.Random(seed)
    router = Router(config, actors=recording, validator=_validator(shape, config), nonce=lambda: f"{rng.getrandbits(64):016x}")
    await router.start()
    t0 = clock.now()
    client = _Client(router, label, t0, serving, seed)
    tasks = []
    for spec in workload.requests:
        delay = t0 + spec.arrival_s - clock.now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.send(spec)))
    done, late = await asyncio.wait(tasks, timeout=HORIZON_S) if tasks else (set(), set())
    for task in late:  # the router's own deadlines end every request long before: a bug if any is left
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    records = [t.result() if t in done else _unfinished(spec, label) for t, spec in zip(tasks, workload.requests,
                                                                                          strict=True)]
    simulated = clock.now() - t0
    decisions = planner_decisions(router)
    steps = await _steps(router, t0)
    checks = {w.name: await w.actor.check.remote() for w in router.pools.all() if not w.stopped} if check else {}
    workers = {name: ("prefill" if name.startswith("prefill") else "decode") for name in actors.workers}
    await _teardown(router, actors)
    link = {"pieces": actors.link.pieces, "busy_s": actors.link.busy_s}
    return SimRun(records, steps, simulated, 0.0, workers, link, checks, recording.ledger, t0, decisions)


def planner_decisions(router: Router) -> list[dict] | None:
    """The planner's decisions as plain dicts (they cross a process boundary in a sweep); None
    when the router runs no planner."""
    planner = getattr(router, "autoscaler", None)
    if planner is None:
        return None
    return [d if isinstance(d, dict) else dataclasses.asdict(d) for d in planner.decisions]


async def _teardown(router: Router, actors: SimActors) -> None:
    """Every request has ended: stop the monitor and every worker's loop and let their tasks end
    (an orderly `Router.stop` would close each prefill/decode pair's channel: N^2 calls for nothing)."""
    router.accepting = False
    router.monitor.stop()
    for worker in actors.workers.values():
        worker.core.stop()
    pending = asyncio.all_tasks() - {asyncio.current_task()}
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    router.intake.shutdown()


def _unfinished(spec: RequestSpec, label: str) -> RequestRecord:
    log.error("request %s did not finish within %g simulated s of the last arrival", spec.request_id, HORIZON_S)
    return RequestRecord(spec.request_id, label, spec.arrival_s, (), (), spec.num_prompt_tokens, spec.max_tokens,
                         "", f"UNFINISHED: no end within {HORIZON_S:g} simulated s of the last arrival")


def _validator(shape: ModelShape, config: ClusterConfig) -> RequestValidator:
    """The request limits of the emulated model: its vocabulary and context (token ids only)."""
    max_len = config.model.max_model_len or shape.max_positions or 131_072
    return RequestValidator(None, shape.vocab_size or 32_000, max_len, config.router.max_prompt_bytes)


async def _steps(router: Router, t0: float) -> dict[str, Any]:
    out = {}
    for w in router.pools.all():
        if w.stopped:
            continue
        records = await w.actor.telemetry.remote(0)
        out[w.name] = {"pool": w.info.pool, "blocks_total": w.info.num_blocks,
                       "steps": step_records_to_dicts(records, t0)}
    return out


class _Client:
    def __init__(self, router: Router, label: str, t0: float, serving: ServingFit | None, seed: int):
        self.router, self.label, self.t0 = router, label, t0
        self.serving, self.seed = serving, seed

    async def send(self, spec: RequestSpec) -> RequestRecord:
        """Streams one request as bench's gRPC client does; a refusal is recorded, never raised."""
        times: list[float] = []
        counts: list[int] = []
        finish, error, usage = "", None, {}
        send_s = clock.now() - self.t0
        sampling = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
        if self.serving is not None:  # the real door's way in
            await asyncio.sleep(self.serving.intake_s)
        try:
            self.router.check_open()
            life = self.router.accept(spec.request_id, list(spec.prompt_token_ids), sampling)
            async for chunk in self.router.generate(life):
                if chunk.token_ids:
                    times.append(self._arrival(spec.request_id, times))
                    counts.append(len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason.public
                if chunk.usage is not None:
                    usage = dataclasses.asdict(chunk.usage)
        except tuple(STATUS) as e:
            error = f"{STATUS[type(e)].name}: {e}"
        return RequestRecord(spec.request_id, self.label, send_s, tuple(times), tuple(counts),
                             spec.num_prompt_tokens, spec.max_tokens, finish, error, usage)

    def _arrival(self, request_id: str, times: list[float]) -> float:
        """When a message the router sends now reaches the client: at once, or after the real host's
        delivery delay for it (never before the message sent ahead of it)."""
        at = clock.now() - self.t0
        if self.serving is None:
            return at
        return max(times[-1] if times else 0.0, at + self.serving.delivery(self.seed, request_id, len(times)))
