"""Per-step scheduling under a token budget (Sarathi-style chunked prefill).

Running requests go first (each decode costs one token; a request still prefilling gets its
next chunk), then waiting requests are admitted FIFO while budget, sequence slots and KV
blocks last, and, where `max_num_partial_prefills` is set, while fewer than that many prompts
would be left part-way through their prefill (a prompt that completes its prefill in the step
always may start): with a limit of 1, prompts are prefilled one after another, so the first to
arrive gets its first token after its own prompt rather than after every waiting prompt's chunks
(docs/engine_speed.md, "The step's token budget": off by default, measured both ways).

A running request that cannot get a block preempts the most recently admitted one, which frees
its blocks and is recomputed later. The returned items list decodes first (by context length),
then prefill chunks.

Prefix caching: a request admitted with nothing computed first takes the cached blocks of its
leading full blocks (at most all but its last token's, so the step always computes and samples
at least one token, and writes only into fresh blocks) and starts computing after them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.kv_cache import BlockAllocator
from engine.request import Request, ScheduledItem, Status
from engine.telemetry import KVWaitClock


@dataclass
class PrefixStats:
    """Cumulative prefix cache lookups: tokens looked up and tokens whose KV was found."""

    query_tokens: int = 0
    hit_tokens: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.block_size = config.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._whole_prompts = False  # schedule's: prefill-only prompts go whole this step
        self._partial = 0  # schedule's: prompts this step leaves part-way through their prefill
        self.prefix_stats = PrefixStats()
        self.num_preemptions = 0  # since start (engine/telemetry.py: per step)
        self.kv_clock = KVWaitClock()  # how long admission stood still for want of KV blocks

    def add(self, request: Request) -> None:
        request.timing.waiting(self.kv_clock)
        self.waiting.append(request)

    def admit_running(self, request: Request) -> None:
        """A request whose KV is already in its blocks (it arrived from a prefill worker)."""
        request.status = Status.RUNNING
        self.running.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_owed(self) -> int:
        """Blocks its requests will take for the context they have now, beyond those they hold: a
        prompt allocates chunk by chunk, so `free` alone overstates the room a new request has.
        A waiting request (no blocks, nothing computed) owes its whole context, its cached prefix
        included (an upper bound)."""
        return sum(self._blocks_needed(r, r.num_uncomputed_tokens) for r in (*self.running, *self.waiting))

    def schedule(self) -> list[ScheduledItem]:
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledItem] = []
        # only prefill-only requests running (a disaggregated prefill worker's): no decode rows to
        # protect, so their prompts go whole (within the budget) instead of in chunk_size chunks,
        # unless `chunk_prefill_workers` asks for chunks there too
        self._whole_prompts = not self.config.chunk_prefill_workers and all(r.prefill_only for r in self.running)
        self._partial = 0
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(req, req.num_uncomputed_tokens, budget)
            if self._grow(req, n, items):
                items.append(ScheduledItem(req, n))
                budget -= n
                self._partial += n < req.num_uncomputed_tokens
        budget = self._admit_waiting(budget, items)
        return sorted(items, key=lambda it: (not it.is_decode, it.end if it.is_decode else 0))

    def _chunk(self, req: Request, uncomputed: int, budget: int) -> int:
        n = min(uncomputed, budget)
        whole = req.prefill_only and self._whole_prompts  # docs/engine_speed.md, "Whole prompts on prefill workers"
        if uncomputed > 1 and self.config.chunk_size is not None and not whole:  # still prefilling
            n = min(n, self.config.chunk_size)
        return n

    def _blocks_needed(self, req: Request, n: int) -> int:
        total = -(-(req.num_computed_tokens + n) // self.block_size)
        return max(total - len(req.block_ids), 0)

    def _grow(self, req: Request, n: int, items: list[ScheduledItem]) -> bool:
        """Give `req` blocks for `n` more tokens, preempting later requests; False if it was preempted."""
        need = self._blocks_needed(req, n)
        while True:
            ids = self.allocator.allocate(need, req.request_id)
            if ids is not None:
                req.block_ids.extend(ids)
                return True
            victim = self.running[-1]
            self._preempt(victim, items)
            if victim is req:
                return False

    def _preempt(self, req: Request, items: list[ScheduledItem]) -> None:
        self.running.remove(req)
        items[:] = [it for it in items if it.request is not req]
        self.allocator.free(req.block_ids[::-1])
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.timing.preempted(self.kv_clock)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _admit_waiting(self, budget: int, items: list[ScheduledItem]) -> int:
        blocked = False
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = self._take_blocks(req, budget)
            if n is None:
                blocked = True
                break  # head-of-line waits for blocks; FIFO keeps arrival order fair
            if n == 0:
                break  # it would be left part-way and enough prompts are: it waits for one to finish
            self.waiting.popleft()
            req.timing.admitted(self.kv_clock)
            req.status = Status.RUNNING
            self.running.append(req)
            items.append(ScheduledItem(req, n))
            budget -= n
        self.kv_clock.set_blocked(blocked)
        return budget

    def _take_blocks(self, req: Request, budget: int) -> int | None:
        """Give a waiting request its cached prefix and blocks for its next chunk, all or nothing;
        the chunk's size, None if the blocks don't fit, or 0 (nothing taken) where the chunk would
        leave it part-way through its prefill beside `max_num_partial_prefills` others."""
        assert not req.block_ids and req.num_computed_tokens == 0, "a waiting request holds no KV"
        hits = self._cached_prefix(req)
        start = len(hits) * self.block_size
        n = self._chunk(req, req.num_tokens - start, budget)
        partial = n < req.num_tokens - start
        limit = self.config.max_num_partial_prefills
        if partial and limit is not None and self._partial >= limit:
            return 0
        need = -(-(start + n) // self.block_size) - len(hits)
        if not self.allocator.fits(need, hits):
            return None
        self.allocator.acquire(hits)
        ids = self.allocator.allocate(need, req.request_id)
        assert ids is not None, "blocks that fit were not allocated"
        req.block_ids, req.num_computed_tokens = hits + ids, start
        self._partial += partial
        if req.num_preemptions == 0:  # first admission: what the cache saved this request
            req.num_cached_tokens = start
            self.prefix_stats.query_tokens += req.num_tokens
            self.prefix_stats.hit_tokens += start
        return n

    def _cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks of the request's leading full blocks, all but its last token's: that
        one is always computed, so the step samples and writes only into a fresh block."""
        if not self.allocator.enable_caching:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        return self.allocator.match(req.hashes(self.block_size, limit * self.block_size)[:limit])

    def finish(self, req: Request, keep_blocks: bool = False) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        if not keep_blocks:
            self.allocator.free(req.block_ids[::-1])
            req.block_ids = []
