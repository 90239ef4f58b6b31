"""Hand-built observations for the planner's unit tests: a worker, a pool, an interval."""

from __future__ import annotations

from protocol.telemetry import StepRecord
from router.autoscale.observation import Lengths, Observation, PoolObservation, WorkerSample
from router.autoscale.planner import Planner
from router.autoscale.profile import CapacityProfile, CostStepModel
from router.config.autoscale import AutoscaleSection
from router.config.emulate import EmulateSection, emulation

H100_8B = emulation(EmulateSection(device="h100", model="llama-3.1-8b"))
BUDGET, CHUNK, MAX_SEQS = 8192, 2048, 256  # simulate/gpu_cluster.yaml's scheduler
KV_BLOCKS = 10_000  # per worker, 16-token blocks


def profile(source: str = "cost_model") -> CapacityProfile:
    prior = CostStepModel(H100_8B.cost) if source != "online" else None
    return CapacityProfile(source, prior, BUDGET, CHUNK, MAX_SEQS)


def planner(mode: str = "disaggregated", source: str = "cost_model", **auto) -> Planner:
    return Planner(AutoscaleSection(enabled=True, **auto), mode, profile(source))


def worker(name: str, age_s: float = 1000.0, kv_used: int = 0, running: int = 0,
           steps: tuple[StepRecord, ...] = ()) -> WorkerSample:
    return WorkerSample(name, age_s, kv_used, KV_BLOCKS, 16, running, 0, steps)


def pool(name: str, workers: list[WorkerSample] | int, target: int | None = None, starting: int = 0,
         failed: int = 0, queued_tokens: int = 0, scaling: bool = False) -> PoolObservation:
    if isinstance(workers, int):
        workers = [worker(f"{name}-{i}") for i in range(workers)]
    target = len(workers) + starting if target is None else target
    return PoolObservation(name, target, starting, failed, 0, tuple(workers), queued_tokens, scaling)


def interval(now: float, prefill: PoolObservation | None, decode: PoolObservation, arrivals: int = 0,
             prompt: int = 1000, output: int = 100, window_s: float = 10.0, **kw) -> Observation:
    pools = {"decode": decode} | ({"prefill": prefill} if prefill is not None else {})
    mode = "disaggregated" if prefill is not None else "colocated"
    lengths = (Lengths(arrivals, prompt, prompt), Lengths(arrivals, output, output)) if arrivals else (Lengths(),
                                                                                                      Lengths())
    return Observation(now=now, window_s=window_s, mode=mode, arrivals=arrivals, prompt=lengths[0],
                       output=lengths[1], pools=pools, **kw)


def decode_step(seq: int, batch: int, context: int, wall_s: float) -> StepRecord:
    """A decode-only step of `batch` requests at `context` tokens each."""
    return StepRecord(seq, float(seq), wall_s, batch, 0, 0, 0, 0, 0, 0, batch * context, batch * context)
