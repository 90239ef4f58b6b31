"""The CPU kernels the tests run, loaded once (the `$PDSERVE_KERNEL_ARCH` variant, else native).

Where a C compiler is, kernels that fail to build or load are an error at collection, so the suite
fails; where none is, `KERNELS` is None and the kernel tests skip, saying why (`WHY`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.kernels import cpu_kernel, kernel_build
from engine.kernels.cpu_ops import KernelUnavailable


def _compiler_here() -> bool:
    try:
        kernel_build.compiler()
    except KernelUnavailable:
        return False
    return True


KERNELS, WHY = cpu_kernel.load()
if KERNELS is None and _compiler_here():
    raise RuntimeError(f"the CPU kernels failed here, where a C compiler is, so ~300 kernel tests would skip: {WHY}")


def attention_reference(q, k_cache, v_cache, tables, lens, scale, window, softcap) -> torch.Tensor:
    """Attention of each row over its own keys, in float64, the plain way."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for i in range(n):
        length = int(lens[i])
        first = max(0, length - window) if window else 0
        k = k_cache[tables[i]].reshape(-1, kv_heads, dim)[first:length].double().transpose(0, 1)  # [KVH, ctx, D]
        v = v_cache[tables[i]].reshape(-1, kv_heads, dim)[first:length].double().transpose(0, 1)
        qi = q[i].double().view(kv_heads, heads // kv_heads, dim)
        scores = qi @ k.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[i] = (torch.softmax(scores, -1) @ v).reshape(heads, dim)
    return out


def attention_on(amx: bool) -> Iterator[None]:
    """A fixture's body: bfloat16 attention on AMX tiles (skipped where this host has none) or on
    vectors for the test, AMX again after it."""
    if amx and not KERNELS.use_amx(True):
        pytest.skip("no AMX here (CPU or OS): the vector path is tested alone")
    KERNELS.use_amx(amx)
    yield
    KERNELS.use_amx(True)

