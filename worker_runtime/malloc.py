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
import sys

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


def exec_as_worker(choice: str = "auto") -> None:
    """Restart this process (same interpreter and arguments) with the allocator a CPU worker
    would run with for `choice`, unless it already does: a benchmark of the engine then measures
    what a worker serves with. Returns only when no restart is needed."""
    env = worker_env(choice, on_gpu=False)
    want = "tcmalloc" if env else "system"
    if in_use() == want or os.environ.get("PDSERVE_MALLOC_REEXEC") == want:
        return  # the second guard: a library that would not map must not restart us forever
    env = {**os.environ, **env, "PDSERVE_MALLOC_REEXEC": want}
    if want == "system":
        env["LD_PRELOAD"] = ":".join(p for p in env.get("LD_PRELOAD", "").split(":") if p and "tcmalloc" not in p)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
