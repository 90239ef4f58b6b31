"""Loads a checkpoint, owns the KV pool, and runs one forward over a scheduled step.

The step is flattened into one row `[1, T]`: decode tokens first, then prefill chunks. Only
the rows whose sequences need a new token go through the LM head (`logits_to_keep`).

The forward is transformers' own module tree with two swaps: attention is the opaque paged op
(engine/forward/attention.py), whose decode rows run the CPU decode kernel (engine/kernels/cpu_kernel.py) where
it builds, and, on CPU, linear layers run on oneDNN-prepacked weights (engine/forward/dense.py), with
Llama-shaped attention and MLP modules on stacked q|k|v and gate|up linears (engine/forward/fused.py).
`engine.compile` may then compile it (engine/forward/switchboard.py).
"""

from __future__ import annotations

import copy
import functools
import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine import sampler
from engine.config import EngineConfig
from engine.forward import attention, dense, features, greedy_head, switchboard
from engine.kernels import cpu_kernel
from engine.kv_cache import allocate_kv_pool
from engine.request import Request, ScheduledItem
from sizing import kv_pool
from sizing.memory import ModelShape, num_kv_blocks

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The pool's and weights' dtype by the one rule (sizing/kv_pool.py): an explicit dtype wins;
    `auto` is bfloat16 where the device computes it natively, float32 elsewhere."""
    return DTYPES[kv_pool.resolve_dtype(config.dtype, device.type)]


def computes_bf16(device: torch.device) -> bool:
    return kv_pool.computes_bf16(device.type)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        hf_config = AutoConfig.from_pretrained(config.model_path)
        self.dtype = resolve_dtype(config, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model_path, config=copy.deepcopy(hf_config), dtype=self.dtype,
            attn_implementation=attention.register(),
        ).to(self.device).eval()
        self.hf_config = self.model.config
        self.shape = ModelShape.from_hf_config(self.hf_config)
        # each layer's scaling / window / softcap; UnsupportedModel (at load) for what we cannot serve
        self.layer_features = features.probe_features(self.model, self.shape.num_layers, self.shape.num_kv_heads,
                                                       self.shape.head_dim, self.device)
        self.windows = sorted({f.sliding_window for f in self.layer_features if f.sliding_window})
        self.block_size = config.block_size
        kernels, self.kernel_reason = self._cpu_kernels()
        # what the CPU kernels run here, in a word ("AVX512-BF16", "AVX2", ...; "torch" without them)
        # and in a phrase, for the worker's status and its start-up line
        self.kernel_isa = kernels.best() if kernels else "torch"
        self.kernel_paths = kernels.paths() if kernels else "none (torch's paths)"
        self.decode_kernel = kernels.decode if kernels else None
        self.prefill_kernel = kernels.prefill if kernels else None
        self.argmax = kernels.argmax if kernels else None  # greedy sampling's, on the CPU
        # linears on a few rows (decode steps) by the kernel, from panel-packed weights: float32, or
        # bfloat16 on AMX tiles, by AVX512-BF16's vdpbf16ps or by AVX2's FMAs
        self.small_gemm = kernels.gemm_for(self.dtype) if kernels else None
        self.num_blocks = self._num_blocks()
        self.kv = allocate_kv_pool(self.shape.num_layers, self.num_blocks, self.block_size,
                                   self.shape.num_kv_heads, self.shape.head_dim, self.dtype, self.device)
        self.forward = switchboard.Forward(self.model, config.compile, self.device, config.cuda_graphs,
                                        prepack=config.prepack_linears, kernels=kernels,
                                        fuse=config.fuse_layers, kernel_layers=config.kernel_layers,
                                        greedy_head=config.greedy_head,
                                        graph_buckets=switchboard.graph_buckets(config.max_num_seqs))
        self.forward.warm_up(self.fresh_prompt_metadata)

    def describe(self) -> str:
        """One line for the worker's start-up log: what runs, and why where it was chosen."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.config.dtype == "auto":
            native = "computes bfloat16 natively" if computes_bf16(self.device) else "has no native bfloat16"
            dtype += f" (auto: this {self.device.type} {native})"
        if self.forward.compiled:
            how = "compiled"
            if self.forward.cuda_graphs:
                how += f" with CUDA graphs for decode batches {','.join(map(str, self.forward.captured))}"
            elif self.forward.graphs_reason:
                how += f" without CUDA graphs ({self.forward.graphs_reason})"
        elif self.forward.fallback_reason:
            how = f"eager (compile failed: {self.forward.fallback_reason})"
        else:
            how = f"eager (engine.compile: {self.config.compile})"
        if self.decode_kernel is not None:
            how += ", decode and prefill attention by the CPU kernels"
            if dense.small_gemm_layers(self.model):
                how += f", linears by the CPU kernel ({self.small_gemm.reach})"
        else:
            how += f", decode attention by SDPA ({self.kernel_reason})"
        attn, mlps = self.forward.fused_layers
        if attn or mlps:
            rotary = "by the CPU kernel" if self.forward.rope is not None else "by torch"
            how += f", {attn} attention modules on one q|k|v linear (rotary {rotary}) and {mlps} MLPs on one gate|up"
        if self.forward.kernel_layers:
            how += f", {self.forward.kernel_layers} decoder layers as one kernel call each"
            if self.forward.kernel_decoder is not None:
                how += " (the decoder's loop too)"
            if self.forward.lean_decoder is not None and self.small_gemm.max_rows is not None:
                how += f"; past {self.small_gemm.max_rows} rows the decoder's loop as direct calls"
        elif self.forward.lean_decoder is not None:
            how += ", the decoder's loop as direct calls"
        if self.forward.greedy_head is not None:
            how += f", greedy steps' tokens from {self.forward.greedy_head.what}"
        elif self.forward.kernel_decoder is not None:
            how += f", greedy steps through the {dtype} LM head ({self.forward.greedy_reason})"
        return f"CPU kernels {self.kernel_paths}; {self.hf_config.model_type} in {dtype} on {self.device}, {how}"

    def _cpu_kernels(self) -> tuple[cpu_kernel.Kernels | None, str]:
        """pdserve's CPU kernels, or None and why not (`engine.cpu_kernels`: `on` makes missing
        kernels an error, `auto` runs torch's paths and says why at start)."""
        setting = self.config.cpu_kernels
        if setting == "off":
            return None, "engine.cpu_kernels: off"
        if not cpu_kernel.supports(self.dtype, self.device):
            why = f"the kernel runs on CPU in float32 or bfloat16, not {self.device.type} {self.dtype}"
        else:
            kernel, why = cpu_kernel.load()
            if kernel is not None:
                return kernel, ""
        if setting == "on":
            raise ValueError(f"engine.cpu_kernels is on, but {why}")
        log.warning("engine.cpu_kernels: auto runs torch's slower paths: %s", why)
        return None, why

    @property
    def block_bytes(self) -> int:
        """The bytes of one KV block, every layer's K and V."""
        return self.kv[0].numel() * self.kv.element_size()

    def _num_blocks(self) -> int:
        cfg = self.config
        by_config = kv_pool.kv_pool_blocks(self.shape, str(self.dtype).removeprefix("torch."), self.block_size,
                                           cfg.num_blocks, cfg.kv_cache_memory)
        if by_config is not None:
            budget = cfg.kv_cache_memory
            blocks = by_config
        else:
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            if self.small_gemm is not None and self.small_gemm.max_rows is not None:  # panels beside oneDNN's copy
                weights += sum(m.weight.numel() * m.weight.element_size() for m in self.model.modules()
                               if type(m) is torch.nn.Linear)
            head = self.model.get_output_embeddings()
            if (self.small_gemm is not None and self.dtype == torch.float32 and self.config.greedy_head
                    and head is not None):
                weights += head.weight.numel() * 2  # the greedy head's half-float copy, where it is made
            elif (self.small_gemm is not None and self.dtype == torch.bfloat16 and self.config.greedy_head
                  and head is not None and self.small_gemm.int8_head_ready()):
                weights += greedy_head.Bf16GreedyHead.int8_bytes(*head.weight.shape, head.bias is not None)
            budget = int(device_memory(self.device) * cfg.memory_fraction) - weights - cfg.runtime_overhead
            blocks = num_kv_blocks(self.shape, self.dtype, budget, self.block_size)
        if blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes); lower the overhead "
                             "or set kv_cache.num_blocks")
        return blocks

    @torch.inference_mode()
    def execute(self, items: list[ScheduledItem], greedy: bool = False) -> torch.Tensor:
        """Run one step; returns float32 logits `[n_sampling, vocab]` in the order of `items`, or,
        with `greedy` (every sampled row samples greedily), maybe their greedy tokens `[n_sampling]`
        (int64) instead: the argmax of those logits, found without them (engine/forward/greedy_head.py), or
        taken from bfloat16 logits as they are (no float32 copy of them: sampler.greedy)."""
        input_ids, positions, meta, sample_rows = self._prepare(items)
        with attention.step_context(meta):
            out = self.forward(input_ids, positions, sample_rows, decode_only=not meta.prefills, greedy=greedy)
        if out.dim() == 1:
            return out
        logits = out[0]
        if greedy and logits.dtype == torch.bfloat16:
            return sampler.greedy(logits, self.argmax)
        return logits.float()

    def _prepare(self, items: list[ScheduledItem]):
        """Flatten `items` (decodes first, as the scheduler orders them) into one row."""
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        sample_rows: list[int] = []
        chunks: list[attention.PrefillChunk] = []
        num_decodes = sum(1 for it in items if it.is_decode)
        assert all(it.is_decode for it in items[:num_decodes]), "decode items must come first"
        for it in items:
            if not it.is_decode:
                chunks.append(self._chunk(it, len(ids)))
            ids.extend(it.request.token_slice(it.start, it.end))
            pos.extend(range(it.start, it.end))
            self._slots(it.request, it.start, it.end, slot_blocks, slot_offsets)
            if it.samples:
                sample_rows.append(len(ids) - 1)
        dev = self.device
        decodes = items[:num_decodes]
        meta = attention.StepMetadata(kv=self.kv, slot_blocks=torch.tensor(slot_blocks, device=dev),
                                      slot_offsets=torch.tensor(slot_offsets, device=dev),
                                      decode_groups=[] if self.decode_kernel else self._decode_groups(decodes),
                                      prefills=chunks, decode_rows=self._decode_rows(decodes),
                                      prefill_kernel=self.prefill_kernel)
        return (torch.tensor([ids], device=dev), torch.tensor([pos], device=dev), meta,
                torch.tensor(sample_rows, dtype=torch.long, device=dev))

    def _slots(self, req: Request, start: int, end: int, blocks: list[int], offsets: list[int]) -> None:
        """Append the (block, offset) of positions [start, end) of `req`. Plain ints: per step this
        runs once per request, mostly for one decode token, where tensors cost more than the arithmetic."""
        bs, table = self.block_size, req.block_ids
        for p in range(start, end):
            blocks.append(table[p // bs])
            offsets.append(p % bs)

    def fresh_prompt_metadata(self, tokens: int) -> attention.StepMetadata:
        """One step of a fresh `tokens`-token prompt written to scratch slots from block 0 (the
        compiled forward's warm-up, before any block holds anything)."""
        positions = torch.arange(tokens)
        return attention.StepMetadata(
            kv=self.kv, slot_blocks=(positions // self.block_size % self.num_blocks).to(self.device),
            slot_offsets=(positions % self.block_size).to(self.device), decode_groups=[],
            prefills=[self._fresh_chunk(0, tokens)])

    def _fresh_chunk(self, row: int, q: int) -> attention.PrefillChunk:
        keys = torch.arange(q)  # keys == the chunk's own tokens, plain causal
        return attention.PrefillChunk(row, row + q, None, None, self._window_masks(keys, keys, q))

    def _chunk(self, it: ScheduledItem, row: int) -> attention.PrefillChunk:
        q = it.num_tokens
        if self.prefill_kernel is not None:  # no masks, no gather: the kernel reads the blocks
            table = torch.tensor(it.request.block_ids[:-(-it.end // self.block_size)], dtype=torch.long)
            return attention.PrefillChunk(row, row + q, None, None, table=table, first_pos=it.start)
        if it.start == 0:
            return self._fresh_chunk(row, q)
        num_blocks = -(-it.end // self.block_size)  # the keys: whole blocks, the last one partly filled
        ctx_blocks = torch.tensor(it.request.block_ids[:num_blocks], device=self.device)
        # query i sits at position start + i and may see keys 0 .. start + i (never the unwritten tail)
        keys, queries = torch.arange(num_blocks * self.block_size), torch.arange(it.start, it.end)
        mask = (keys[None, :] <= queries[:, None]).to(self.device)
        return attention.PrefillChunk(row, row + q, ctx_blocks, mask,
                                      self._window_masks(keys, queries, it.end, mask))

    def _window_masks(self, keys: torch.Tensor, queries: torch.Tensor, end: int,
                      causal: torch.Tensor | None = None) -> dict[int, torch.Tensor | None]:
        """Per window size: the causal mask of `queries` (positions) over `keys` (positions)
        narrowed to each query's window; the causal mask itself where no query reaches past
        its window (all of its keys are within `end` <= window)."""
        masks: dict[int, torch.Tensor | None] = {}
        for window in self.windows:
            if end <= window:
                masks[window] = causal
            else:
                masks[window] = attention.window_mask(queries, keys, window).to(self.device)
        return masks

    def _decode_rows(self, decodes: list[ScheduledItem]) -> attention.DecodeRows | None:
        """The decode rows' block tables (padded with -1, never read: the kernel's check refuses a row
        whose own blocks are short of its length) and context lengths, for the kernel."""
        if self.decode_kernel is None or not decodes:
            return None
        lens = [it.end for it in decodes]
        width = -(-max(lens) // self.block_size)
        table = [self._table(it, width) for it in decodes]
        return attention.DecodeRows(self.decode_kernel, torch.tensor([r + [-1] * (width - len(r)) for r in table]),
                                    torch.tensor(lens))

    def _table(self, it: ScheduledItem, width: int) -> list[int]:
        """The first `width` (or fewer) blocks of `it`'s table; RuntimeError where they are fewer than
        its `end` keys need (padding would attend to whatever the pad names)."""
        table = it.request.block_ids[:width]
        if len(table) * self.block_size < it.end:
            raise RuntimeError(f"request {it.request.request_id} has {len(table)} KV blocks of {self.block_size}, "
                               f"fewer than its {it.end} keys need")
        return table

    def _decode_groups(self, decodes: list[ScheduledItem]) -> list[attention.DecodeGroup]:
        """Split the decode rows (sorted by context length) where padding to the group's
        longest context would waste more than about a third of the gathered keys."""
        groups, start = [], 0
        for i in range(1, len(decodes) + 1):
            if i == len(decodes) or decodes[i].end > 1.5 * decodes[start].end + self.block_size:
                groups.append(self._decode_group(decodes[start:i], start))
                start = i
        return groups

    def _decode_group(self, decodes: list[ScheduledItem], start: int) -> attention.DecodeGroup:
        bs = self.block_size
        lens = [it.end for it in decodes]
        max_ctx = max(lens)
        max_blocks = (max_ctx + bs - 1) // bs
        rows = [self._table(it, max_blocks) for it in decodes]
        # padded with the row's own first block, never written while the row runs (block 0 may be
        # landing a KV transfer right now); the mask hides the padding either way
        table = torch.tensor([r + r[:1] * (max_blocks - len(r)) for r in rows])  # [B, max_blocks]
        ctx_lens = torch.tensor(lens)  # [B]
        positions = torch.arange(max_blocks * bs)  # the keys of whole blocks
        mask = (positions[None, :] < ctx_lens[:, None])[:, None, None, :].to(self.device)  # [B, 1, 1, max_blocks * bs]
        windows = {}
        for window in self.windows:  # the query at position len - 1 sees keys len - window .. len - 1
            inside = positions[None, :] >= ctx_lens[:, None] - window
            windows[window] = mask if max_ctx <= window else mask & inside[:, None, None, :].to(self.device)
        return attention.DecodeGroup(start, start + len(decodes), table.to(self.device), mask, windows)


@functools.lru_cache(maxsize=8)
def probe_checkpoint(model_path: str) -> tuple[features.LayerFeatures, ...]:
    """`features.probe_features` of the checkpoint at `model_path`, built from its config on the meta
    device (no weights read, no memory): the router's refusal before any worker loads it."""
    hf_config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attention.register())
    shape = ModelShape.from_hf_config(model.config, num_params=0)
    return tuple(features.probe_features(model, shape.num_layers, shape.num_kv_heads, shape.head_dim, "meta"))


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
