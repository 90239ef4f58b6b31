"""Independent simulation runs on several processes: each run is one process's whole CPU (the
clock is virtual, so runs never wait on each other), spawned (never forked: a forked child would
inherit the parent's event loop and Ray state)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import Any


def process_count(processes: int | None, jobs: int) -> int:
    """The processes `run_jobs` uses for `jobs` jobs."""
    return max(1, min(processes or os.cpu_count() or 1, jobs))


def run_jobs(fn: Callable[[Any], Any], jobs: list, processes: int | None = None,
             ordered: bool = True) -> Iterator[Any]:
    """`fn(job)` for every job, on `processes` processes (default: one a core, at most one a job;
    1: in this process), yielded in the jobs' order or, `ordered=False`, as each ends."""
    procs = process_count(processes, len(jobs))
    if procs <= 1:
        yield from map(fn, jobs)
        return
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        yield from (pool.imap if ordered else pool.imap_unordered)(fn, jobs, chunksize=1)
