"""`torch_threads: auto`: how many intra-op threads a CPU worker's torch runs.

The rule, measured on a 2-core host with `python -m scripts.bench_peer` (docs/engine_speed.md,
"Threads"): a colocated worker runs twice its Ray CPU share in threads, a prefill or decode
worker of a disaggregated cluster its share, both capped at the cores the process may run on;
a worker pinned to one core (`cpus`) runs one. Two colocated workers, each doing prefill and
decode in turn, are rarely busy at the same instant, and threads that spill onto the core the
other leaves idle served 1.5-1.9x the output tokens of one pinned thread each. A prefill and a
decode worker side by side gained nothing from a second thread (-12% to +6% tok/s) and the
decode worker's ITL tail grew with the prefill worker's extra threads.
"""

from __future__ import annotations

import math
import os


def auto_threads(cpu_share: float, pinned: bool, colocated: bool, cores: int | None = None) -> int:
    """The `auto` thread count for a worker holding `cpu_share` of Ray's CPUs; `cores` defaults to
    the cores this process may run on."""
    if pinned:
        return 1
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    per_cpu = 2 if colocated else 1
    return max(1, min(cores, per_cpu * math.ceil(max(cpu_share, 1.0))))


def ray_cpu_share() -> float:
    """The CPUs Ray assigned the calling actor (its pool's `num_cpus`; 1 outside an actor)."""
    import ray

    return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0))
