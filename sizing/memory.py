"""GPU memory budget of one model instance: weights + KV cache + runtime overhead.

`plan_memory` answers `pdserve plan` ("how many 8k-token requests fit?") and
`num_kv_blocks` sizes a decode worker's paged KV pool from the same arithmetic:
KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per value.

Sliding-window layers (Mistral, Gemma 2/3, Qwen2/3 and SmolLM3 with `use_sliding_window`, Phi-3)
need the KV of their last `window` tokens only: `kv_bytes_for_context` bounds them so. pdserve's
pool still holds every layer's KV for every token (it frees no block early), so the pool's
arithmetic (`num_kv_blocks`, `requests_that_fit`) uses the full figure and the plan reports the
windowed one beside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from protocol.sizes import PlanError, format_bytes

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}


@dataclass(frozen=True)
class ModelShape:
    """What the memory budget needs to know about a decoder-only model."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    vocab_size: int | None = None
    max_positions: int | None = None
    num_attention_heads: int | None = None  # query heads; None: attention FLOPs left out (sizing/cost_model.py)
    sliding_windows: tuple[int | None, ...] = ()  # per layer: its window, None = full; () = all full

    @classmethod
    def from_hf_config(
        cls, cfg: Any, num_params: int | None = None, name: str = ""
    ) -> ModelShape:
        """Builds a shape from a transformers `PretrainedConfig` or a config.json dict.

        Without `num_params` the count is estimated from the layer shapes (Llama layout).
        """
        heads = _require(cfg, "num_attention_heads")
        hidden = _require(cfg, "hidden_size")
        head_dim = _field(cfg, "head_dim") or hidden // heads
        layers = _require(cfg, "num_hidden_layers")
        windows = layer_windows(cfg, layers)
        return cls(
            name=name or str(_field(cfg, "_name_or_path") or _field(cfg, "model_type") or "model"),
            num_layers=_require(cfg, "num_hidden_layers"),
            num_kv_heads=_field(cfg, "num_key_value_heads") or heads,
            head_dim=head_dim,
            num_params=num_params if num_params is not None else estimate_num_params(cfg),
            vocab_size=_field(cfg, "vocab_size"),
            max_positions=_field(cfg, "max_position_embeddings"),
            num_attention_heads=heads,
            sliding_windows=windows if any(windows) else (),
        )


def layer_windows(cfg: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) as transformers' modules read the config:
    `layer_types` where the config lists them, else the rule of the family's older config.json
    (Qwen2: layers from `max_window_layers` on; Gemma 2: every other layer; Gemma 3: all but every
    `sliding_window_pattern`-th), else every layer (Mistral, Phi-3). `use_sliding_window: false`
    (Qwen2, Qwen3, SmolLM3) turns the window off."""
    window = _field(cfg, "sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 \
            or _field(cfg, "use_sliding_window") is False:
        return (None,) * num_layers
    types = _field(cfg, "layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    model_type = _field(cfg, "model_type")
    if _field(cfg, "use_sliding_window"):
        first = _field(cfg, "max_window_layers") or 0
        sliding = [i >= first for i in range(num_layers)]
    elif model_type == "gemma2":
        sliding = [(i + 1) % 2 == 1 for i in range(num_layers)]
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = _field(cfg, "sliding_window_pattern") or 6
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    return tuple(window if s else None for s in sliding)


def _field(cfg: Any, key: str) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key)
    return getattr(cfg, key, None)


def _require(cfg: Any, key: str) -> int:
    value = _field(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlanError(f"model config: '{key}' must be a positive integer, got {value!r}")
    return value


def estimate_num_params(cfg: Any) -> int:
    """Parameter count of a Llama-layout decoder (embeddings, attention, gated MLP, norms)."""
    hidden = _require(cfg, "hidden_size")
    heads = _require(cfg, "num_attention_heads")
    layers = _require(cfg, "num_hidden_layers")
    vocab = _require(cfg, "vocab_size")
    intermediate = _require(cfg, "intermediate_size")
    kv_heads = _field(cfg, "num_key_value_heads") or heads
    head_dim = _field(cfg, "head_dim") or hidden // heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if _field(cfg, "attention_bias") or _field(cfg, "model_type") == "qwen2":
        attention += q_out + 2 * kv_out
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab * hidden
    lm_head = 0 if _field(cfg, "tie_word_embeddings") else vocab * hidden
    return embeddings + layers * per_layer + hidden + lm_head


BUILTIN_SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama-3.1-8b", 32, 8, 128, 8_030_261_248, 128_256, 131_072, 32),
        ModelShape("llama-3.1-70b", 80, 8, 128, 70_553_706_496, 128_256, 131_072, 64),
        ModelShape("llama-3.2-1b", 16, 8, 64, 1_235_814_400, 128_256, 131_072, 32),
        ModelShape("qwen2.5-7b", 28, 4, 128, 7_615_616_512, 152_064, 32_768, 28),
        ModelShape("mistral-7b", 32, 8, 128, 7_241_732_096, 32_000, 32_768, 32),
        ModelShape("qwen2.5-14b", 48, 8, 128, 14_770_033_664, 152_064, 32_768, 40),
        ModelShape("qwen2.5-32b", 64, 8, 128, 32_763_876_352, 152_064, 32_768, 40),
        # every other layer attends to its last 4,096 tokens only (config.json: model_type gemma2)
        ModelShape("gemma-2-9b", 42, 8, 256, 9_241_705_984, 256_000, 8_192, 16,
                   layer_windows({"model_type": "gemma2", "sliding_window": 4096}, 42)),
    )
}


def dtype_bytes(dtype: str | int | Any) -> int:
    """Bytes per value of a dtype name ("bfloat16"), a byte count, or a torch dtype."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype <= 0:
            raise PlanError(f"dtype size must be positive, got {dtype}")
        return dtype
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per value."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def kv_bytes_for_context(shape: ModelShape, dtype_bytes: int, num_tokens: int) -> int:
    """The KV one sequence of `num_tokens` needs when each sliding-window layer keeps only its
    last `window` tokens (full layers keep them all)."""
    per_layer_token = 2 * shape.num_kv_heads * shape.head_dim * dtype_bytes
    windows = shape.sliding_windows or (None,) * shape.num_layers
    return per_layer_token * sum(num_tokens if w is None else min(num_tokens, w) for w in windows)


def num_kv_blocks(shape: ModelShape, dtype: str | int | Any, budget_bytes: int, block_size: int) -> int:
    """Whole KV blocks of `block_size` tokens that fit in `budget_bytes` (0 if none)."""
    if block_size <= 0:
        raise PlanError(f"block size must be positive, got {block_size}")
    block_bytes = block_size * kv_bytes_per_token(shape, dtype_bytes(dtype))
    return max(0, budget_bytes) // block_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """One device's budget; every derived figure is a property of the stored inputs."""

    model: str
    dtype: str
    dtype_bytes: int
    device_memory_bytes: int
    overhead_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    context_tokens: int
    windowed_bytes_per_request: int  # the context's KV when sliding-window layers keep only their window

    @property
    def kv_budget_bytes(self) -> int:
        return self.device_memory_bytes - self.weights_bytes - self.overhead_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_request(self) -> int:
        return math.ceil(self.context_tokens / self.block_size)

    @property
    def bytes_per_request(self) -> int:
        return self.blocks_per_request * self.block_bytes

    @property
    def windowed_kv_bytes_per_token(self) -> float:
        """KV bytes per token averaged over the context, sliding-window layers bounded by their window
        (equal to `kv_bytes_per_token` for a model without windows)."""
        return self.windowed_bytes_per_request / self.context_tokens

    @property
    def requests_that_fit(self) -> int:
        return self.num_blocks // self.blocks_per_request

    def to_dict(self) -> dict[str, Any]:
        derived = ("kv_budget_bytes", "windowed_kv_bytes_per_token", "block_bytes", "capacity_tokens", "blocks_per_request",
                   "bytes_per_request", "requests_that_fit")
        return asdict(self) | {name: getattr(self, name) for name in derived}


def plan_memory(
    shape: ModelShape,
    dtype: str | int,
    device_memory_bytes: int,
    overhead_bytes: int,
    context_tokens: int,
    block_size: int = 16,
    weights_bytes: int | None = None,
) -> MemoryPlan:
    """Splits device memory into weights, overhead and whole KV blocks.

    `weights_bytes` defaults to num_params x bytes per value of `dtype`.
    Raises `PlanError` when weights + overhead leave no room for a single KV block.
    """
    if context_tokens <= 0:
        raise PlanError(f"context must be at least one token, got {context_tokens}")
    if overhead_bytes < 0 or device_memory_bytes <= 0:
        raise PlanError("device memory must be positive and overhead not negative")
    size = dtype_bytes(dtype)
    weights = shape.num_params * size if weights_bytes is None else weights_bytes
    budget = device_memory_bytes - weights - overhead_bytes
    blocks = num_kv_blocks(shape, size, budget, block_size)
    if blocks == 0:
        raise PlanError(
            f"weights ({format_bytes(weights)}) + overhead ({format_bytes(overhead_bytes)}) "
            f"leave no room for one KV block in {format_bytes(device_memory_bytes)}"
        )
    return MemoryPlan(shape.name, str(dtype), size, device_memory_bytes, overhead_bytes,
                      weights, kv_bytes_per_token(shape, size), block_size, blocks, context_tokens,
                      kv_bytes_for_context(shape, size, context_tokens))


