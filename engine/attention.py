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
builds no extra mask and runs exactly the plain SDPA path. At load one token runs with an
`AttentionProbe` in place of the metadata (engine/features.py) to learn each layer's features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.features import AttentionProbe

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class PrefillChunk:
    start: int  # query range [start, end) in the flattened row
    end: int
    ctx_blocks: torch.Tensor | None  # [ceil(ctx / bs)] blocks holding all keys; None = fresh prompt (keys == chunk)
    mask: torch.Tensor | None  # [q, ctx_blocks * bs] bool, True = attend; None = plain causal
    window_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # window -> [q, keys] bool; None = causal


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


def _no_mask(*args, **kwargs):
    return None  # masking is done per sequence inside paged_attention


def register() -> str:
    """Make the paged implementation selectable by name; idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
