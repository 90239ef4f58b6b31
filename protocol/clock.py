"""The clock of the router and the engine: seconds on the running event loop's clock.

Live, that is `time.monotonic()`: asyncio's own clock on the router's and the actors' loops, and
monotonic on an engine thread, which runs no loop (on Linux `time.perf_counter()` reads the same
clock). Under `pdserve simulate` the loop's clock is virtual (looptime), so every deadline, wait
and latency the router's and the engine's own code take runs on simulated time, and host
compute never enters it. A simulated step's code reads its end once its modelled duration is
known (`ahead`): the engine's step records and prompt compute times are then the modelled ones.
`unix()` is wall-clock time for records that line up across processes (virtual in a simulation).
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar

_ahead: ContextVar[float] = ContextVar("pdserve_clock_ahead", default=0.0)


def now() -> float:
    loop = asyncio._get_running_loop()  # the public getter raises outside a loop; this returns None
    return (loop.time() if loop is not None else time.monotonic()) + _ahead.get()


def unix() -> float:
    """time.time(); on a simulation's loop (one with a `unix_epoch`), that epoch + its clock."""
    loop = asyncio._get_running_loop()
    epoch = getattr(loop, "unix_epoch", None)
    return time.time() if epoch is None else epoch + now()


def ahead(seconds: float):
    """From now on in this context, `now()` reads `seconds` later (a simulated step's modelled
    end); returns the token `behind` takes to undo it."""
    return _ahead.set(seconds)


def behind(token) -> None:
    _ahead.reset(token)
