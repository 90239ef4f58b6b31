"""What each layer's attention asks of paged attention, learned by running the model once.

Families differ in what their attention modules hand the attention function (sliding windows,
soft-caps, scalings, sinks...). Rather than a table per family, one token runs through the model
with an `AttentionProbe` active: each layer's call records its keyword arguments instead of
attending. What paged attention honours becomes `LayerFeatures`; anything else (sinks,
bidirectional attention, a bias of the model's own, layers that never call it, per-layer KV shapes)
is `UnsupportedModel`, one line naming the feature, at load and never as wrong tokens.
`model_runner.probe_checkpoint` does the same from config.json alone, on the meta device (no
weights, no memory), so the router refuses a checkpoint before starting any worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


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

    def record(self, module, query, key, value, attention_mask, scaling, sliding_window, softcap, kwargs):
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


_probing: list = []  # the probe of the forward now running, if any


def active_probe():
    """The probe paged attention records into instead of attending (an `AttentionProbe` during
    `probe_features`; engine/forward/fused.py's check of a fused layer has one of its own)."""
    return _probing[-1] if _probing else None


@contextlib.contextmanager
def probing(probe) -> Iterator[None]:
    """While in the block, paged attention calls `probe.record(module, query, key, value,
    attention_mask, scaling, sliding_window, softcap, kwargs)` and returns what it returns."""
    _probing.append(probe)
    try:
        yield
    finally:
        _probing.pop()


@torch.inference_mode()
def probe_features(model, num_layers: int, kv_heads: int, head_dim: int, device) -> list[LayerFeatures]:
    """Each layer's attention features, from one token through `model`; UnsupportedModel, naming
    the feature, if some layer needs one paged attention lacks or does not attend through it."""
    probe = AttentionProbe()
    name = getattr(model.config, "model_type", "model")
    one = torch.ones(1, 1, dtype=torch.long, device=device)
    failure: Exception | None = None
    try:  # an explicit 2D mask spares transformers' packed-sequence check, which the meta device cannot run
        with probing(probe):
            model(input_ids=one, attention_mask=one, use_cache=False)
    except Exception as exc:
        if not probe.lacking:  # a model that cannot run one token: its own error says why
            raise
        failure = exc  # it failed on a feature the probe named: the refusal below says which, chained to it
    if probe.lacking:
        raise UnsupportedModel(f"{name} checkpoints need {', '.join(dict.fromkeys(probe.lacking))}, "
                               "which pdserve's paged attention does not serve") from failure
    if sorted(probe.layers) != list(range(num_layers)):
        raise UnsupportedModel(f"{name} checkpoints have layers without attention (recurrent or state-space "
                               "state), which pdserve's paged KV cache does not hold")
    if probe.kv_shapes != {(kv_heads, head_dim)}:
        raise UnsupportedModel(f"{name} checkpoints have per-layer KV head counts or head sizes "
                               f"{sorted(probe.kv_shapes)}, which pdserve's KV pool does not hold")
    return [probe.layers[i] for i in range(num_layers)]
