"""What the planner reads each interval and what it answers: `Observation` in, `Decision` out.

An `Observation` is built by the autoscaler loop (router/autoscale/loop.py) from what the router
already measures over the interval just ended: arrivals and their lengths, the waits of requests
STILL without a first token (not only finished requests' latency), queued prompt tokens, KV-capacity
waits, TTFT/ITL quantiles, and per worker its age, KV use and step records. Plain frozen data: a
test builds one by hand, and the planner never reaches back into the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.telemetry import StepRecord


@dataclass(frozen=True)
class Lengths:
    """Token lengths of the requests in a window (0s when there were none: never NaN)."""

    count: int = 0
    mean: float = 0.0
    p90: float = 0.0

    @classmethod
    def of(cls, values: list[int]) -> Lengths:
        if not values:
            return cls()
        ordered = sorted(values)
        return cls(len(ordered), sum(ordered) / len(ordered), float(ordered[min(len(ordered) - 1,
                                                                              int(0.9 * len(ordered)))]))


@dataclass(frozen=True)
class WorkerSample:
    """One live worker as the interval left it. `age_s`: since it became ready (a worker still
    starting has no sample: it is counted in `PoolObservation.starting`)."""

    name: str
    age_s: float
    kv_used: int  # blocks
    kv_total: int
    block_size: int
    running: int
    waiting: int
    steps: tuple[StepRecord, ...] = ()  # its engine's steps in the window (thinned to a bounded sample)

    @property
    def kv_use(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total else 0.0


@dataclass(frozen=True)
class PoolObservation:
    pool: str
    target: int  # what the pool manager is asked to keep
    starting: int  # workers being started (not capacity yet)
    failed_starts: int  # failed starts in a row (the pool manager backs off and retries)
    draining: int
    workers: tuple[WorkerSample, ...] = ()  # ready workers (warming ones included; the planner tells)
    queued_tokens: int = 0  # prefill: prompt tokens placed on its workers and not yet computed
    scaling: bool = False  # a scale of this pool (starting or draining workers) is still in flight
    start_s: float | None = None  # how long its last worker start-up took (None: none measured yet)


@dataclass(frozen=True)
class Observation:
    now: float
    window_s: float
    mode: str  # "disaggregated" | "colocated"
    arrivals: int = 0
    # the sum of the squares of the arrivals' bunch sizes (arrivals sent together: within 1 ms);
    # 0: not known, read as `arrivals` (no two together, Poisson)
    arrival_bunch_sq: int = 0
    prompt: Lengths = field(default_factory=Lengths)  # of the window's arrivals
    output: Lengths = field(default_factory=Lengths)  # of the window's finished requests (else asked max_tokens)
    finished: int = 0
    asked: Lengths = field(default_factory=Lengths)  # max_tokens the window's arrivals asked for
    prefix_hit_share: float | None = None  # of the prompt tokens placed for prefill in the window, those found cached
    ttft_q_s: float | None = None  # the window's first tokens, at the SLO percentile (None: none)
    itl_q_s: float | None = None  # the window's token gaps as clients saw them, at the percentile
    queued: int = 0  # requests in the router's queue (no worker yet)
    queued_prompt_tokens: int = 0  # their context tokens
    # the tokens to compute of each prompt waiting for its prefill (in the router's queue for a
    # prefill slot, or placed on a prefill worker and not computed), largest first
    waiting_prompts: tuple[int, ...] = ()
    waiting_first: int = 0  # requests without a first token yet, wherever they are
    wait_q_s: float = 0.0  # their wait so far, at the percentile
    oldest_wait_s: float = 0.0
    kv_waiting: int = 0  # requests whose last placement failed for KV room on a decode worker
    kv_waiting_tokens: int = 0  # their context tokens
    decoding: int = 0  # requests streaming tokens
    pools: dict[str, PoolObservation] = field(default_factory=dict)


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    desired: int  # the size the planner asks for
    actual: int  # ready, warmed-up workers: the capacity it counted
    target: int  # the pool's target before this decision
    reason: str
    # what decided it: forecast (load + backlog), slo (missed now), survivors (scale-down), steady,
    # cooldown, pending (workers starting / a scale in flight), bounds (min/max), budget
    cause: str = "steady"


@dataclass(frozen=True)
class Decision:
    """One evaluation: per pool desired vs actual and why; `changed`: it asked a pool for a new
    size. `inputs`: the figures it decided on (forecast, backlog, capacity per worker), all finite
    (`<pool>_load` is -1 while an online profile has seen too few steps to size the pool)."""

    at: float
    pools: dict[str, PoolDecision]
    reason: str
    changed: bool
    inputs: dict[str, float]

    def desired(self, pool: str) -> int:
        return self.pools[pool].desired if pool in self.pools else 0

    def line(self) -> str:
        """The decision on one log line: per pool ready (warm) / target -> desired, reason, inputs."""
        sizes = " ".join(f"{p.pool} {p.actual}/{p.target}->{p.desired}" for p in self.pools.values())
        figures = " ".join(f"{k}={v:.4g}" for k, v in self.inputs.items())
        return f"autoscale{' CHANGE' if self.changed else ''}: {sizes}; {self.reason}; {figures}"
