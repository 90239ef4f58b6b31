"""Sending a workload on time, whatever the protocol: `dispatch` and its `Progress` line.

`dispatch(workload, send, now, progress)` starts each request at its arrival offset (or as soon
as one of `workload.concurrency` slots frees) as its own task, and returns one record per
request in workload order; `send` (gRPC or OpenAI HTTP) never raises for a failed request.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TextIO

from bench.metrics import RequestRecord
from bench.workload import RequestSpec, Workload

PROGRESS_EVERY_S = 5.0


@dataclass
class Progress:
    """On a terminal, `label [#####.....] 12/100 (1 failed)` rewritten as requests finish;
    elsewhere (a log file, a pipe) one line every `every_s` seconds and one at the end."""

    total: int
    label: str = ""
    stream: TextIO | None = field(default_factory=lambda: sys.stderr)
    every_s: float = PROGRESS_EVERY_S
    width: int = 30
    started: int = 0
    done: int = 0
    failed: int = 0
    t0: float = field(default_factory=time.monotonic)

    @property
    def interactive(self) -> bool:
        return self.stream is not None and self.stream.isatty()

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self.interactive:
            filled = self.width * self.done // max(1, self.total)
            failed = f" ({self.failed} failed)" if self.failed else ""
            bar = "#" * filled + "." * (self.width - filled)
            self._write(f"\r{self.label} [{bar}] {self.done}/{self.total}{failed}")

    def line(self) -> str:
        return (f"{self.label}: {self.done}/{self.total} requests done ({self.failed} failed), "
                f"{self.started - self.done} in flight, {time.monotonic() - self.t0:.0f} s")

    async def tick(self) -> None:
        """Runs beside a replay when the stream is not a terminal."""
        while True:
            await asyncio.sleep(self.every_s)
            self._write(self.line() + "\n")

    def close(self) -> None:
        if self.stream is not None:
            self._write("\n" if self.interactive else self.line() + "\n")

    def _write(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(text)
            self.stream.flush()


async def dispatch(workload: Workload, send: Callable[[RequestSpec], Awaitable[RequestRecord]],
                   now: Callable[[], float], progress: Progress) -> list[RequestRecord]:
    """Every request of `workload` through `send`, on time; `now()`: seconds since the run began."""
    slots = asyncio.Semaphore(workload.concurrency) if workload.concurrency else None
    periodic = progress.stream is not None and not progress.interactive
    ticker = asyncio.create_task(progress.tick()) if periodic else None

    async def one(spec: RequestSpec) -> RequestRecord:
        try:
            record = await send(spec)
        finally:
            if slots is not None:
                slots.release()
        progress.advance(record.ok)
        return record

    tasks = []
    try:
        for spec in workload.requests:
            delay = spec.arrival_s - now()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            progress.started += 1
            tasks.append(asyncio.create_task(one(spec)))
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op for finished ones; stops the rest when the run itself is cancelled
        if ticker is not None:
            ticker.cancel()
        progress.close()
