"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MEMORY_FRACTION = 0.1  # of the device's memory, for the KV pool, when no size is given


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = "auto"  # "auto" = bfloat16 where the device computes it natively, else float32
    device: str = "cpu"
    block_size: int = 16
    # KV pool size: an explicit block count wins; else `kv_cache_memory` bytes; else
    # `memory_fraction` of the device memory minus weights and `runtime_overhead` bytes.
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    runtime_overhead: int = 256 << 20
    max_num_batched_tokens: int = 512  # the per-step token budget: bounds a step's time (docs/engine_speed.md)
    chunk_size: int | None = 256  # longest prefill chunk; None = whole prompts (no chunking)
    # prompts left part-way through their prefill at once (engine/scheduler.py); None = no limit
    max_num_partial_prefills: int | None = None
    # a worker running only prefill-only requests (a disaggregated prefill worker) cuts prompts into
    # chunk_size chunks too; False = whole prompts there, within the step's budget (engine/scheduler.py)
    chunk_prefill_workers: bool = False
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True  # reuse the KV of full blocks seen before (protocol/block_hash.py)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0  # generator for sampled requests that carry no seed of their own
    torch_threads: int | None = None
    compile: str = "auto"  # torch.compile the dense forward: auto (= on CUDA only) | on | off (engine/forward/switchboard.py)
    cuda_graphs: bool = False  # with compile on CUDA: capture the dense pieces into CUDA graphs
    cpu_kernels: str = "auto"  # decode attention and small-batch linears by pdserve's CPU kernels (engine/kernels/cpu_kernel.py): auto | on | off
    prepack_linears: bool = True  # oneDNN-prepacked linear weights on CPU (engine/forward/dense.py); off = to compare
    # with prepacked linears: fused q|k|v + rotary, gate|up + SiLU (engine/forward/fused.py) and the norm kernel; off = to compare
    fuse_layers: bool = True
    # with fused layers and the CPU kernels: each decoder layer one kernel call (engine/forward/kernel_layer.py); off = to compare
    kernel_layers: bool = True
    # with the decoder as kernel calls: an all-greedy step's tokens from a half-float head (engine/forward/greedy_head.py); off = to compare
    greedy_head: bool = True

    def __post_init__(self) -> None:
        checks = {
            "block_size": self.block_size >= 1,
            "num_blocks": self.num_blocks is None or self.num_blocks >= 1,
            "memory_fraction": 0.0 < self.memory_fraction <= 1.0,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "chunk_size": self.chunk_size is None or self.chunk_size >= 1,
            "max_num_partial_prefills": self.max_num_partial_prefills is None or self.max_num_partial_prefills >= 1,
            "max_num_seqs": self.max_num_seqs >= 1,
            "dtype": self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "compile": self.compile in ("auto", "on", "off"),
            "cpu_kernels": self.cpu_kernels in ("auto", "on", "off"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid engine config value for {', '.join(bad)}")
