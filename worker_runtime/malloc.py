"""A CPU worker's memory allocator (`prefill.malloc` / `decode.malloc` in cluster.yaml).

A step allocates and frees a few thousand tensors, some of megabytes (the gathered KV of a
decode group); glibc's malloc returns the large ones to the kernel and maps them again the next
step. tcmalloc keeps them, and vLLM's CPU guide preloads it for that reason. On this project's
2-core host a SmolLM2 decode step at batch 16 on two threads took 0.79-0.83x the time with
tcmalloc preloaded; on one thread, and through a cluster of one-thread workers, the gain was
within the noise (docs/engine_speed.md, "The allocator"). `auto` preloads it where the host has
the library (Debian/Ubuntu: libtcmalloc-minimal4) and runs glibc's elsewhere; GPU workers are
left alone.
The router starts each worker with the environment `worker_env` gives; the worker's first log
line names the allocator it actually runs with (`in_use`).
"""

from __future__ import annotations

import ctypes.util
import functools
import os

MALLOCS = ("auto", "tcmalloc", "system")
NO_TCMALLOC = "is tcmalloc, but this host has no libtcmalloc (Debian/Ubuntu: apt install libtcmalloc-minimal4)"


@functools.cache
def tcmalloc() -> str | None:
    """The name of this host's tcmalloc library, as the dynamic loader finds it; None without one."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def worker_env(choice: str, on_gpu: bool) -> dict[str, str]:
    """Environment variables a worker starts with for `choice`: LD_PRELOAD of tcmalloc, or none."""
    lib = tcmalloc()
    if on_gpu or choice == "system" or lib is None:
        return {}
    preloaded = os.environ.get("LD_PRELOAD", "")  # kept: what this process preloads, workers do too
    return {"LD_PRELOAD": preloaded if "tcmalloc" in preloaded else ":".join(filter(None, (lib, preloaded)))}


def in_use() -> str:
    """'tcmalloc' when this process has it mapped, else 'system'."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return "tcmalloc" if any("tcmalloc" in line for line in maps) else "system"
