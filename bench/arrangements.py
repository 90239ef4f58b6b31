"""The arrangements `pdserve bench` compares at equal worker count, and the policy variants of a cluster."""

from __future__ import annotations

import dataclasses

from router.config.schema import POLICIES, ClusterConfig

ARRANGEMENTS = ("colocated", "colocated-chunked", "disaggregated", "disaggregated-chunked")


def arrangement_config(base: ClusterConfig, name: str, total_workers: int, pin_cpus: bool = False,
                       prefill_workers: int | None = None) -> ClusterConfig:
    """`base` rearranged as `name` with the same total worker count (equal cost); a disaggregated
    arrangement gives `prefill_workers` of them to prefill (default half), so P:D ratios compare
    at equal cost too; with `pin_cpus`, worker i of the arrangement gets core i to itself. A
    `-chunked` arrangement cuts prompts into chunks on its prefill workers too (a prefill worker
    otherwise takes them whole: `scheduler.chunk_prefill_workers`)."""
    if name not in ARRANGEMENTS:
        raise ValueError(f"unknown arrangement {name!r}; choose from {', '.join(ARRANGEMENTS)}")
    disagg = name.startswith("disaggregated")
    if disagg and total_workers < 2:
        raise ValueError("a disaggregated arrangement needs at least 2 workers")
    chunk = (base.scheduler.chunk_size or 64) if name.endswith("chunked") else None
    if disagg and prefill_workers is not None and not 1 <= prefill_workers < total_workers:
        raise ValueError(f"{prefill_workers} prefill workers of {total_workers} leave no decode worker"
                         if prefill_workers >= total_workers else "a disaggregated arrangement needs a prefill worker")
    prefill_n = (prefill_workers or max(1, total_workers // 2)) if disagg else 0
    prefill_cpus = list(range(prefill_n)) if pin_cpus else base.prefill.cpus
    decode_cpus = list(range(prefill_n, total_workers)) if pin_cpus else base.decode.cpus
    return dataclasses.replace(
        base, mode="disaggregated" if disagg else "colocated",
        prefill=dataclasses.replace(base.prefill, replicas=prefill_n, cpus=prefill_cpus),
        decode=dataclasses.replace(base.decode, replicas=total_workers - prefill_n, cpus=decode_cpus),
        scheduler=dataclasses.replace(base.scheduler, chunk_size=chunk, chunk_prefill_workers=chunk is not None))


def policy_config(base: ClusterConfig, policy: str, prefill_workers: int, decode_workers: int,
                  pin_cpus: bool = False) -> ClusterConfig:
    """`base` as a disaggregated cluster of `prefill_workers` + `decode_workers` whose router
    places requests in both pools by `policy` (per-pool overrides cleared); with `pin_cpus`,
    the prefill workers get cores 0.. and the decode workers the cores after them."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if prefill_workers < 1 or decode_workers < 1:
        raise ValueError("a disaggregated cluster needs at least 1 prefill and 1 decode worker")
    total = prefill_workers + decode_workers
    return dataclasses.replace(
        base, mode="disaggregated",
        router=dataclasses.replace(base.router, policy=policy, prefill_policy=None, decode_policy=None),
        prefill=dataclasses.replace(base.prefill, replicas=prefill_workers,
                                    cpus=list(range(prefill_workers)) if pin_cpus else base.prefill.cpus),
        decode=dataclasses.replace(base.decode, replicas=decode_workers,
                                   cpus=list(range(prefill_workers, total)) if pin_cpus else base.decode.cpus))
