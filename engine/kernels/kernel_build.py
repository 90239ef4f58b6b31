"""Builds pdserve's CPU kernels (engine/kernels/csrc) into one shared library per variant, cached by content.

A variant is the instruction set the build targets (`VARIANTS`): `native` (`-march=native`, the
default: whatever this CPU has, AMX included), `noamx` (native without the AMX instruction sets:
on an AMX host, the build an AVX512-BF16 CPU without AMX runs, for comparing the two), `avx512`
(AVX-512 without AVX512-BF16 or AMX, as on Skylake-X / Cascade Lake) or `avx2` (x86-64-v3: AVX2 +
FMA, no AVX-512). `$PDSERVE_KERNEL_ARCH` picks one; tests build every one on one host, so each
branch of the C code is compiled and run.

The library lands in `$PDSERVE_KERNEL_CACHE` (default `~/.cache/pdserve/kernels`), named by a hash
of the sources and headers, the compiler, its flags and (native and noamx only) the CPU's flags, so
a changed source, compiler or variant builds anew and processes on a host share one build. A cached library
is loaded only if this user owns it and nobody else can write it or its directory; one that fails
that is rebuilt in its place, or refused where it cannot be.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.kernels.cpu_ops import KernelUnavailable

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
# hidden: only what pdserve_kernels.h marks PD_API is exported; psabi: 16-lane vectors in static helpers on AVX2 builds; an undeclared function is an error here,
# not a library that builds and then fails to load
COMMON_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fvisibility=hidden", "-Wno-psabi",
                "-Werror=implicit-function-declaration")
VARIANT_ENV = "PDSERVE_KERNEL_ARCH"
VARIANTS = {"native": ("-march=native",), "noamx": ("-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
            "avx512": ("-march=skylake-avx512",), "avx2": ("-march=x86-64-v3",)}
# /proc/cpuinfo flags a variant's code needs (the ones its -march turns on that the kernels use)
NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"),
         "avx2": ("avx2", "fma", "f16c", "bmi2")}
BUILD_TIMEOUT_S = 120


def variant() -> str:
    """The variant `$PDSERVE_KERNEL_ARCH` names (default `native`); KernelUnavailable for another name."""
    name = os.environ.get(VARIANT_ENV) or "native"
    if name not in VARIANTS:
        raise KernelUnavailable(f"{VARIANT_ENV}={name!r} is no kernel variant; choose one of {', '.join(VARIANTS)}")
    return name


def flags(name: str) -> tuple[str, ...]:
    return (*COMMON_FLAGS, *VARIANTS[name])


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler on PATH (cc, gcc or $CC)")
    return cc


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def check_runs_here(name: str) -> None:
    """KernelUnavailable where this CPU lacks an instruction set the variant's code uses."""
    if name not in NEEDS:  # native and noamx: this CPU's own flags
        return
    have = set(cpu_flags().partition(":")[2].split())
    lacking = [flag for flag in NEEDS[name] if flag not in have]
    if lacking:
        raise KernelUnavailable(f"this CPU lacks {', '.join(lacking)}, which the {name} kernel variant needs")


def untrusted(path: Path, uid: int | None = None) -> str:
    """Why a cached library (or its directory) must not be loaded, or "" if it may: it must be this
    user's (`uid`) and writable by nobody else, and no symbolic link."""
    uid = os.geteuid() if uid is None else uid
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not this user ({uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def build(cc: str, name: str = "native") -> Path:
    """The library of variant `name`, built by `cc` unless a trusted build is cached."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from e
    sources = [f"{path.name}\0{path.read_text()}" for path in (*SOURCES, *HEADERS)]
    # -march=native: the CPU's flags are part of the name, so hosts sharing a cache never share a build
    host = cpu_flags() if VARIANTS[name][0] == "-march=native" else ""
    key = hashlib.sha256("\0".join([*sources, cc, version, *flags(name), sys.platform, host]).encode())
    target = cache_dir() / f"pdserve_kernels-{name}-{key.hexdigest()[:16]}.so"
    _make_dir(target.parent)
    if target.exists():
        why = untrusted(target)
        if not why:
            return target
        log.warning("rebuilding the cached CPU kernels: %s", why)
    _compile(cc, name, target)
    return target


def _make_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {directory} ({e.strerror}); set "
                                "PDSERVE_KERNEL_CACHE to a writable directory") from e
    why = untrusted(directory)
    if why:
        raise KernelUnavailable(f"refusing the kernel cache: {why}; set PDSERVE_KERNEL_CACHE to a directory "
                                "only this user can write")


def _compile(cc: str, name: str, target: Path) -> None:
    try:  # build aside, then rename: no reader sees half a file, and a distrusted one is replaced whole
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {target.parent} ({e.strerror}); set "
                                "PDSERVE_KERNEL_CACHE to a writable directory") from e
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objects:
            _link(cc, name, _objects(cc, name, Path(objects)), tmp)
        os.chmod(tmp, 0o755)  # whatever the umask: a group-writable build would be distrusted next time
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as e:
        raise KernelUnavailable(f"{cc} took over {BUILD_TIMEOUT_S} s to build {_names()}") from e
    except OSError as e:
        raise KernelUnavailable(f"refusing the cached kernels {target}, which cannot be replaced ({e.strerror})") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _objects(cc: str, name: str, out: Path) -> list[str]:
    """Each source compiled to its own object, as many at once as the process has cores (the
    sources are independent: on 2 cores the build takes about half the time of one `cc` call)."""
    jobs = [[cc, *flags(name), "-c", str(src), "-o", str(out / f"{src.stem}.o")] for src in SOURCES]
    with ThreadPoolExecutor(max(1, min(len(jobs), len(os.sched_getaffinity(0))))) as pool:
        for done in pool.map(_run, jobs):
            if done.returncode != 0:
                raise KernelUnavailable(f"{cc} failed to build {_names()}: {done.stderr.strip()[-400:]}")
    return [job[-1] for job in jobs]


def _link(cc: str, name: str, objects: list[str], tmp: str) -> None:
    done = _run([cc, *flags(name), "-o", tmp, *objects, "-lm"])
    if done.returncode != 0:
        raise KernelUnavailable(f"{cc} failed to link {_names()}: {done.stderr.strip()[-400:]}")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


def _names() -> str:
    names = [path.name for path in SOURCES]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
