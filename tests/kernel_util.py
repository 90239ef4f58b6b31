"""The CPU kernels the tests run, loaded once (the `$PDSERVE_KERNEL_ARCH` variant, else native).

Where a C compiler is, kernels that fail to build or load are an error at collection, so the suite
fails; where none is, `KERNELS` is None and the kernel tests skip, saying why (`WHY`).
"""

from __future__ import annotations

from engine import cpu_kernel, kernel_build
from engine.cpu_ops import KernelUnavailable


def _compiler_here() -> bool:
    try:
        kernel_build.compiler()
    except KernelUnavailable:
        return False
    return True


KERNELS, WHY = cpu_kernel.load()
if KERNELS is None and _compiler_here():
    raise RuntimeError(f"the CPU kernels failed here, where a C compiler is, so ~300 kernel tests would skip: {WHY}")
