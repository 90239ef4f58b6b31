"""microbench/idle.py: a timed sample starts only once the benchmark's cores are idle."""

from __future__ import annotations

import multiprocessing
import os
import time

from microbench import idle


def _spin(seconds: float) -> None:
    os.sched_setaffinity(0, {0})
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_cores_jiffies_are_read_per_core():
    now = idle.core_jiffies((0,))
    assert set(now) == {0} and 0 <= now[0][0] <= now[0][1]


def test_it_waits_out_a_busy_core_and_gives_up_at_its_timeout():
    """A process spinning on core 0 for 1.2 s: a wait of up to 0.6 s gives up busy; a wait of up to
    30 s returns idle only after the spinner ended. The second wait counts a core idle below 90% busy:
    the spinner keeps core 0 at ~100%, and the rest of a loaded host (the suite's own clusters)
    seldom fills it, where a quiet core (10%) may not come within the wait. Seldom is not never: on a
    2-core AMD EPYC (2026-12-07) the rest of the host kept core 0 over 90% for a whole 10 s wait in two
    of three suite runs (one beside a package install, load 15; one quiet), so the wait allows 30 s; it
    returns as soon as the core is idle."""
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, args=(1.2,))
    t0 = time.perf_counter()
    spinner.start()
    time.sleep(0.3)  # the child has started spinning
    waited, was_idle = idle.wait_idle((0,), timeout_s=0.6)
    assert not was_idle and 0.6 <= waited < 1.0
    waited, was_idle = idle.wait_idle((0,), busy_share=0.9, timeout_s=30.0)
    spinner.join()
    assert was_idle and time.perf_counter() - t0 >= 1.2


def test_no_wait_at_a_timeout_of_zero():
    assert idle.wait_idle((0,), timeout_s=0) == (0.0, True)
