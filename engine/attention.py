"""Paged attention plugged into transformers through its attention-function registry.

The runner flattens every scheduled token of every sequence into one row (`[1, T]`), decode
tokens first. `StepMetadata` (built once per step, shared by all layers) reaches
`paged_attention` as the `paged` keyword of the model's forward call. Per layer the function
writes the new K/V into their slots of the pool, then attends:
- decode tokens in a few padded SDPA calls, grouped by context length (little padding);
- each prefill chunk over its own context (fresh prompts straight from K/V, causal).

Per-layer attention features arrive as the keyword arguments transformers' modules pass:
`scaling` (Gemma's `query_pre_attn_scalar`, Granite's multiplier), `sliding_window` (the key
positions a query at position t sees are (t - window, t], as transformers' masks say) and
`softcap` (Gemma 2: tanh(scores / cap) * cap before the softmax). A window picks the step's
mask built for that window size (`window_masks`, one per distinct size, shared by all layers);
a softcap, which SDPA lacks, takes an explicit matmul / softmax path. A model without either
builds no extra mask and runs exactly the plain SDPA path. `probe_features` runs one token
through the model at load to learn each layer's features and to refuse what this function
cannot honour (`UnsupportedModel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class PrefillChunk:
    start: int  # query range [start, end) in the flattened row
    end: int
    ctx_blocks: torch.Tensor | None  # [ceil(ctx / bs)] blocks holding all keys; None = fresh prompt (keys == chunk)
    mask: torch.Tensor | None  # [q, ctx_blocks * bs] bool, True = attend; None = plain causal
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> [q, keys] bool


@dataclass
class DecodeGroup:
    """Decode rows [start, end) of similar context length, attended in one padded call."""

    start: int
    end: int
    blocks: torch.Tensor  # [B, max_blocks] each row's block table, padded
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool, True = real key
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> keys inside it, same shape


@dataclass
class StepMetadata:
    kv: torch.Tensor  # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    slot_blocks: torch.Tensor  # [T] block of each new token
    slot_offsets: torch.Tensor  # [T] its position in that block
    decode_groups: list[DecodeGroup]  # decode tokens come first in the row, by context length
    prefills: list[PrefillChunk]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    paged: StepMetadata | None = None, **kwargs):
    if type(paged) is AttentionProbe:
        return paged.record(module, query, key, attention_mask, scaling, sliding_window, softcap, kwargs)
    assert paged is not None, "paged attention needs the step's metadata (`paged=` in forward)"
    # query [1, H, T, D]; key/value [1, KVH, T, D]
    _, num_heads, num_tokens, head_dim = query.shape
    k_cache = paged.kv[:, module.layer_idx, 0]  # [blocks, block_size, KVH, D], a strided view
    v_cache = paged.kv[:, module.layer_idx, 1]
    where = (paged.slot_blocks, paged.slot_offsets)
    k_cache.index_put_(where, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_put_(where, value[0].transpose(0, 1).to(v_cache.dtype))

    scale = scaling if scaling is not None else head_dim**-0.5
    out = query.new_empty(num_tokens, num_heads, head_dim)  # [T, H, D]
    for group in paged.decode_groups:
        mask = group.window_masks[sliding_window] if sliding_window else group.mask
        _decode(query, k_cache, v_cache, group, mask, scale, softcap, out)
    for chunk in paged.prefills:
        mask = chunk.window_masks[sliding_window] if sliding_window else chunk.mask
        _prefill(query, key, value, k_cache, v_cache, chunk, mask, scale, softcap, out)
    return out.unsqueeze(0), None  # [1, T, H, D]


def _decode(query, k_cache, v_cache, group: DecodeGroup, mask, scale, softcap, out) -> None:
    n = group.end - group.start
    num_heads, head_dim = query.shape[1], query.shape[3]
    num_kv_heads = k_cache.shape[2]
    # one query per head; heads sharing a KV head ride together as a [G, D] "query block" so
    # the gathered K/V is never expanded to all heads (GQA without repeat_kv)
    q = query[0, :, group.start:group.end].transpose(0, 1)
    q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, KVH, G, D]
    flat = group.blocks.view(-1)  # whole blocks: one contiguous copy each
    k = k_cache.index_select(0, flat).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, KVH, ctx, D]
    v = v_cache.index_select(0, flat).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    if softcap:
        o = _softcapped(q, k, v, mask, scale, softcap)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, KVH, G, D]
    out[group.start:group.end] = o.reshape(n, num_heads, head_dim)


def _prefill(query, key, value, k_cache, v_cache, chunk: PrefillChunk, mask, scale, softcap, out) -> None:
    q = query[:, :, chunk.start:chunk.end]  # [1, H, q, D]
    if chunk.ctx_blocks is None:
        k = key[:, :, chunk.start:chunk.end]  # [1, KVH, q, D]
        v = value[:, :, chunk.start:chunk.end]
    else:
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        k = k_cache.index_select(0, chunk.ctx_blocks).view(-1, kvh, d).transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
        v = v_cache.index_select(0, chunk.ctx_blocks).view(-1, kvh, d).transpose(0, 1).unsqueeze(0)
    if softcap:
        n_q, n_kv = q.shape[2], k.shape[2]
        if mask is None:  # a fresh prompt: plain causal
            mask = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril()
        # heads sharing a KV head as one group: [1, KVH, G, q, D] against [1, KVH, 1, ctx, D]
        grouped = q.view(1, k.shape[1], -1, n_q, q.shape[3])
        o = _softcapped(grouped, k.unsqueeze(2), v.unsqueeze(2), mask, scale, softcap).flatten(1, 2)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=True)
    out[chunk.start:chunk.end] = o[0].transpose(0, 1)


def _softcapped(q, k, v, mask, scale: float, softcap: float):
    """Attention with scores soft-capped to (-cap, cap) before the mask and softmax, in the order
    and precision of transformers' eager path (softmax in float32). `mask` True = attend."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


# ---- load-time probe ---------------------------------------------------------------------
class UnsupportedModel(ValueError):
    """A checkpoint whose attention needs a feature paged attention lacks; one line for a person."""


# keyword arguments transformers' attention modules pass that carry no attention feature
_BENIGN_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions", "past_key_values",
                            "position_embeddings", "is_causal"})
# a feature some families pass, named for the refusal
_NAMED_FEATURES = {"s_aux": "attention sinks", "sinks": "attention sinks",
                   "attention_chunk_size": "chunked local attention"}


@dataclass
class LayerFeatures:
    """What one layer's attention asks of paged attention."""

    scaling: float
    sliding_window: int | None
    softcap: float | None


@dataclass
class AttentionProbe:
    """Stands in for the step metadata in a one-token forward at load: each layer's attention
    call records its features (or what it needs that paged attention lacks) instead of attending."""

    layers: dict[int, LayerFeatures] = field(default_factory=dict)
    kv_shapes: set[tuple[int, int]] = field(default_factory=set)
    lacking: list[str] = field(default_factory=list)

    def record(self, module, query, key, attention_mask, scaling, sliding_window, softcap, kwargs):
        self.layers[module.layer_idx] = LayerFeatures(scaling if scaling is not None else query.shape[-1] ** -0.5,
                                                      sliding_window, softcap)
        self.kv_shapes.add((key.shape[1], key.shape[3]))
        if not getattr(module, "is_causal", True):
            self.lacking.append("bidirectional attention")
        if attention_mask is not None:  # our mask interface builds none: the model made its own bias
            self.lacking.append("a position bias of its own in the attention mask (e.g. ALiBi)")
        for name, value in kwargs.items():
            if value is not None and value is not False and name not in _BENIGN_KWARGS:
                self.lacking.append(_NAMED_FEATURES.get(name, f"the attention argument {name!r}"))
        b, h, t, d = query.shape
        return query.new_zeros(b, t, h, d), None


@torch.inference_mode()
def probe_features(model, num_layers: int, kv_heads: int, head_dim: int, device) -> list[LayerFeatures]:
    """Each layer's attention features, from one token through `model`; UnsupportedModel, naming
    the feature, if some layer needs one paged attention lacks or does not attend through it."""
    probe = AttentionProbe()
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
          position_ids=torch.zeros(1, 1, dtype=torch.long, device=device), paged=probe, use_cache=False)
    name = getattr(model.config, "model_type", "model")
    if probe.lacking:
        raise UnsupportedModel(f"{name} checkpoints need {', '.join(dict.fromkeys(probe.lacking))}, "
                               "which pdserve's paged attention does not serve")
    if sorted(probe.layers) != list(range(num_layers)):
        raise UnsupportedModel(f"{name} checkpoints have layers without attention (recurrent or state-space "
                               "state), which pdserve's paged KV cache does not hold")
    if probe.kv_shapes != {(kv_heads, head_dim)}:
        raise UnsupportedModel(f"{name} checkpoints have per-layer KV head counts or head sizes "
                               f"{sorted(probe.kv_shapes)}, which pdserve's KV pool does not hold")
    return [probe.layers[i] for i in range(num_layers)]


def _no_mask(*args, **kwargs):
    return None  # masking is done per sequence inside paged_attention


def register() -> str:
    """Make the paged implementation selectable by name; idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
