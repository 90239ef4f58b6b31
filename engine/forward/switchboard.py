"""The model forward, eager or compiled (`engine.compile: auto | on | off`).

Compiled is the decoder (the model without its head: embeddings, layers, final norm), traced by
dynamo with the token dimension dynamic and lowered by inductor with `freezing` (weights become
constants: on CPU their linears are prepacked for oneDNN, on GPU they feed fused kernels). The
head stays eager in transformers' own code, so each family's logit post-processing (soft-capping,
scaling) is theirs, and the graph's output — every token's hidden state — always depends on every
layer: nothing in it is ever dead code. That matters because paged attention is an opaque custom
op (engine/forward/attention.py) whose KV write the compiler cannot see; a graph whose output ignored
the last layer (a step that samples no row) would drop that layer's write.

The graph sees `[1, T]` ids and positions whatever the requests are, so a changing batch never
recompiles. Dynamo specialises size 1, so there are two graphs (one token; several), both
compiled by `warm_up` before the worker reports ready. `recompilations` counts graphs compiled
after that (a bench reports it; it should stay 0).

`engine.cuda_graphs` on a CUDA device adds a second compiled decoder for decode-only steps,
captured piecewise into CUDA graphs: inductor partitions the graph at the attention op (tagged
cudagraph-unsafe, since it reads per-step metadata from Python) and its CUDA-graph trees capture
the dense pieces between, the way vLLM's piecewise CUDA graphs split at attention. Only a fixed
set of sizes is ever captured — the decode batch buckets (`graph_buckets`): a decode-only step of
n rows is padded to the smallest bucket >= n (the padding rows' tokens and positions are 0, the
attention op writes no KV for them, and no sampled row is a padding row) and replays that
bucket's graphs. Steps with prefill tokens, and decode steps wider than the largest bucket, run
the plain compiled decoder, so prompt lengths never add captures. Every bucket is captured by
`warm_up`; a capture that fails leaves the plain compiled path serving, with the reason logged.

`auto` compiles on CUDA and not on CPU: on the 2-core CPU host, compiling SmolLM2 takes 60-155 s
per worker start for about 10% over the eager path with prepacked linears (docs/engine_speed.md).
A model that fails to compile falls back to eager with one logged line naming the reason.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch
from torch import nn

from engine.forward import attention, dense, fused, kernel_decoder, kernel_layer, lean_decoder
from engine.forward.greedy_head import Bf16GreedyHead, GreedyHead

log = logging.getLogger(__name__)

WARM_TOKENS = (1, 17)  # dynamo specialises size 1: one graph for a lone token, one for any other count
# decode batch sizes captured into CUDA graphs (those up to max_num_seqs, and max_num_seqs itself)
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# inductor's CUDA-graph trees run a new size once without capturing, record it on the next call
# and replay it from the third: three warm-up calls per bucket leave it captured and replayed once
CAPTURE_CALLS = 3


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes to capture: every standard bucket below `max_num_seqs`, and
    `max_num_seqs` itself, so every decode-only step the scheduler can form has a bucket."""
    return tuple(b for b in GRAPH_BUCKETS if b < max_num_seqs) + (max_num_seqs,)


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `num_tokens` rows (`buckets` ascending); None past the largest."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def pad_tokens(input_ids: torch.Tensor, positions: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[1, T]` ids and positions padded with zeros to `[1, size]`: padding rows are computed and
    dropped (they write no KV and are never sampled)."""
    pad = size - input_ids.shape[1]
    if pad == 0:
        return input_ids, positions
    return (torch.nn.functional.pad(input_ids, (0, pad)), torch.nn.functional.pad(positions, (0, pad)))


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _graph_partition_supported() -> bool:
    """Inductor's graph partition (splitting at cudagraph-unsafe ops) came with torch 2.8."""
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config, "graph_partition")


class Forward:
    """`(input_ids [1, T], positions [1, T], sample_rows [n]) -> logits [1, n, V]`."""

    def __init__(self, model: nn.Module, mode: str, device: torch.device, cuda_graphs: bool = False,
                 prepack: bool = True, graph_buckets: tuple[int, ...] = (), kernels=None, fuse: bool = True,
                 kernel_layers: bool = True, greedy_head: bool = True):
        self.model = model
        self.decoder = model.get_decoder()
        self.device = device
        self.prepack = prepack
        # pdserve's CPU kernels (cpu_kernel.Kernels), or None: torch's ops. Rotary and the norms take
        # float32 and bfloat16 (so does the activation); the GEMM float32, or bfloat16 (AMX, AVX512-BF16, AVX2); whole
        # layers wherever the GEMM takes the dtype
        dtype = next(model.parameters()).dtype
        self.small_gemm = kernels.gemm_for(dtype) if kernels else None  # linears on a few rows
        self.rope = kernels.rope if kernels else None  # fused layers' rotary
        self.rms_norm = kernels.rms_norm if kernels else None  # fused norms
        self.silu_mul = kernels.silu_mul if kernels else None  # fused MLPs' activation
        self.fuse = fuse  # fused q|k|v and gate|up layers where linears are packed (engine/forward/fused.py)
        self.fused_layers = (0, 0)  # (attention modules, MLPs) fused
        # with `fuse`: each decoder layer that is all the kernels' as one call (engine/forward/kernel_layer.py)
        self.layer_kernel = kernels if kernel_layers and self.small_gemm is not None else None
        self.kernel_layers = 0  # decoder layers so swapped
        self.kernel_decoder: kernel_decoder.KernelDecoder | None = None  # all of them: the decoder's loop too
        # fused layers: the decoder's loop as direct calls (engine/forward/lean_decoder.py), for the steps the
        # kernel decoder does not take (more rows than its GEMM's cut), or every step where there is none
        self.lean_decoder: lean_decoder.LeanDecoder | None = None
        # with the kernel decoder: an all-greedy step's tokens without the float32 logits (engine/forward/greedy_head.py)
        self._want_greedy_head = greedy_head
        self.greedy_head: GreedyHead | Bf16GreedyHead | None = None
        self.greedy_reason: str | None = "engine.greedy_head: off"  # why there is none (None: there is)
        self.fallback_reason: str | None = None
        self.graphs_reason: str | None = None  # why CUDA graphs were asked for and are not used
        self._compiled = None
        self._graphed = None  # the decoder compiled with CUDA graphs, for decode-only steps
        self._use_graphed = False
        self.buckets: tuple[int, ...] = ()  # decode-only steps are padded to these sizes
        self.captured: tuple[int, ...] = ()  # the buckets whose CUDA graphs warm_up recorded
        self.capture_skips = 0  # graph pieces inductor declined to capture while warm_up recorded
        self.graph_steps = 0  # steps that replayed captured graphs (warm-up's included)
        if mode == "on" or (mode == "auto" and device.type == "cuda"):
            self._compiled = self._build(cudagraphs=False)
            if cuda_graphs and device.type == "cuda":
                self._start_graphs(graph_buckets)
            self.decoder.forward = self._decoder_forward  # the head calls it as always
            self._pack(skip=self.decoder)  # the decoder's are inductor's
        else:
            self._pack()
        self._graphs_at_ready: int | None = None

    def _start_graphs(self, buckets: tuple[int, ...]) -> None:
        if not _graph_partition_supported():
            self._no_graphs(f"torch {torch.__version__} has no inductor graph partition")
            return
        self._graphed = self._build(cudagraphs=True)
        self.buckets = tuple(sorted(buckets))

    def _build(self, cudagraphs: bool):
        options = {"freezing": True}
        if cudagraphs:
            options.update({"triton.cudagraphs": True, "graph_partition": True})  # split at the attention op
        return torch.compile(type(self.decoder).forward.__get__(self.decoder), dynamic=True, fullgraph=True,
                             options=options)

    def _decoder_forward(self, *args, **kwargs):
        return (self._graphed if self._use_graphed else self._compiled)(*args, **kwargs)

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        log.warning("engine.compile: this model did not compile, serving it eagerly (%s)", reason)
        self._compiled = self._graphed = None
        self.buckets = self.captured = ()
        del self.decoder.forward  # the class's forward again
        self._pack()

    def _no_graphs(self, reason: str) -> None:
        self.graphs_reason = reason
        log.warning("engine.cuda_graphs: serving compiled without CUDA graphs (%s)", reason)
        self._graphed = None
        self.buckets = self.captured = ()

    def _pack(self, skip: nn.Module | None = None) -> None:
        if self.prepack:
            if self.fuse:
                self.fused_layers = fused.fuse_layers(self.model, self.device, gemm=self.small_gemm, rope=self.rope,
                                                      silu_mul=self.silu_mul, skip=skip)
            dense.pack_linears(self.model, self.device, skip=skip, gemm=self.small_gemm)
            dense.fuse_rms_norms(self.model, self.device, skip=skip, kernel=self.rms_norm if self.fuse else None)
            if self.fuse and self.layer_kernel is not None and skip is None:
                self.kernel_layers = kernel_layer.swap_layers(self.model, self.layer_kernel)
                self.kernel_decoder = kernel_decoder.kernel_decoder(self.model)
            # the lean loop calls the modules, not a swapped layer's one call: where only some layers
            # are one call (SmolLM3's rotary ones), the model's forward keeps calling theirs
            if self.fuse and skip is None and (self.kernel_decoder is not None or not self.kernel_layers):
                self.lean_decoder = lean_decoder.lean_decoder(self.model)
        if self._want_greedy_head:
            self._pick_greedy_head()

    def _pick_greedy_head(self) -> None:
        """The float32 head's windowed first pass, or the bfloat16 head's fused argmax, where it fits."""
        head = self.model.lm_head
        gemm = getattr(head, "gemm", None)
        if self.kernel_decoder is None:
            self.greedy_reason = "the decoder is not the kernel's"
        elif gemm is None or gemm.dtype != torch.bfloat16:
            self.greedy_reason = GreedyHead.fits(head)
            tiles = self.layer_kernel.amx_gemm if self.layer_kernel and self.layer_kernel.amx_gemm.ready() else None
            self.greedy_head = GreedyHead(head, tiles) if self.greedy_reason is None else None
        else:
            self.greedy_reason = Bf16GreedyHead.fits(head)
            self.greedy_head = Bf16GreedyHead(head) if self.greedy_reason is None else None

    def __call__(self, input_ids, positions, sample_rows, decode_only: bool = False, greedy: bool = False):
        """`decode_only`: the step has one token per row and no prefill, so it may be padded to a
        bucket and replay that bucket's CUDA graphs. `greedy`: every sampled row is greedy, so the
        greedy tokens `[n]` (int64) may come back instead of the logits."""
        size = bucket_for(input_ids.shape[1], self.buckets) if decode_only else None
        if size is None:
            return self._logits(input_ids, positions, sample_rows, greedy)
        input_ids, positions = pad_tokens(input_ids, positions, size)
        self._use_graphed = self._graphed is not None
        try:
            if self._use_graphed:
                torch.compiler.cudagraph_mark_step_begin()  # last step's graph outputs are consumed
                self.graph_steps += 1
            return self._logits(input_ids, positions, sample_rows, greedy)
        finally:
            self._use_graphed = False

    def _logits(self, input_ids, positions, sample_rows, greedy: bool = False):
        if self.kernel_decoder is not None:
            hidden = self.kernel_decoder(input_ids, positions)
            if hidden is not None:  # the head as the model's forward applies it
                rows = hidden[:, sample_rows, :]
                if greedy and self.greedy_head is not None and rows.shape[1]:
                    tokens = self.greedy_head(rows[0])
                    if tokens is not None:
                        return tokens
                return self.model.lm_head(rows)
        if self.lean_decoder is not None:
            return self.model.lm_head(self.lean_decoder(input_ids, positions)[:, sample_rows, :])
        return self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                          logits_to_keep=sample_rows).logits

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @property
    def cuda_graphs(self) -> bool:
        """Decode-only steps replay captured CUDA graphs."""
        return bool(self.captured)

    @property
    def recompilations(self) -> int:
        """Graphs compiled since `warm_up` finished (0 when eager)."""
        if self._compiled is None or self._graphs_at_ready is None:
            return 0
        return _graphs_compiled() - self._graphs_at_ready

    @torch.inference_mode()
    def warm_up(self, fresh_prompt: Callable[[int], attention.StepMetadata]) -> None:
        """Compile every graph serving will need (see the module doc): one step of a fresh prompt of
        1 and of several tokens, whose metadata `fresh_prompt(tokens)` builds on scratch slots;
        then, with CUDA graphs, capture every decode bucket. Runs before the worker reports ready,
        when no block holds anything yet. A compile failure here falls back to eager, once, with
        the reason logged; a capture failure leaves the plain compiled path serving."""
        if self._compiled is None:
            return
        try:
            for tokens in WARM_TOKENS:
                self._scratch_step(fresh_prompt, tokens, decode_only=False)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: serve eagerly
            self._fall_back(_reason(exc))
            return
        if self._graphed is not None:
            self._capture(fresh_prompt)
        self._graphs_at_ready = _graphs_compiled()

    def _capture(self, fresh_prompt: Callable[[int], attention.StepMetadata]) -> None:
        """Record each bucket's CUDA graphs with a scratch step of exactly that many tokens (the
        graphed pieces never see the attention metadata, so a fresh prompt's serves)."""
        skips = _cudagraph_skips()
        try:
            for size in self.buckets:
                for _ in range(CAPTURE_CALLS):
                    self._scratch_step(fresh_prompt, size, decode_only=True)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - a capture failure must not take the compiled path with it
            self._no_graphs(f"capture failed: {_reason(exc)}")
            return
        # pieces inductor would not capture run uncaptured; it logged why ("skipping cudagraphs ...")
        self.capture_skips = _cudagraph_skips() - skips
        self.captured = self.buckets

    def _scratch_step(self, fresh_prompt: Callable[[int], attention.StepMetadata], tokens: int,
                      decode_only: bool) -> None:
        positions = torch.arange(tokens, device=self.device)
        with attention.step_context(fresh_prompt(tokens)):
            self(torch.zeros(1, tokens, dtype=torch.long, device=self.device), positions[None], positions[-1:],
                 decode_only=decode_only)


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no message'}"[:300]
