"""Wait for the benchmark's cores to go idle before a timed sample.

The micro-benches keep both engines up for the whole run and time them in turn on the same cores.
An engine's threads can stay busy after its call returns: vLLM CPU 0.32's processes keep both
cores busy for 0.7-1 s after each `generate` (measured on an AMD EPYC, family 26: pdserve's
512-token bfloat16 prompt ran at ~1,500 tokens/s when timed within 0.7 s of a vLLM call, ~3,100 after
a 1 s pause, ~3,250 with vLLM's process idle). Timed straight after the other, a side measures the
other's tail as well as itself. So each sample starts once the cores are idle, which is also what the
served benchmark gives each server (one server alone on the host at a time).

Idle is read from /proc/stat: the cores' busy share over a short window (jiffies: 10 ms each on
these kernels). A host shared with other work may never settle; the wait gives up after
`timeout_s` and the report says how many samples started busy.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

WINDOW_S = 0.2
BUSY_SHARE = 0.1  # at most this share of the window busy on each core counts as idle
TIMEOUT_S = 5.0


def core_jiffies(cores: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """core -> (busy, total) jiffies since boot, from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        ticks = [int(v) for v in values]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        out[int(name[3:])] = (sum(ticks[:8]) - idle, sum(ticks[:8]))
    return out


def wait_idle(cores: tuple[int, ...], window_s: float = WINDOW_S, busy_share: float = BUSY_SHARE,
              timeout_s: float = TIMEOUT_S) -> tuple[float, bool]:
    """Block until each of `cores` was busy at most `busy_share` of a `window_s` window, or
    `timeout_s` passed (0: no wait). Returns (seconds waited, whether the cores were idle; True
    without a wait)."""
    if timeout_s <= 0:
        return 0.0, True
    t0 = time.perf_counter()
    before = core_jiffies(cores)
    while True:
        time.sleep(window_s)
        after = core_jiffies(cores)
        shares = [(after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1]) for c in after]
        if all(s <= busy_share for s in shares):
            return time.perf_counter() - t0, True
        if time.perf_counter() - t0 >= timeout_s:
            return time.perf_counter() - t0, False
        before = after


def add_idle_wait(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--idle-wait", type=float, default=TIMEOUT_S, metavar="S",
                        help="before each timed call, wait up to S seconds for the cores to go idle "
                        "(default %(default)s; 0: no wait)")
