"""Per-step scheduling under a token budget (Sarathi-style chunked prefill).

Running requests go first (each decode costs one token; a request still prefilling gets its
next chunk), then waiting requests are admitted FIFO while budget, sequence slots and KV
blocks last. A running request that cannot get a block preempts the most recently admitted
one, which frees its blocks and is recomputed later. The returned items list decodes
first (by context length), then prefill chunks.
"""

from __future__ import annotations

from collections import deque

from engine.config import EngineConfig
from engine.kv_cache import BlockAllocator
from engine.model_runner import ScheduledItem
from engine.request import Request, Status


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.block_size = config.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit_running(self, request: Request) -> None:
        """A request whose KV is already in its blocks (it arrived from a prefill worker)."""
        request.status = Status.RUNNING
        self.running.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledItem]:
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledItem] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(req, budget)
            if self._grow(req, n, items):
                items.append(ScheduledItem(req, n))
                budget -= n
        budget = self._admit_waiting(budget, items)
        return sorted(items, key=lambda it: (not it.is_decode, it.end if it.is_decode else 0))

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_uncomputed_tokens, budget)
        if req.is_prefilling and self.config.chunk_size is not None:
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
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _admit_waiting(self, budget: int, items: list[ScheduledItem]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = self._chunk(req, budget)
            ids = self.allocator.allocate(self._blocks_needed(req, n), req.request_id)
            if ids is None:
                break  # head-of-line waits for blocks; FIFO keeps arrival order fair
            self.waiting.popleft()
            req.block_ids.extend(ids)
            req.status = Status.RUNNING
            self.running.append(req)
            items.append(ScheduledItem(req, n))
            budget -= n
        return budget

    def finish(self, req: Request, keep_blocks: bool = False) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        if not keep_blocks:
            self.allocator.free(req.block_ids)
            req.block_ids = []
