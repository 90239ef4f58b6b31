"""LLMEngine: requests in, `RequestOutput`s out, one `step()` at a time (continuous batching).

Not thread-safe: a worker calls it from one thread. Ownership of KV blocks: the scheduler
allocates and frees them for ordinary requests; `reserve`/`release` manage blocks set aside
for KV that another worker will push; a `prefill_only` request keeps its blocks after its
first token until `release` (its KV is being sent). A request can resume from outputs made
elsewhere (`add_request(output_token_ids=...)`, `add_prefilled`). An error while sampling or
detokenizing one request ends only that one, with finish reason ERROR; so does a forward that
fails on one request, found by running the step again in halves (engine/isolation.py).

Prefix caching: blocks are reference counted (engine/kv_cache.py). After each step every block a
request just filled is registered under its content hash; admission (scheduler) and `reserve`
reuse registered blocks, so a shared prefix is computed, or pushed, once.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, GenerationConfig

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, NoText
from engine.handoff import KVHandoff
from engine.isolation import ForwardFailed, isolate
from engine.model_runner import ModelRunner
from engine.request import Request, ScheduledItem, Status
from engine.sampler import sample_isolated
from engine.scheduler import PrefixStats
from engine.telemetry import StepLog
from protocol import clock
from protocol.errors import InvalidRequest
from protocol.outputs import FinishReason, RequestOutput
from protocol.sampling import SamplingParams
from protocol.telemetry import TokenKind
from protocol.validation import RequestValidator, validate_request_id
from sizing.cost_model import StepItem, StepShape, StepTotals

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Cumulative timings, for benchmarks: how much of a step is the model forward."""

    steps: int = 0
    step_s: float = 0.0
    forward_s: float = 0.0
    decode_steps: int = 0
    decode_step_s: float = 0.0
    decode_forward_s: float = 0.0


class LLMEngine(KVHandoff):
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        """`runner`: the forward pass (default: the checkpoint's `ModelRunner`). `pdserve simulate`
        passes one with no model (simulate/runner.py): it has no tokenizer (prompts are token ids,
        outputs carry no text) and no EOS (requests end at max_tokens)."""
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        self.runner = runner or ModelRunner(config)
        hf = self.runner.hf_config
        self.vocab_size = hf.vocab_size
        self.max_model_len = config.max_model_len or hf.max_position_embeddings
        if runner is None:
            self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
            self.eos_token_ids = _eos_ids(config.model_path, hf, self.tokenizer)
        else:
            self.tokenizer, self.eos_token_ids = None, frozenset()
        self.validator = RequestValidator(self.tokenizer, self.vocab_size, self.max_model_len)
        self._new_ledger(self.runner.num_blocks)
        self.requests: dict[str, Request] = {}
        self.reserved: dict[str, list[int]] = {}
        self.pinned: Counter[int] = Counter()  # references held by KV sends reading the blocks
        self._arrivals = itertools.count()
        self._generator = torch.Generator().manual_seed(config.seed)
        self._ready: list[RequestOutput] = []  # final outputs of requests that ended at admission
        self.stats = StepStats()
        self.telemetry = StepLog()  # per-step records for `pdserve bench`'s bottleneck report
        self._preemptions_logged = 0
        self.last_step: StepShape = ()  # what the last step computed, for pacing (worker_runtime/pacing.py)
        # an emulated device's pacing: runs in each step after sampling, before the step is recorded
        self.pace: Callable[[], None] | None = None
        # runs before each forward with its items; raising fails that forward (fault injection)
        self.before_forward: Callable[[list[ScheduledItem]], None] | None = None

    # ---- admission -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    sampling: SamplingParams | None = None, prefill_only: bool = False,
                    output_token_ids: list[int] | None = None, emitted_chars: int = 0,
                    arrived_at: float | None = None) -> Request:
        """Validate (raises InvalidRequest) and queue a request. `arrived_at` (time.monotonic, as protocol.clock reads it on an engine thread): when
        its worker received it, so its TTFT split counts waiting for the engine thread as queueing.

        A resumed request brings the `output_token_ids` it already produced elsewhere, the text of
        whose first `emitted_chars` characters reached the client: prompt + outputs are computed as
        after a preemption and it continues at output index len(output_token_ids). If the outputs
        already end it (a stop), it is not queued and its final output comes with the next step.
        """
        sampling = sampling or SamplingParams()
        self._check_free_id(request_id)
        ids = self.validator.prompt_ids(prompt, prompt_token_ids)
        outputs = output_token_ids or []
        held = len(ids) + len(outputs) + 1 if prefill_only else None  # a prefill keeps no more than that
        self.validator.check(len(ids), sampling, self.allocator.num_blocks, self.config.block_size, held)
        if outputs:
            self.validator.check_resumed(outputs, sampling)
        req = self._build(request_id, ids, sampling, prefill_only)
        if outputs:  # its first token here follows a move from another worker
            req.timing.next_kind = TokenKind.MIGRATED
        if arrived_at is not None:
            req.timing.added_at = arrived_at
        reason = self._replay(req, outputs, emitted_chars)
        if reason is not None:
            self._finish_at_admission(req, reason)
            return req
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _check_free_id(self, request_id: str) -> None:
        validate_request_id(request_id)
        if request_id in self.requests or request_id in self.reserved:
            raise InvalidRequest(f"request id {request_id!r} is already in use")

    def _build(self, request_id: str, ids: list[int], sampling: SamplingParams, prefill_only: bool) -> Request:
        detokenizer = NoText() if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, ids, sampling.stop)
        return Request(request_id, ids, sampling, detokenizer,
                       eos_token_ids=self.eos_token_ids, prefill_only=prefill_only, arrival=next(self._arrivals))

    def _replay(self, req: Request, output_token_ids: list[int], emitted_chars: int) -> FinishReason | None:
        """Re-append outputs made elsewhere, so the detokenizer sees them as if made here; the
        finish reason they already cause, if any (later outputs are then dropped)."""
        reason = None
        for token in output_token_ids:
            reason = self._append_token(req, token)
            if reason is not None:
                break
        req.detokenizer.mark_emitted(emitted_chars)
        return reason

    def _finish_at_admission(self, req: Request, reason: FinishReason) -> None:
        self._finish(req, reason)
        self._ready.append(self._output(req, [], req.detokenizer.take_delta(final=True), reason))

    def _register(self, req: Request, start: int, end: int) -> None:
        """Cache the blocks whose last slot lies in [start, end): their KV was just written."""
        bs = self.config.block_size
        first, last = start // bs, end // bs
        if last > first and self.allocator.enable_caching:
            hashes = req.hashes(bs, end)
            for i in range(first, last):
                self.allocator.cache(req.block_ids[i], hashes[i])

    # ---- the step ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._ready)

    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled batch. A failure while sampling or detokenizing one
        request fails only that request. A failed forward is run again in halves to find the
        request that breaks it (engine/isolation.py), which fails alone; when that cannot be told
        (no forward succeeded), the forward's error is raised."""
        t0 = clock.now()
        self.last_step = ()
        items = self.scheduler.schedule()
        outputs = self._run_isolating(items, t0) if items else []
        ready, self._ready = self._ready, []
        return ready + outputs

    def _run_isolating(self, items: list[ScheduledItem], t0: float) -> list[RequestOutput]:
        try:
            return self._run(items, t0)
        except ForwardFailed as failed:
            log.warning("a forward of %d requests failed (%s); running them again in halves",
                        len(items), _describe(failed.cause))
            found = isolate(items, lambda part: self._run(part, clock.now()))
            if found.gave_up:
                raise failed.cause from None
            for it, error in found.culprits:
                log.error("request %r breaks the forward pass: %s", it.request.request_id, _describe(error))
            return found.outputs + [self._fail(it.request, _breaks_forward(error)) for it, error in found.culprits]

    def _forward(self, items: list[ScheduledItem], greedy: bool) -> torch.Tensor:
        """The runner's forward; its failure raises ForwardFailed (nothing of the step counted yet),
        except a RequestFault, which names its culprit already."""
        try:
            if self.before_forward is not None:
                self.before_forward(items)
            return self.runner.execute(items, greedy=greedy)
        except RequestFault:
            raise
        except Exception as e:
            raise ForwardFailed(e) from e

    def _run(self, items: list[ScheduledItem], t0: float) -> list[RequestOutput]:
        self.last_step = tuple(StepItem(it.num_tokens, it.end) for it in items)
        step_kind = _step_kind(items)
        t1 = clock.now()
        sampling = [it.request for it in items if it.samples]
        out = self._forward(items, greedy=all(req.sampling.greedy for req in sampling))
        t2 = clock.now()
        for it in items:
            self._register(it.request, it.start, it.end)
            it.request.num_computed_tokens += it.num_tokens
        if out.dim() == 1:  # every row greedy, and the runner found the tokens without the logits
            tokens: list[int | Exception] = out.tolist()
        else:
            tokens = sample_isolated(out, sampling, self._generator, self.runner.argmax)
        outputs = [self._emit(req, tok) for req, tok in zip(sampling, tokens, strict=True)]
        if self.pace is not None:
            self.pace()  # sleeps out the emulated step: recorded below as the step's time
        self._record(items, t0, t1, t2, clock.now())
        for req, out in zip(sampling, outputs, strict=True):
            if out.token_ids:  # after _record: a first token's prefill compute includes this step
                out.step_kind = req.timing.take_kind(step_kind)
                if out.step_kind == TokenKind.FIRST:
                    out.prefill_timing = req.timing.first_token()
        return outputs

    def _record(self, items: list[ScheduledItem], t0: float, t1: float, t2: float, t3: float) -> None:
        s = self.stats
        s.steps += 1
        s.step_s += t3 - t0
        s.forward_s += t2 - t1
        if all(it.is_decode for it in items):
            s.decode_steps += 1
            s.decode_step_s += t3 - t0
            s.decode_forward_s += t2 - t1
        chunks = [it for it in items if not it.is_decode]
        for it in chunks:
            it.request.timing.compute_s += t3 - t0
        preempted = self.scheduler.num_preemptions - self._preemptions_logged
        self._preemptions_logged = self.scheduler.num_preemptions
        totals = StepTotals.of(self.last_step)
        self.telemetry.append(wall_s=t3 - t0, decode_rows=len(items) - len(chunks), prefill_rows=len(chunks),
                              prefill_tokens=sum(it.num_tokens for it in chunks),
                              blocks_used=self.allocator.num_used, blocks_free=self.allocator.num_free,
                              preemptions=preempted, waiting=self.num_waiting,
                              context_tokens=totals.context_tokens, attended_pairs=totals.attended_pairs)

    def _emit(self, req: Request, token: int | Exception) -> RequestOutput:
        if isinstance(token, Exception):
            return self._fail(req, f"sampling failed: {_describe(token)}")
        try:
            return self._emit_token(req, token)
        except Exception as e:
            log.exception("detokenizing failed for request %r", req.request_id)
            return self._fail(req, f"detokenizing failed: {_describe(e)}")

    def _emit_token(self, req: Request, token: int) -> RequestOutput:
        reason = self._append_token(req, token)
        if reason is None and req.prefill_only:
            reason = FinishReason.PREFILLED
        # a prefilled request goes on elsewhere: hold back a partial stop string as if unfinished
        text = req.detokenizer.take_delta(final=reason not in (None, FinishReason.PREFILLED))
        if reason is not None:
            self._finish(req, reason)
        return self._output(req, [token], text, reason)

    def _output(self, req: Request, token_ids: list[int], text: str, reason: FinishReason | None) -> RequestOutput:
        return RequestOutput(req.request_id, token_ids, text, reason, req.num_prompt_tokens,
                             len(req.output_token_ids), num_cached_tokens=req.num_cached_tokens)

    def _append_token(self, req: Request, token: int) -> FinishReason | None:
        """Record one output token; the finish reason (STOP or LENGTH) it causes, if any."""
        req.output_token_ids.append(token)
        hit_stop_string = req.detokenizer.add_token(token)
        p = req.sampling
        if hit_stop_string or token in p.stop_token_ids or (token in req.eos_token_ids and not p.ignore_eos):
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        keep = reason is FinishReason.PREFILLED
        self.scheduler.finish(req, keep_blocks=keep)
        if not keep:
            self.requests.pop(req.request_id, None)

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """End `req` with finish reason ERROR (its blocks freed); `error` is the output's text."""
        self._finish(req, FinishReason.ERROR)
        return self._output(req, [], error, FinishReason.ERROR)

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
        self._finish(req, FinishReason.ABORT)
        return self._output(req, [], "", FinishReason.ABORT)

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """End every waiting or running request with finish reason ERROR, freeing its blocks."""
        failed = list(self.scheduler.running) + list(self.scheduler.waiting)
        return [self._fail(req, reason) for req in failed]

    # ---- introspection -------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def prefix_stats(self) -> PrefixStats:
        return self.scheduler.prefix_stats

    def check(self) -> None:
        """Block accounting holds: the allocator's integrity, and each block's refcount is the
        number of its holders (requests' block tables, reservations and pins)."""
        self.allocator.check()
        holders = Counter(b for r in self.requests.values() for b in r.block_ids)
        holders.update(b for ids in self.reserved.values() for b in ids)
        holders.update(self.pinned)
        for b in range(self.allocator.num_blocks):
            refs = self.allocator.refcount(b)
            assert refs == holders[b], f"block {b} has refcount {refs} but {holders[b]} holders"

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


class RequestFault(RuntimeError):
    """A step failed because of one request (`request_id`), which no other worker would serve
    either; the step's other requests are not to blame."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


def _step_kind(items: list[ScheduledItem]) -> str:
    """What the gap before a token this step samples was made of: decodes only; or a preempted
    request's context recomputed (KV memory ran out: a preemption's cost, not scheduling's); or
    other requests' prefill chunks (interference). Decided before the step's counters move."""
    chunks = [it for it in items if not it.is_decode]
    if not chunks:
        return TokenKind.DECODE
    if any(it.request.num_preemptions > 0 for it in chunks):
        return TokenKind.RECOMPUTE
    return TokenKind.INTERFERENCE


def _breaks_forward(error: Exception) -> str:
    return (f"the model's forward pass fails on this request (it failed alone; the requests batched "
            f"with it ran): {_describe(error)}")


def _describe(error: Exception) -> str:
    """A short, one-line description of `error` for the client."""
    first_line = next(iter(str(error).splitlines()), "")
    return f"{type(error).__name__}: {first_line}"[:200]


def _eos_ids(model_path: str, hf_config, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the model config's and the generation config's EOS ids (a
    chat checkpoint's end-of-turn token may be listed only in the latter), else the tokenizer's."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    try:
        sources.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    for eos in sources:
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
