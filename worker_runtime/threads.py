"""`torch_threads: auto`: how many intra-op threads a CPU worker's torch runs.

The rule, measured on a 2-core host with `python -m bench.peer` (docs/engine_speed.md,
"Threads"): a colocated worker runs twice its Ray CPU share in threads, a prefill or decode
worker of a disaggregated cluster its share, both capped at the cores the process may run on;
a worker pinned to one core (`cpus`) runs one. Two colocated workers, each doing prefill and
decode in turn, are rarely busy at the same instant, and threads that spill onto the core the
other leaves idle served 1.5-1.9x the output tokens of one pinned thread each. A prefill and a
decode worker side by side gained nothing from a second thread (-12% to +6% tok/s) and the
decode worker's ITL tail grew with the prefill worker's extra threads.

How a worker's idle OpenMP threads wait between ops (`wait_env`, set when the router starts the
worker: libgomp reads it once, as torch loads): a worker whose threads fit in its CPU share keeps
GNU OpenMP's default, spinning a few milliseconds before sleeping, so the next op finds them
awake; a worker with more threads than its share (colocated workers, by the rule above) shares
its cores with other workers, and its threads sleep at once (`OMP_WAIT_POLICY=PASSIVE`) instead
of spinning on a core another worker is computing on. Measured (docs/engine_speed.md, "One
OpenMP team per worker"): two colocated workers of 2 threads each served 12.9 tok/s spinning and
41.9 passive; one worker owning both cores 47.2 spinning and 38.2 passive.
"""

from __future__ import annotations

import math
import os

UNCAPPED = 1 << 16  # `auto_threads(cores=)` where the worker's node is not known


def auto_threads(cpu_share: float, pinned: bool, colocated: bool, cores: int | None = None) -> int:
    """The `auto` thread count for a worker holding `cpu_share` of Ray's CPUs; `cores` defaults to
    the cores this process may run on."""
    if pinned:
        return 1
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    per_cpu = 2 if colocated else 1
    return max(1, min(cores, per_cpu * math.ceil(max(cpu_share, 1.0))))


def wait_env(torch_threads: int | None, cpu_share: float, colocated: bool, pinned: bool) -> dict[str, str]:
    """The OpenMP wait policy a worker starts with (see the module's docstring): PASSIVE when its
    threads (`torch_threads`, else the `auto` count before the node's core cap) outnumber its Ray
    CPU share, else nothing (libgomp's spinning default). An OMP_WAIT_POLICY or GOMP_SPINCOUNT
    in the router's environment wins: workers inherit it."""
    if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
        return {}
    threads = torch_threads or auto_threads(cpu_share, pinned, colocated, cores=UNCAPPED)
    return {"OMP_WAIT_POLICY": "PASSIVE"} if threads > 1 and threads > cpu_share else {}


def ray_cpu_share() -> float:
    """The CPUs Ray assigned the calling actor (its pool's `num_cpus`; 1 outside an actor)."""
    import ray

    return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0))
