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
worker: libgomp reads it once, as torch loads): a worker with more threads than its CPU share
(colocated workers, by the rule above) shares its cores with other workers, and its threads sleep
at once (`OMP_WAIT_POLICY=PASSIVE`) instead of spinning on a core another worker is computing on
(two colocated workers of 2 threads each: 12.9 tok/s spinning, 41.9 passive). A worker whose
threads fit its share spins briefly, then sleeps: `GOMP_SPINCOUNT` = `SPIN_COUNT` pauses, 0.2 ms
where a pause takes 20 ns (Sapphire and Emerald Rapids), so the next op of a step still finds
its threads awake (one worker owning 2 cores, quiet: 47.2 tok/s spinning, 38.2 passive).
libgomp's default, 300,000 pauses (6 ms there), made served steps collapse on a 2-core Emerald
Rapids host, where the router, the client and Ray share the worker's cores: 16-row decode steps
of 600-900 ms for tens of seconds, likely a descheduled thread at each of a step's ~100 joins.
Served there (docs/engine_speed.md, "One OpenMP team per worker"), one worker owning both cores
collapsed in 4 of 4 runs at the default, 2 of 4 at 100,000 pauses, none of 4 at 10,000 or passive.
"""

from __future__ import annotations

import math
import os

UNCAPPED = 1 << 16  # `auto_threads(cores=)` where the worker's node is not known
SPIN_COUNT = 10_000  # GOMP_SPINCOUNT of a worker whose threads fit its CPU share (module docstring)


def auto_threads(cpu_share: float, pinned: bool, colocated: bool, cores: int | None = None) -> int:
    """The `auto` thread count for a worker holding `cpu_share` of Ray's CPUs; `cores` defaults to
    the cores this process may run on."""
    if pinned:
        return 1
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    per_cpu = 2 if colocated else 1
    return max(1, min(cores, per_cpu * math.ceil(max(cpu_share, 1.0))))


def wait_env(torch_threads: int | None, cpu_share: float, colocated: bool, pinned: bool) -> dict[str, str]:
    """The OpenMP wait policy a worker starts with (see the module's docstring): for a team of two or
    more threads (`torch_threads`, else the `auto` count before the node's core cap), PASSIVE when
    they outnumber its Ray CPU share, else `SPIN_COUNT` pauses of spinning; nothing for one thread.
    An OMP_WAIT_POLICY or GOMP_SPINCOUNT in the router's environment wins: workers inherit it."""
    if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
        return {}
    threads = torch_threads or auto_threads(cpu_share, pinned, colocated, cores=UNCAPPED)
    if threads <= 1:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"} if threads > cpu_share else {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def waits_described() -> str:
    """How this process's OpenMP threads wait, from the settings libgomp read, for a worker's log line."""
    policy, spins = os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")
    if spins is not None:
        return f"spin {spins} pauses, then sleep"
    return policy.lower() if policy else "libgomp's default spin"


def ray_cpu_share() -> float:
    """The CPUs Ray assigned the calling actor (its pool's `num_cpus`; 1 outside an actor)."""
    import ray

    return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0))
