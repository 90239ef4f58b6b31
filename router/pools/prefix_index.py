"""The router's map of which worker of a pool holds which KV blocks, for cache-aware placement.

Keys are the engine's block hashes (protocol/block_hash.py), so the router hashes a prompt the
way the workers do. Two sources keep it current:
- confirmed entries come from the workers' own events (`CacheDelta`, batched on each stats
  poll, every 0.5 s): a block stored in the worker's prefix cache, or evicted from it. Each
  batch carries a sequence number; a gap (a lost stats reply) asks the worker for a full
  snapshot on the next poll, so the map never drifts for long.
- predicted entries are added the moment the router places a request on a worker (the worker
  will hold those blocks once it has computed or received them). Without them a burst of
  requests sharing a new prefix would scatter over the pool before the first event returns.
  A prediction no event confirms within `predict_ttl_s` (the request failed, or the blocks
  were evicted at once) expires.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from protocol import clock
from protocol.messages import CacheDelta

PREDICT_TTL_S = 30.0
CONFIRMED = math.inf


class PrefixIndex:
    def __init__(self, predict_ttl_s: float = PREDICT_TTL_S):
        self.predict_ttl_s = predict_ttl_s
        self._holders: dict[bytes, dict[str, float]] = {}  # hash -> worker -> valid until
        self._held: dict[str, set[bytes]] = {}  # worker -> hashes (to drop a worker at once)
        self._seq: dict[str, int] = {}  # worker -> last delta applied
        # unconfirmed predictions, oldest first (one TTL: insertion order is expiry order), so
        # pruning touches only the expired ones, never the whole index
        self._pending: OrderedDict[tuple[str, bytes], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def blocks_of(self, worker: str) -> int:
        return len(self._held.get(worker, ()))

    def apply(self, worker: str, delta: CacheDelta) -> bool:
        """Apply one batch of a worker's events; False when a batch was lost (ask for a snapshot)."""
        last = self._seq.get(worker)
        if delta.snapshot:
            self._replace(worker, delta.stored)
        elif last is not None and delta.seq != last + 1:
            return False
        else:
            for h in delta.stored:
                self._add(worker, h, CONFIRMED)
            for h in delta.removed:
                self._remove(worker, h)
        self._seq[worker] = delta.seq
        return True

    def predict(self, worker: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        """`worker` is about to hold these blocks (a request was just placed there)."""
        until = (clock.now() if now is None else now) + self.predict_ttl_s
        for h in hashes:
            if self._holders.get(h, {}).get(worker, 0.0) < until:
                self._add(worker, h, until)
                self._pending[(worker, h)] = until
                self._pending.move_to_end((worker, h))

    def match(self, hashes: Sequence[bytes], workers: Sequence[str], now: float | None = None) -> dict[str, int]:
        """For each of `workers`, how many leading blocks of `hashes` it holds."""
        now = clock.now() if now is None else now
        matched = dict.fromkeys(workers, 0)
        alive = set(workers)
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            alive = {w for w in alive if holders is not None and holders.get(w, 0.0) > now}
            if not alive:
                break
            for w in alive:
                matched[w] = i + 1
        return matched

    def prune(self, now: float | None = None) -> None:
        """Drop predictions that expired unconfirmed (called with each stats round)."""
        now = clock.now() if now is None else now
        while self._pending:
            (worker, h), until = next(iter(self._pending.items()))
            if until > now:
                return
            del self._pending[(worker, h)]
            self._remove(worker, h)

    def forget(self, worker: str) -> None:
        """The worker left the pool: nothing it held is reachable any more."""
        for h in self._held.pop(worker, set()):
            self._drop_holder(h, worker)
            self._pending.pop((worker, h), None)
        self._seq.pop(worker, None)

    def _replace(self, worker: str, hashes: Sequence[bytes]) -> None:
        keep = set(hashes)
        for h in list(self._held.get(worker, ())):
            if h not in keep and self._holders[h][worker] == CONFIRMED:
                self._remove(worker, h)
        for h in keep:
            self._add(worker, h, CONFIRMED)

    def _add(self, worker: str, h: bytes, until: float) -> None:
        self._holders.setdefault(h, {})[worker] = until
        self._held.setdefault(worker, set()).add(h)
        if until == CONFIRMED:
            self._pending.pop((worker, h), None)

    def _remove(self, worker: str, h: bytes) -> None:
        self._pending.pop((worker, h), None)
        held = self._held.get(worker)
        if held is not None:
            held.discard(h)
        self._drop_holder(h, worker)

    def _drop_holder(self, h: bytes, worker: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.pop(worker, None)
            if not holders:
                del self._holders[h]
