"""Placement: which prefill worker computes a request, which decode workers may hold it.

The router's view of each worker is a `WorkerView`; `Placer` chooses per pool by the pool's
policy (`router.policy`, or `router.prefill_policy` / `router.decode_policy`):

- `load`: prefill = fewest requests in flight; decode = most free KV blocks, then fewest running.
- `round_robin`: in turn, skipping workers that cannot take the request.
- `cache_aware`: uses the `PrefixIndex` of each pool (which worker holds which block hashes).
  Prefill: the worker where this prefill would finish first, estimated in tokens: the tokens
  the router has queued there and not yet seen finish, plus this prompt's tokens that worker
  does NOT hold. A long cached prefix wins unless that worker is far behind; on an idle pool
  the longest prefix wins; with no prefix anywhere it is least-loaded (in tokens, not
  requests). No tuning weight: both terms are work in the same unit.
  Decode: among workers that fit, the most leading blocks already held (they cross no wire and
  take no new memory), unless the load spread (running + in flight) is wide, when the least
  loaded go first: decode steps slow with batch size, and a worker that hoards every
  conversation would set everyone's inter-token latency.
  Colocated (`pick_colocated`, over the decode order): the worker where this prompt's prefill
  would finish first, in tokens, as for prefill; ties keep the decode order. A colocated worker's
  prefill chunks share its decode steps, so counting requests alone let a few long uncached
  prompts land on one worker and stretch every decode it held.

Draining workers take nothing new; a worker whose last call timed out is skipped for a while.
Nor does a worker whose whole KV pool is too small for the request (workers may differ in size):
a prefill worker must hold the context and its next token, a decode worker prompt + max_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.messages import WorkerStats
from router.config.schema import POLICIES
from router.pools.prefix_index import PrefixIndex
from router.pools.worker_view import WorkerView

# decode: a load spread above max(BALANCE_ABS, BALANCE_REL * least load) puts balance before reuse
BALANCE_ABS = 4
BALANCE_REL = 0.5


def uncached_tokens(num_tokens: int, held_blocks: int, block_size: int) -> int:
    """What a worker holding `held_blocks` leading blocks computes: the engine reuses at most
    (num_tokens - 1) // block_size of them, as it always computes the last token itself."""
    return num_tokens - min(held_blocks, (num_tokens - 1) // block_size) * block_size


def finish_tokens(w: WorkerView, hits: dict[str, int], num_tokens: int) -> int:
    """When a prefill of `num_tokens` placed on `w` would finish, in tokens: those `w` has queued (the
    router's uncached tokens in flight there) plus those of this context it does not hold (`hits`:
    blocks held per worker). `cache_aware`'s one rule for prefill and colocated placement."""
    return sum(w.prefill_tokens.values()) + uncached_tokens(num_tokens, hits[w.name], w.info.block_size)


class Placer:
    def __init__(self, policies: dict[str, str]):
        unknown = {p for p in policies.values() if p not in POLICIES}
        assert not unknown, f"unknown placement policies {unknown}"
        self.policies = policies
        self.index = {pool: PrefixIndex() for pool in ("prefill", "decode")}
        self._turn = dict.fromkeys(("prefill", "decode"), 0)

    # ---- the workers' cache events ------------------------------------------------------
    def observe(self, w: WorkerView, stats: WorkerStats) -> None:
        """A stats reply: its prefix-cache changes go into the pool's index."""
        w.observe(stats)
        if stats.cache is not None:
            w.cache_resync = not self.index[w.info.pool].apply(w.name, stats.cache)

    def forget(self, w: WorkerView) -> None:
        self.index[w.info.pool].forget(w.name)

    def prune(self) -> None:
        for index in self.index.values():
            index.prune()

    def placed(self, w: WorkerView, hashes: Sequence[bytes]) -> None:
        """`w` will hold these blocks: let the next placement know before its events say so."""
        if self.policies[w.info.pool] == "cache_aware":
            self.index[w.info.pool].predict(w.name, hashes)

    def matched_blocks(self, pool: str, hashes: Sequence[bytes], workers: Sequence[WorkerView]) -> dict[str, int]:
        return self.index[pool].match(hashes, [w.name for w in workers])

    # ---- choices ---------------------------------------------------------------------------
    def pick_prefill(self, workers: list[WorkerView], hashes: Sequence[bytes], num_tokens: int,
                     limit: int | None = None) -> WorkerView | None:
        """`num_tokens`: the context to compute (the worker must hold it and the next token)."""
        ready = [w for w in workers if w.accepting and (limit is None or len(w.inflight) < limit)
                 and w.info.num_blocks * w.info.block_size > num_tokens]
        if not ready:
            return None
        policy = self.policies["prefill"]
        if policy == "round_robin":
            return self._rotate("prefill", ready)[0]
        if policy == "load":
            return min(ready, key=lambda w: (len(w.inflight), w.name))
        hits = self.matched_blocks("prefill", hashes, ready)
        return min(ready, key=lambda w: (finish_tokens(w, hits, num_tokens), len(w.inflight), w.name))

    def prefill_work(self, w: WorkerView, hashes: Sequence[bytes], num_tokens: int) -> int:
        """Tokens `w` must compute for this context: those after the prefix it holds."""
        held = self.matched_blocks("prefill", hashes, [w])[w.name]
        return uncached_tokens(num_tokens, held, w.info.block_size)

    def pick_colocated(self, ranked: list[WorkerView], hashes: Sequence[bytes], num_tokens: int) -> tuple[WorkerView, int]:
        """`ranked`: `decode_candidates`' order. The worker to run the request whole, and the tokens of
        `num_tokens` it must compute (its queued prefill until the first token: `WorkerView.hold`)."""
        hits = self.matched_blocks("decode", hashes, ranked)
        best = ranked[0]
        if self.policies["decode"] == "cache_aware":
            best = min(ranked, key=lambda w: finish_tokens(w, hits, num_tokens))  # min: the first of ties
        return best, uncached_tokens(num_tokens, hits[best.name], best.info.block_size)

    def decode_candidates(self, workers: list[WorkerView], hashes: Sequence[bytes] = (), blocks_needed: int = 0,
                          limit: int | None = None, final_tokens: int = 0) -> list[WorkerView]:
        """Accepting decode workers that look able to hold `blocks_needed` now, and whose pool can hold
        `final_tokens` (prompt + max_tokens) at the end, best first."""
        policy = self.policies["decode"]
        live = [w for w in workers if w.accepting and (limit is None or len(w.inflight) < limit)
                and w.info.num_blocks * w.info.block_size >= final_tokens]
        hits = self.matched_blocks("decode", hashes, live) if policy == "cache_aware" and hashes else {}
        fits = [w for w in live if w.free_blocks + hits.get(w.name, 0) >= blocks_needed]
        if policy == "round_robin":
            return self._rotate("decode", fits)
        by_load = sorted(fits, key=lambda w: (-w.free_blocks, w.load, w.name))
        if policy == "load" or not fits:
            return by_load
        least = min(w.load for w in fits)
        if max(w.load for w in fits) - least > max(BALANCE_ABS, BALANCE_REL * least):
            return sorted(fits, key=lambda w: (w.load, -hits.get(w.name, 0), -w.free_blocks, w.name))
        return sorted(fits, key=lambda w: (-hits.get(w.name, 0), w.load, -w.free_blocks, w.name))

    def _rotate(self, pool: str, workers: list[WorkerView]) -> list[WorkerView]:
        if not workers:
            return []
        ordered = sorted(workers, key=lambda w: w.name)
        k = self._turn[pool] % len(ordered)
        self._turn[pool] += 1
        return ordered[k:] + ordered[:k]
