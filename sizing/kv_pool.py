"""The one rule for a worker's KV pool: its dtype under `dtype: auto` and its size in blocks.

The engine (model_runner), the router's config checks and bench's capacity check all call these,
so a pool sized before a run is the pool the worker allocates:
- dtype: an explicit dtype wins; `auto` is bfloat16 where the device computes it natively (a CUDA
  GPU with bf16, a CPU with AVX512-BF16 or AMX) and float32 elsewhere. The checkpoint's own
  `torch_dtype` plays no part: the engine loads the weights in the resolved dtype.
- blocks: `kv_cache.num_blocks` wins; else `kv_cache.memory` over the KV bytes of one block; else
  None: the device's memory decides (`memory_fraction`), known only on the worker.
"""

from __future__ import annotations

from sizing.memory import ModelShape, num_kv_blocks

AUTO = "auto"


def computes_bf16(device_type: str) -> bool:
    """The device multiplies bfloat16 natively: a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX."""
    import torch  # the rule is torch's own view of the device; imported here, sizing is arithmetic

    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device_type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(configured: str, device_type: str) -> str:
    """The dtype a worker on `device_type` runs for the configured `dtype` (see the module docstring)."""
    if configured != AUTO:
        return configured
    return "bfloat16" if computes_bf16(device_type) else "float32"


def kv_pool_blocks(shape: ModelShape, dtype: str, block_size: int, num_blocks: int | None,
                   memory_bytes: int | None) -> int | None:
    """Blocks in the pool by the config alone (see the module docstring); None: the device decides.
    `dtype` is a resolved one (`resolve_dtype`)."""
    if num_blocks is not None:
        return num_blocks
    if memory_bytes is None:
        return None
    return num_kv_blocks(shape, dtype, memory_bytes, block_size)
