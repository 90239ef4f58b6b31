"""The autoscaler: every `interval_s` it observes the router, asks the planner, applies the answer.

Started by `Router.start()` when `router.autoscale.enabled`, stopped by `Router.stop()` (a
simulation's teardown cancels its tasks like every other). All timing is `protocol.clock` and
every wait an `asyncio.sleep`, so it runs unchanged on `pdserve simulate`'s virtual clock.

An evaluation runs every `interval_s`, or sooner when a request has waited for its first token
longer than a quarter of the TTFT SLO past its own prefill. Each builds an `Observation` (router/autoscale/observation.py)
from the router's own state (its request lives: queue, waits of requests still without a first token, KV waits; the
pool manager's health and each ready worker's last stats; each worker's step records since the
last evaluation, read through its `telemetry` call within half an interval), calls
`Planner.decide`, logs the decision on one line, exports it as metrics and appends it to
`decisions`. A new size goes to the pool manager (`Router.scale`: starts workers, or drains them
with nothing lost) as a task of its own, so a long drain never delays the next evaluation; while a
pool's scale is in flight the planner holds that pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from protocol import clock
from protocol.deadline import within
from protocol.telemetry import StepRecord
from router.autoscale.observation import (
    Decision,
    Lengths,
    Observation,
    PoolObservation,
    WorkerSample,
)
from router.autoscale.planner import Planner
from router.autoscale.profile import CapacityProfile, CostStepModel
from router.config.autoscale import read_measured_profile
from router.config.emulate import emulation
from router.config.schema import ClusterConfig
from router.lifecycle.life import Phase
from router.lifecycle.worker_calls import CALL_FAILURES, short
from router.observability.recent import RecentLoad
from router.pools.worker_view import WorkerState, WorkerView
from sizing.cost_model import Emulation

Router = Any  # router/lifecycle/service.py's Router, which builds this (importing it here would be a cycle)

log = logging.getLogger(__name__)
STEPS_PER_WORKER = 512  # step records a worker contributes per evaluation (evenly thinned beyond)
URGENT_CHECKS = 10  # looks an interval for requests waiting past URGENT_SHARE of the TTFT SLO (then decides at once)
URGENT_SHARE = 0.25  # of the TTFT SLO, counted past the prompt's own prefill: a start-up must still fit in the rest


def build_profile(cfg: ClusterConfig, emulating: Emulation | None) -> CapacityProfile:
    """The configured source's profile: the emulated device's cost model (`emulating`, also the
    online prior), or the measured fit in `measured_profile`."""
    auto = cfg.router.autoscale
    prior = CostStepModel(emulating.cost) if emulating is not None else None
    if auto.profile == "measured":
        section = read_measured_profile(auto.measured_profile, cfg.kv_cache.block_size, "cluster.yaml")
        prior = CostStepModel(emulation(section).cost)
    return CapacityProfile(auto.profile, prior, cfg.step_tokens(cfg.decode), cfg.scheduler.chunk_size,
                           cfg.scheduler.max_num_seqs)


ROLE_CHANGE_S = 1.0  # a role change once drained (measured 0.1-0.5 s on a CPU worker: docs/roles.md)


class Autoscaler:
    def __init__(self, router: Router):
        self.router = router
        self.cfg = router.config.router.autoscale
        self.planner = Planner(self.cfg, router.config.mode, build_profile(router.config, router.pools.emulation))
        self.decisions: list[Decision] = []
        self.next_at: float | None = None  # when the next evaluation runs (status shows it)
        self.recent = router.metrics.recent = RecentLoad()
        self._last_at: float | None = None
        self._step_seq: dict[str, int] = {}  # worker name -> the last step record read
        self._prefix_seen = (0, 0)  # the prefill stage's prefix-cache totals at the last evaluation
        self._scaling: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._last_at = clock.now()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        for task in [self._task, *self._scaling.values()]:
            if task is not None:
                task.cancel()

    async def _run(self) -> None:
        while True:
            self.next_at = clock.now() + self.cfg.interval_s
            await self._until_due()
            try:
                await self.evaluate()
            except Exception:  # a bug must not end autoscaling for good: logged loudly, next interval retries
                log.exception("autoscale: the evaluation failed")

    async def _until_due(self) -> None:
        """Until `next_at`, or sooner once a request has waited for its first token, past its own
        prefill, longer than URGENT_SHARE of the TTFT SLO (checked URGENT_CHECKS times an interval): a burst is answered when it shows,
        not up to an interval later (as AIBrix's panic window does beside its stable window)."""
        tick = self.cfg.interval_s / URGENT_CHECKS
        while clock.now() < self.next_at:
            await asyncio.sleep(min(tick, self.next_at - clock.now()))
            if self._urgent():
                return

    def _urgent(self) -> bool:
        since = clock.now() - self.cfg.ttft_s * URGENT_SHARE
        own = self._own_prefill_s()
        return any(life.first_token_at is None and not life.ended and life.accepted + own(life) < since
                   for life in self.router.lives.values())

    def _own_prefill_s(self) -> Callable[[Any], float]:
        """A request's own prefill by the profile (0 while it has none): waiting that long is no backlog."""
        pool = "prefill" if self.router.config.mode == "disaggregated" else "decode"
        profile = self.planner.profile
        if not profile.ready(pool):
            return lambda life: 0.0
        return lambda life: profile.prefill_time_s(pool, len(life.prompt_token_ids))

    async def evaluate(self) -> Decision:
        """One evaluation: observe, decide, log, export, apply."""
        decision = self.planner.decide(await self.observe())
        self.decisions.append(decision)
        log.info("%s", decision.line(), extra={"decision": decision})  # the record carries it for tools
        changes = {}
        for p in decision.pools.values():
            self.router.metrics.observe_autoscale(p.pool, p.desired, p.actual, p.target, p.cause)
            if p.desired != p.target:
                changes[p.pool] = p.desired
        loop = asyncio.get_running_loop()
        growing = {pool for pool, size in changes.items() if size > self.router.pools.health[pool].target}
        if self.cfg.role_change and len(changes) == 2 and len(growing) == 1:  # one grows, the other shrinks
            task = loop.create_task(self._rebalance(changes))
            self._scaling.update(dict.fromkeys(changes, task))
        else:
            for pool, size in changes.items():
                self._scaling[pool] = loop.create_task(self._scale(pool, size))
        return decision

    @property
    def scaling_actions(self) -> int:
        return sum(d.changed for d in self.decisions)

    async def _scale(self, pool: str, replicas: int) -> None:
        try:
            await self.router.scale(pool, replicas)
        except Exception as e:  # noqa: BLE001 - a start Ray refused or that failed: the pool keeps retrying,
            log.warning("autoscale: scaling the %s pool to %d failed: %s", pool, replicas, short(e))  # status shows it

    async def _rebalance(self, sizes: dict[str, int]) -> None:
        """One pool grows while the other shrinks: a worker of the shrinking pool changes role,
        weights kept (docs/roles.md), in place of a start-up, when that is sooner: its drain (the
        longest of its requests still to run, estimated) plus a change is shorter than the growing
        pool's last start-up. One at a time, least to drain first; the rest goes through the pools'
        usual start and drain."""
        pools = self.router.pools
        grow, shrink = sorted(sizes, key=lambda pool: sizes[pool] < pools.health[pool].target)
        while pools.health[grow].target < sizes[grow] and pools.health[shrink].target > sizes[shrink]:
            start_s = pools.health[grow].start_s
            drains = sorted((self._drain_estimate_s(w), w.name, w) for w in pools.ready(shrink))
            if not drains or start_s is None or drains[0][0] + ROLE_CHANGE_S >= start_s:
                break
            try:
                await pools.change_role(drains[0][2], grow)
            except Exception as e:  # noqa: BLE001 - CannotChangeRole (pools unlike), a failed change: start instead
                log.info("autoscale: no role change from %s to %s (%s); starting instead", shrink, grow, short(e))
                break
        await asyncio.gather(*(self._scale(pool, size) for pool, size in sizes.items()))

    def _drain_estimate_s(self, w: WorkerView) -> float:
        """Until `w` holds none of the router's requests: the longest of them to run, each its
        tokens still to come at the last decision's ITL, plus a TTFT for one still before its first."""
        inputs = self.decisions[-1].inputs if self.decisions else {}
        itl, ttft = inputs.get("itl_q_s", self.cfg.itl_s), inputs.get("ttft_q_s", self.cfg.ttft_s)
        return max((max(0, life.sampling.max_tokens - len(life.output_token_ids)) * itl
                    + (ttft if life.first_token_at is None else 0.0)
                    for life in self.router.lives.values() if w in (life.decode, life.prefill) and not life.ended),
                   default=0.0)

    # ---- the observation ---------------------------------------------------------------------
    async def observe(self) -> Observation:
        now = clock.now()
        window = now - (self._last_at if self._last_at is not None else now - self.cfg.interval_s)
        self._last_at = now
        seen = self.recent.take()
        q = self.cfg.percentile / 100
        prompt_pool = "prefill" if self.router.config.mode == "disaggregated" else "decode"
        profile = self.planner.profile
        own = (lambda tokens: profile.prefill_time_s(prompt_pool, tokens)) if profile.ready(prompt_pool) else None
        lives = _Lives.of(self.router, now, q, own)
        prefill, decode = await asyncio.gather(self._pool("prefill", now), self._pool("decode", now))
        pools = {"prefill": prefill, "decode": decode}
        outputs = seen.output_lengths or seen.asked_output
        placed = [n for w in self.router.pools.workers[prompt_pool] if not w.stopped for n in w.prefill_tokens.values()]
        lives.waiting_prompts = tuple(sorted(lives.waiting_prompts + tuple(placed), reverse=True))
        return Observation(
            now=now, window_s=window, mode=self.router.config.mode, arrivals=seen.arrivals,
            arrival_bunch_sq=seen.bunch_sq,
            prompt=Lengths.of(seen.prompt_lengths), output=Lengths.of(outputs), finished=len(seen.output_lengths),
            asked=Lengths.of(seen.asked_output),
            prefix_hit_share=self._hit_share(),
            ttft_q_s=seen.ttft.quantile(q), itl_q_s=seen.itl.quantile(q), pools=pools,
            **dataclasses.asdict(lives))

    def _hit_share(self) -> float | None:
        """Of the prompt tokens the prefill stage looked up since the last evaluation, the share
        its prefix caches held (None: none looked up)."""
        stage = "decode" if self.router.config.mode == "colocated" else "prefill"
        query, hit = self.router.metrics.prefix_totals(stage)
        (q0, h0), self._prefix_seen = self._prefix_seen, (query, hit)
        return (hit - h0) / (query - q0) if query > q0 else None

    async def _pool(self, pool: str, now: float) -> PoolObservation:
        pm = self.router.pools
        health, workers = pm.health[pool], pm.workers[pool]
        ready = [w for w in workers if w.state is WorkerState.READY]
        steps = await asyncio.gather(*(self._steps(w) for w in ready))
        samples = tuple(_sample(w, now, s) for w, s in zip(ready, steps, strict=True))
        scaling = self._scaling.get(pool)
        return PoolObservation(pool, health.target, health.starting, health.failures_in_a_row,
                               sum(w.state is WorkerState.DRAINING for w in workers), samples,
                               sum(sum(w.prefill_tokens.values()) for w in workers if not w.stopped),
                               scaling=scaling is not None and not scaling.done(), start_s=health.start_s)

    @property
    def _steps_deadline_s(self) -> float:
        """A busy engine answers `telemetry` between steps: a worker stuck in a long step gives no
        records this time rather than delaying the decision (its records come next time)."""
        return min(self.router.config.router.call_timeout_s, self.cfg.interval_s / 2)

    async def _steps(self, w: WorkerView) -> tuple[StepRecord, ...]:
        """`w`'s step records since the last evaluation (none if it does not answer in time)."""
        try:
            records = await within(w.actor.telemetry.remote(self._step_seq.get(w.name, 0)), self._steps_deadline_s)
        except CALL_FAILURES as e:
            log.debug("autoscale: no step records from %s: %s", w.name, short(e))
            return ()
        if records:
            self._step_seq[w.name] = records[-1].seq
        stride = -(-len(records) // STEPS_PER_WORKER)
        return tuple(records[::stride]) if stride > 1 else tuple(records)


def _sample(w: WorkerView, now: float, steps: tuple[StepRecord, ...]) -> WorkerSample:
    s = w.stats
    used = s.blocks_used if s is not None else w.info.num_blocks - w.free_blocks
    return WorkerSample(w.name, now - w.ready_at, used, w.info.num_blocks, w.info.block_size,
                        w.running, w.waiting, steps)


@dataclasses.dataclass
class _Lives:
    """The requests the router holds now, as the planner reads them."""

    queued: int = 0
    queued_prompt_tokens: int = 0
    waiting_first: int = 0
    wait_q_s: float = 0.0
    oldest_wait_s: float = 0.0
    kv_waiting: int = 0
    kv_waiting_tokens: int = 0
    decoding: int = 0
    waiting_prompts: tuple[int, ...] = ()  # the router queue's, for a prefill slot (the loop adds the placed ones)

    @classmethod
    def of(cls, router: Router, now: float, q: float, own: Callable[[int], float] | None = None) -> _Lives:
        """`own`: a prompt's own prefill time by the profile; a wait counts past it (a prompt whose
        own prefill is longer than the TTFT SLO misses it on any number of workers: more do not help)."""
        out, waits, queued = cls(), [], []
        for life in router.lives.values():
            if life.ended:
                continue
            if life.first_token_at is None:
                waits.append(now - life.accepted - (own(len(life.prompt_token_ids)) if own else 0.0))
            if life.phase is Phase.QUEUED:
                out.queued += 1
                out.queued_prompt_tokens += life.num_context_tokens()
            elif life.phase in (Phase.HANDOFF, Phase.DECODING):
                out.decoding += 1
            if life.waiting_for == "kv":  # queued for it, or (decode_reservation: after_prefill) its
                out.kv_waiting += 1       # KV computed and held on the prefill worker meanwhile
                out.kv_waiting_tokens += life.num_context_tokens()
            elif life.phase is Phase.QUEUED:
                queued.append(life.num_context_tokens())
        out.waiting_prompts = tuple(queued)
        if waits:
            waits.sort()
            out.waiting_first, out.oldest_wait_s = len(waits), waits[-1]
            out.wait_q_s = waits[min(len(waits) - 1, int(q * len(waits)))]
        return out
