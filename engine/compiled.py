"""The model forward, eager or compiled (`engine.compile: auto | on | off`).

Compiled is the decoder (the model without its head: embeddings, layers, final norm), traced by
dynamo with the token dimension dynamic and lowered by inductor with `freezing` (weights become
constants: on CPU their linears are prepacked for oneDNN, on GPU they feed fused kernels). The
head stays eager in transformers' own code, so each family's logit post-processing (soft-capping,
scaling) is theirs, and the graph's output — every token's hidden state — always depends on every
layer: nothing in it is ever dead code. That matters because paged attention is an opaque custom
op (engine/attention.py) whose KV write the compiler cannot see; a graph whose output ignored
the last layer (a step that samples no row) would drop that layer's write.

The graph sees `[1, T]` ids and positions whatever the requests are, so a changing batch never
recompiles. Dynamo specialises size 1, so there are two graphs (one token; several), both
compiled by `warm_up` before the worker reports ready. `recompilations` counts graphs compiled
after that (a bench reports it; it should stay 0).

With `engine.cuda_graphs` on a CUDA device the compiled forward is captured into CUDA graphs
piecewise: inductor partitions the graph at the attention op (tagged cudagraph-unsafe, since it
reads per-step metadata from Python) and captures the dense pieces between, one set per token
count, the way vLLM's piecewise CUDA graphs split at attention.

`auto` compiles on CUDA and not on CPU: on the 2-core CPU host, compiling SmolLM2 takes 60-155 s
per worker start for about 10% over the eager path with prepacked linears (docs/engine_speed.md).
A model that fails to compile falls back to eager with one logged line naming the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from engine import attention, dense

log = logging.getLogger(__name__)

WARM_TOKENS = (1, 17)  # dynamo specialises size 1: one graph for a lone token, one for any other count

def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Forward:
    """`(input_ids [1, T], positions [1, T], sample_rows [n]) -> logits [1, n, V]`."""

    def __init__(self, model: nn.Module, mode: str, device: torch.device, cuda_graphs: bool = False,
                 prepack: bool = True):
        self.model = model
        self.decoder = model.get_decoder()
        self.device = device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.prepack = prepack
        self.fallback_reason: str | None = None
        self._compiled = None
        if mode == "on" or (mode == "auto" and device.type == "cuda"):
            self._compiled = self._build()
            self.decoder.forward = self._compiled  # the head calls it as always
            self._pack(skip=self.decoder)  # the decoder's are inductor's
        else:
            self._pack()
        self._graphs_at_ready: int | None = None

    def _build(self):
        options = {"freezing": True}
        if self.cuda_graphs:
            options.update({"triton.cudagraphs": True, "graph_partition": True})  # split at the attention op
        return torch.compile(type(self.decoder).forward.__get__(self.decoder), dynamic=True, fullgraph=True,
                             options=options)

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        log.warning("engine.compile: this model did not compile, serving it eagerly (%s)", reason)
        self._compiled = None
        del self.decoder.forward  # the class's forward again
        self._pack()

    def _pack(self, skip: nn.Module | None = None) -> None:
        if self.prepack:
            dense.pack_linears(self.model, self.device, skip=skip)

    def __call__(self, input_ids, positions, sample_rows):
        return self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                          logits_to_keep=sample_rows).logits

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @property
    def recompilations(self) -> int:
        """Graphs compiled since `warm_up` finished (0 when eager)."""
        if self._compiled is None or self._graphs_at_ready is None:
            return 0
        return _graphs_compiled() - self._graphs_at_ready

    @torch.inference_mode()
    def warm_up(self, fresh_prompt: Callable[[int], attention.StepMetadata]) -> None:
        """Compile every graph serving will need (see the module doc): one step of a fresh prompt of
        1 and of several tokens, whose metadata `fresh_prompt(tokens)` builds on scratch slots.
        Runs before the worker reports ready, when no block holds anything yet. A failure here
        falls back to eager, once, with the reason logged."""
        if self._compiled is None:
            return
        try:
            for tokens in WARM_TOKENS:
                positions = torch.arange(tokens, device=self.device)
                with attention.step_context(fresh_prompt(tokens)):
                    self(torch.zeros(1, tokens, dtype=torch.long, device=self.device), positions[None], positions[-1:])
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: serve eagerly
            text = str(exc).strip()
            self._fall_back(f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no message'}"[:300])
            return
        self._graphs_at_ready = _graphs_compiled()
