"""The processes `pdserve serve` started, ended after Ray's shutdown.

`ray.shutdown()` ends the head's raylet and GCS, and the workers die with their raylet; but the
raylet's agents (dashboard, runtime env) notice a raylet gone only after up to a minute, and a
head stopped right after it started leaves them running meanwhile (or starts them as it dies).
`adopt_orphans()` before the shutdown makes this process their subreaper, so that whatever the
dying raylet leaves becomes our child; `end(below(os.getpid()))` after it signals what is still
alive (SIGTERM, then SIGKILL after `grace_s`) and reaps it. Linux only; elsewhere both do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

Process = tuple[int, int]  # pid, start time in clock ticks
PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Make this process the subreaper of its descendants: an orphan becomes our child."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None once it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else (int(fields[1]), int(fields[19]))


def below(root: int) -> set[Process]:
    """Every live process below `root`."""
    children: dict[int, list[Process]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append((int(entry.name), st[1]))
    found: set[Process] = set()
    todo = [root]
    while todo:
        for proc in children.get(todo.pop(), []):
            found.add(proc)
            todo.append(proc[0])
    return found


def alive(processes: set[Process]) -> set[Process]:
    return {(pid, start) for pid, start in processes if (st := _stat(pid)) is not None and st[1] == start}


def end(processes: set[Process], grace_s: float = 3.0) -> int:
    """SIGTERM what is still alive of `processes`, SIGKILL what outlives `grace_s`; how many were left."""
    left = alive(processes)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in alive(left):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while alive(left) and time.monotonic() < deadline:
            _reap(left)
            time.sleep(0.05)
    _reap(left)
    return len(left)


def _reap(processes: set[Process]) -> None:
    """Collect the exit status of those that are our children (adopted orphans)."""
    for pid, _ in processes:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
