"""LLMEngine: requests in, `RequestOutput`s out, one `step()` at a time (continuous batching).

Not thread-safe: a worker calls it from one thread. Ownership of KV blocks: the scheduler
allocates and frees them for ordinary requests; `reserve`/`release` manage blocks set aside
for KV that another worker will push; a `prefill_only` request keeps its blocks after its
first token until `release` (its KV is being sent).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import BlockAllocator
from engine.model_runner import ModelRunner
from engine.request import InvalidRequest, Request, RequestOutput, SamplingParams, Status
from engine.sampler import sample
from engine.scheduler import Scheduler
from engine.validation import RequestValidator


@dataclass
class StepStats:
    """Cumulative timings, for benchmarks: how much of a step is the model forward."""

    steps: int = 0
    step_s: float = 0.0
    forward_s: float = 0.0
    decode_steps: int = 0
    decode_step_s: float = 0.0
    decode_forward_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        hf = self.runner.hf_config
        self.vocab_size = hf.vocab_size
        self.max_model_len = config.max_model_len or hf.max_position_embeddings
        self.eos_token_id = _eos_id(hf, self.tokenizer)
        self.validator = RequestValidator(self.tokenizer, self.vocab_size, self.max_model_len)
        self.allocator = BlockAllocator(self.runner.num_blocks)
        self.scheduler = Scheduler(config, self.allocator)
        self.requests: dict[str, Request] = {}
        self.reserved: dict[str, list[int]] = {}
        self._arrivals = itertools.count()
        self._generator = torch.Generator().manual_seed(config.seed)
        self.stats = StepStats()

    # ---- admission -------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                     sampling: SamplingParams | None = None, prefill_only: bool = False) -> Request:
        """Validate and build a request without queueing it (raises InvalidRequest)."""
        sampling = sampling or SamplingParams()
        if request_id in self.requests or request_id in self.reserved:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        ids = self.validator.prompt_ids(prompt, prompt_token_ids)
        self.validator.check(len(ids), sampling, self.allocator.num_blocks, self.config.block_size)
        return self._build(request_id, ids, sampling, prefill_only)

    def _build(self, request_id: str, ids: list[int], sampling: SamplingParams, prefill_only: bool) -> Request:
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        return Request(request_id, ids, sampling, IncrementalDetokenizer(self.tokenizer, ids, sampling.stop),
                       eos_token_id=self.eos_token_id, prefill_only=prefill_only,
                       arrival=next(self._arrivals), generator=gen)

    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    sampling: SamplingParams | None = None, prefill_only: bool = False) -> Request:
        req = self.make_request(request_id, prompt, prompt_token_ids, sampling, prefill_only)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    # ---- disaggregation: blocks that another worker fills --------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        ids = self.allocator.allocate(self.blocks_for(num_tokens), request_id)
        if ids is not None:
            self.reserved[request_id] = ids
        return ids

    def release(self, request_id: str) -> None:
        """Free a reservation, or the blocks a finished prefill-only request kept."""
        ids = self.reserved.pop(request_id, None)
        if ids is None:
            req = self.requests.get(request_id)
            if req is None or req.status is not Status.FINISHED:
                return  # nothing held outside the scheduler (a running request frees via abort)
            del self.requests[request_id]
            ids, req.block_ids = req.block_ids, []
        self.allocator.free(ids)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      first_token: int) -> None:
        """Admit a request whose prompt KV another worker pushed into its reserved blocks."""
        request = self._build(request_id, list(prompt_token_ids), sampling, prefill_only=False)
        request.block_ids = self.reserved.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.requests[request_id] = request
        self.scheduler.admit_running(request)
        self._append_token(request, first_token)
        request.detokenizer.take_delta(final=False)  # the prefill worker already streamed this text

    # ---- the step ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        items = self.scheduler.schedule()
        if not items:
            return []
        t1 = time.perf_counter()
        logits = self.runner.execute(items)
        t2 = time.perf_counter()
        sampling = [it.request for it in items if it.samples]
        for it in items:
            it.request.num_computed_tokens += it.num_tokens
        tokens = sample(logits, sampling, self._generator)
        outputs = [self._emit(req, tok) for req, tok in zip(sampling, tokens, strict=True)]
        self._record(items, t0, t1, t2, time.perf_counter())
        return outputs

    def _record(self, items, t0: float, t1: float, t2: float, t3: float) -> None:
        s = self.stats
        s.steps += 1
        s.step_s += t3 - t0
        s.forward_s += t2 - t1
        if all(it.is_decode for it in items):
            s.decode_steps += 1
            s.decode_step_s += t3 - t0
            s.decode_forward_s += t2 - t1
            s.batch_sizes.append(len(items))

    def _emit(self, req: Request, token: int) -> RequestOutput:
        reason = self._append_token(req, token)
        if reason is not None:
            self._finish(req, reason)
        return RequestOutput(req.request_id, [token], req.detokenizer.take_delta(final=reason is not None),
                             reason, req.num_prompt_tokens, len(req.output_token_ids))

    def _append_token(self, req: Request, token: int) -> str | None:
        """Record one new token; the finish reason it causes, if any."""
        req.output_token_ids.append(token)
        hit_stop_string = req.detokenizer.add_token(token)
        p = req.sampling
        if hit_stop_string or token in p.stop_token_ids or (token == req.eos_token_id and not p.ignore_eos):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens:
            return "length"
        if req.prefill_only:
            return "prefilled"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        keep = reason == "prefilled"
        self.scheduler.finish(req, keep_blocks=keep)
        if not keep:
            self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request wherever it is; frees its blocks. None if unknown."""
        if request_id in self.reserved:
            self.release(request_id)
            return None
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is Status.FINISHED:
            self.release(request_id)
            return None
        self._finish(req, "abort")
        return RequestOutput(request_id, [], "", "abort", req.num_prompt_tokens, len(req.output_token_ids))

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """End every waiting or running request with finish reason "error", freeing its blocks."""
        failed = list(self.scheduler.running) + list(self.scheduler.waiting)
        for req in failed:
            self._finish(req, "error")
        return [RequestOutput(r.request_id, [], reason, "error", r.num_prompt_tokens, len(r.output_token_ids))
                for r in failed]

    # ---- introspection -------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def check(self) -> None:
        """Block accounting holds: the allocator's integrity, and every owned block is accounted for."""
        self.allocator.check()
        held = sum(len(r.block_ids) for r in self.requests.values()) + sum(map(len, self.reserved.values()))
        assert held == self.allocator.num_used, f"requests hold {held} blocks, allocator says {self.allocator.num_used}"

    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams | None = None) -> list[list[int]]:
        """Run prompts to completion; output token ids per prompt (for tests and benchmarks)."""
        ids = []
        for i, p in enumerate(prompts):
            kw = {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}
            ids.append(self.add_request(f"gen-{next(self._arrivals)}-{i}", sampling=sampling, **kw).request_id)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].extend(out.token_ids)
        return [results[rid] for rid in ids]


def _eos_id(hf_config, tokenizer) -> int | None:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if eos is not None else tokenizer.eos_token_id
