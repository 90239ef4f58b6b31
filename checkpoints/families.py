"""Tiny random checkpoints of every model family pdserve serves, built from transformers' own
config classes, for token-exactness tests against `generate`.

Each family keeps what makes it differ from Llama, at toy sizes: sliding windows (`WINDOW`
tokens, shorter than the test prompts, not a multiple of the test block sizes) on some layers
but not all, Gemma 2's logit soft-capping, Gemma's `query_pre_attn_scalar` and Granite's
multipliers as attention scaling, q/k norms (Qwen3, OLMo 2, Gemma 3), fused projections
(Phi-3), layers without RoPE (SmolLM3). Weights come from `seed` alone (checkpoints/tiny.py's
init); all share the tiny model's trained tokenizer.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from checkpoints.tiny import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SIZES,
    init_weights,
    save_tokenizer,
    train_tokenizer,
)

WINDOW = 7  # sliding-window tokens: crosses block boundaries of 4 and 8
NUM_LAYERS = 4
SLIDING, FULL = "sliding_attention", "full_attention"
MIXED_LAYERS = [SLIDING, FULL, SLIDING, SLIDING]  # local and global layers both occur

# family -> (transformers config class, what it sets beyond the common tiny shape)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "qwen3": ("Qwen3Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2,
                              "head_dim": 16}),
    "gemma2": ("Gemma2Config", {"sliding_window": WINDOW, "layer_types": MIXED_LAYERS, "head_dim": 16,
                                "query_pre_attn_scalar": 24, "attn_logit_softcapping": 3.0,
                                "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": WINDOW, "layer_types": MIXED_LAYERS, "head_dim": 16,
                                    "query_pre_attn_scalar": 24}),
    "phi3": ("Phi3Config", {"sliding_window": WINDOW}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"attention_multiplier": 0.2, "embedding_multiplier": 2.0,
                                  "residual_multiplier": 0.5, "logits_scaling": 0.5}),
    "smollm3": ("SmolLM3Config", {"use_sliding_window": True, "sliding_window": WINDOW,
                                  "layer_types": [FULL, SLIDING, FULL, SLIDING]}),
}


def build_family_config(family: str):
    """The config of one family's tiny checkpoint (ValueError naming the families if unknown)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    class_name, extra = FAMILIES[family]
    size = SIZES["tiny"]
    return getattr(transformers, class_name)(
        vocab_size=size.vocab_size, hidden_size=size.hidden_size, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=size.num_attention_heads, num_key_value_heads=size.num_key_value_heads,
        intermediate_size=size.intermediate_size, max_position_embeddings=size.max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        dtype="float32", **extra,
    )


@functools.cache
def _tokenizer():
    return train_tokenizer("llama", SIZES["tiny"].vocab_size)


def make_family_model(out_dir: str | os.PathLike[str], family: str, seed: int = 0, **shape: int) -> Path:
    """Write one family's tiny checkpoint (config, safetensors, generation config, tokenizer);
    `shape`: config fields to set instead (e.g. hidden_size, head_dim, num_key_value_heads)."""
    config = build_family_config(family)
    config.update(shape)
    tokenizer, num_trained = _tokenizer()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, seed, [BOS_ID, PAD_ID, *range(num_trained, config.vocab_size)])
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                                               do_sample=False)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, config.max_position_embeddings, out)
    return out
