"""The engine's half of a KV hand-off between workers: blocks set aside for KV another worker will
push (`reserve` / `release`), blocks pinned while a send reads them (`pin` / `unpin`), and the
admission of a request whose KV arrived (`add_prefilled`). A mixin of `LLMEngine`, which owns the
allocator, the scheduler and the request table these methods use; split out to keep the step loop
readable. Ownership: a reservation's blocks belong to `reserved` until `add_prefilled` hands them
to the request or `release` frees them.
"""

from __future__ import annotations

from collections import Counter

from engine.kv_cache import BlockAllocator
from engine.request import Request, Status
from engine.scheduler import Scheduler
from protocol.block_hash import block_hashes, salt_root
from protocol.sampling import SamplingParams
from protocol.telemetry import TokenKind


class KVHandoff:
    """`reserve`, `release`, `pin`, `unpin`, `add_prefilled`: see the module docstring."""

    reserved: dict[str, list[int]]
    pinned: Counter

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def reserve(self, request_id: str, num_tokens: int, token_ids: list[int] | None = None,
                cache_salt: str = "") -> tuple[list[int], int] | None:
        """Set aside blocks for `num_tokens` of pushed KV: (all the block ids, how many leading ones
        already hold cached KV), or None if they don't fit. Refuses an id in use.

        `token_ids`: the tokens whose KV will be pushed. Cached blocks of their leading full blocks
        (all but the last token's), hashed under `cache_salt`, come first and the pushing side sends
        only the blocks after them.
        """
        self._check_free_id(request_id)
        total = self.blocks_for(num_tokens)
        hits = self._cached_blocks(token_ids, cache_salt)[:total] if token_ids else []
        if not self.allocator.fits(total - len(hits), hits):
            return None
        self.allocator.acquire(hits)
        ids = self.allocator.allocate(total - len(hits), request_id)
        assert ids is not None, "blocks that fit were not allocated"
        self.reserved[request_id] = hits + ids
        if token_ids:
            self.prefix_stats.query_tokens += len(token_ids)
            self.prefix_stats.hit_tokens += len(hits) * self.config.block_size
        return hits + ids, len(hits)

    def _cached_blocks(self, token_ids: list[int], cache_salt: str) -> list[int]:
        if not self.allocator.enable_caching:
            return []
        bs = self.config.block_size
        return self.allocator.match(block_hashes(token_ids[:(len(token_ids) - 1) // bs * bs], bs,
                                                 salt_root(cache_salt)))

    def reset_cache(self) -> None:
        """A fresh ledger over the same KV pool (a worker taking another role, worker_host/): every
        block free, nothing cached, the prefix counters at zero. Only an idle engine has one."""
        if self.requests or self.reserved or +self.pinned:
            raise RuntimeError(f"reset_cache with {len(self.requests)} requests, {len(self.reserved)} "
                               f"reservations and {sum(self.pinned.values())} pins held: drain first")
        self._new_ledger(self.allocator.num_blocks)

    def _new_ledger(self, num_blocks: int) -> None:
        """Every block of the pool free and uncached, with a scheduler over them."""
        self.allocator = BlockAllocator(num_blocks, enable_caching=self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.allocator)

    def release(self, request_id: str) -> None:
        """Free a reservation, or the blocks a finished prefill-only request kept."""
        ids = self.reserved.pop(request_id, None)
        if ids is None:
            req = self.requests.get(request_id)
            if req is None or req.status is not Status.FINISHED:
                return  # nothing held outside the scheduler (a running request frees via abort)
            del self.requests[request_id]
            ids, req.block_ids = req.block_ids, []
        self.allocator.free(ids[::-1])

    def pin(self, block_ids: list[int]) -> None:
        """One more reference to each block while a KV send reads it: a preemption, abort or
        finish of its request then cannot hand the block to anyone else until `unpin`."""
        self.allocator.acquire(block_ids)
        self.pinned.update(block_ids)

    def unpin(self, block_ids: list[int]) -> None:
        self.pinned.subtract(block_ids)
        self.pinned = +self.pinned  # drop zero counts
        self.allocator.free(block_ids[::-1])

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                      sampling: SamplingParams, emitted_chars: int = 0) -> Request:
        """Admit a request whose KV another worker pushed into its reserved blocks.

        The blocks hold the KV of prompt + output_token_ids[:-1]; the last output token is the next
        input. The first `emitted_chars` characters of the outputs' text were already streamed. If
        the outputs already finish the request (a stop, or max_tokens reached), its blocks are
        freed now and its final output comes with the next `step()`. On error the reservation stays.
        The full blocks the pushed KV covers join the prefix cache.
        """
        if not output_token_ids:
            raise ValueError("add_prefilled needs at least the first output token")
        blocks = self.reserved.get(request_id)
        if blocks is None:
            raise KeyError(f"no KV reservation for request {request_id!r}")
        num_computed = len(prompt_token_ids) + len(output_token_ids) - 1
        if len(blocks) < self.blocks_for(num_computed):
            raise ValueError(f"request {request_id!r} reserved {len(blocks)} blocks, too few for {num_computed} tokens")
        self.validator.check(len(prompt_token_ids), sampling)
        self.validator.check_token_ids("output_token_ids", output_token_ids)
        num_cached = self._cached_reserved_blocks(request_id, list(prompt_token_ids) + list(output_token_ids),
                                                  sampling.cache_salt)
        request = self._build(request_id, list(prompt_token_ids), sampling, prefill_only=False)
        request.num_cached_tokens = num_cached * self.config.block_size
        request.timing.next_kind = TokenKind.KV_HANDOFF
        reason = self._replay(request, output_token_ids, emitted_chars)
        request.block_ids = self.reserved.pop(request_id)
        self._register(request, 0, min(num_computed, request.num_tokens))  # a stop may have cut the outputs
        if reason is not None:
            self._finish_at_admission(request, reason)
            return request
        request.num_computed_tokens = num_computed
        self.requests[request_id] = request
        self.scheduler.admit_running(request)
        return request

    def _cached_reserved_blocks(self, request_id: str, token_ids: list[int], cache_salt: str) -> int:
        """How many reserved blocks came from the cache (until the KV lands, no other reserved
        block has a hash). They must hold these tokens' KV: reserve's token_ids must have been a
        prefix of them."""
        cached = [h for h in map(self.allocator.hash_of, self.reserved[request_id]) if h is not None]
        bs = self.config.block_size
        if cached != block_hashes(token_ids[:len(cached) * bs], bs, salt_root(cache_salt)):
            raise ValueError(f"request {request_id!r}: its reserved cached blocks hold other tokens' KV")
        return len(cached)
