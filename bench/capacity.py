"""Before a run, every generated request against the cluster it goes to: prompt + max_tokens must
fit one worker's KV pool, or the router refuses it (INVALID_ARGUMENT) and the run measures
refusals instead of serving. `fit` refuses with one line naming the option that clamps, or with
`clamp` cuts each misfit's max_tokens (then, if the prompt alone is too long, its prompt's tail)
so that it fits. The pool size comes from the config (kv_cache.num_blocks, else kv_cache.memory
over the model's KV bytes per block); one sized by memory_fraction depends on the device the
workers start on, and is checked by the router alone.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bench.errors import WorkloadError
from bench.workload import RequestSpec, Workload
from sizing.kv_pool import kv_pool_blocks, resolve_dtype
from sizing.memory import ModelShape

CLAMP_OPTION = "--clamp-to-capacity"


@dataclasses.dataclass(frozen=True)
class Capacity:
    """One worker's KV pool, and where its size came from (for the message)."""

    blocks: int
    block_size: int
    source: str

    def blocks_for(self, spec: RequestSpec) -> int:
        return -(-(spec.num_prompt_tokens + spec.max_tokens) // self.block_size)

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


def worker_capacity(cfg) -> Capacity | None:
    """The KV pool of one decode worker of `cfg` (a ClusterConfig), or None where the device decides
    it: the engine's own rule (sizing/kv_pool.py) over the engine config the worker gets."""
    engine = cfg.engine_config(cfg.decode, device=cfg.device_of(cfg.decode))
    if engine.num_blocks is None and engine.kv_cache_memory is None:
        return None
    hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
    dtype = resolve_dtype(engine.dtype, engine.device)
    blocks = kv_pool_blocks(ModelShape.from_hf_config(hf), dtype, engine.block_size, engine.num_blocks,
                            engine.kv_cache_memory)
    source = (f"kv_cache.num_blocks {engine.num_blocks}" if engine.num_blocks is not None
              else f"kv_cache.memory {cfg.kv_cache.memory} in {dtype}")
    return Capacity(blocks, engine.block_size, source)


def fit(workload: Workload, capacity: Capacity, clamp: bool) -> Workload:
    """`workload` if every request fits a worker; else the misfits clamped (`clamp`) or WorkloadError."""
    misfits = [spec for spec in workload.requests if capacity.blocks_for(spec) > capacity.blocks]
    if not misfits:
        return workload
    if not clamp:
        worst = max(capacity.blocks_for(spec) for spec in misfits)
        raise WorkloadError(
            f"{len(misfits)} of {len(workload.requests)} requests need more KV blocks than a worker holds (up to "
            f"{worst}; a worker has {capacity.blocks}, {capacity.source}): give a smaller --input-len or "
            f"--output-len, or pass {CLAMP_OPTION} to cut them to fit")
    clamped = tuple(_clamped(spec, capacity.tokens) if spec in misfits else spec for spec in workload.requests)
    meta = dict(workload.metadata) | {"clamped_to_capacity": len(misfits)}
    return dataclasses.replace(workload, requests=clamped, metadata=meta)


def _clamped(spec: RequestSpec, tokens: int) -> RequestSpec:
    """`spec` cut to `tokens` of prompt + output: its max_tokens first, keeping at least one."""
    max_tokens = max(1, tokens - spec.num_prompt_tokens)
    prompt = spec.prompt_token_ids[:tokens - max_tokens]
    return dataclasses.replace(spec, prompt_token_ids=prompt, max_tokens=max_tokens)
