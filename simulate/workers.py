"""The pools' workers in the simulation: the real actor classes over a simulated core and link.

`SimPrefillWorker` and `SimDecodeWorker` are `PrefillWorker` and `DecodeWorker` with only their
construction changed: a `SimCore` (simulate/engine.py) instead of an engine thread, and
`SimLink` instead of torch.distributed channels. Every call the router makes (`prefill`, `aim`,
`reserve`, `start`, `generate`, `abort`, `poll`, `stats`, `beat`, ...) runs the serving code, the
hand-off table and the KV pusher included. A KV piece takes the link model's time for the
emulated model's bytes of its blocks, in order per (prefill, decode) pair; its blocks are held on
both sides meanwhile (pinned by the pusher, reserved by the hand-off), and it lands through the
decode worker's own `_resolve_blocks` / `_on_landed`, as the receiver calls them. A start takes
the emulated weights load.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decode_worker.handoff import HandoffTable
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from kv_transfer import KVTransferConfig
from prefill_worker.push import KVPusher
from prefill_worker.worker import PrefillWorker
from protocol import clock
from protocol.messages import WorkerInfo
from simulate.engine import SimCore, SimRunner
from sizing.cost_model import Emulation
from worker_host.host import WorkerHost
from worker_runtime.faults import FaultConfig, Faults
from worker_runtime.outbox import Outbox
from worker_runtime.tombstones import Tombstones


class SimLink:
    """Every prefill -> decode wire of the cluster; `workers`: name -> live simulated decode worker.
    Each pair's wire carries one piece at a time, in the order they were sent. `handoff`: a
    request's extra delay on its first piece (a real host's hand-off spread, simulate/serving.py)."""

    def __init__(self, emulation: Emulation, block_size: int, handoff: Callable[[str], float] | None = None):
        self.bytes_per_block = block_size * emulation.cost.kv_bytes_per_token
        self.model = emulation.link
        self.workers: dict[str, SimDecodeWorker] = {}
        self._queues: dict[tuple[str, str], deque[_Piece]] = {}
        self.pieces = 0
        self.busy_s = 0.0
        self.handoff = handoff
        self._begun: set[str] = set()  # requests whose first piece has gone (their hand-off spread paid)

    def send(self, sender: str, peer: str, request_id: str, block_ids: list[int], first_block: int) -> asyncio.Future:
        """A piece on the pair's wire after the pieces before it; the future ends when it landed
        (an error if it could not: the decode worker is gone or holds no reservation for it)."""
        fut = asyncio.get_running_loop().create_future()
        queue = self._queues.setdefault((sender, peer), deque())
        queue.append(_Piece(peer, request_id, block_ids, first_block, fut))
        if len(queue) == 1:
            self._begin(queue)
        return fut

    def _begin(self, queue: deque[_Piece]) -> None:
        """The head piece starts: the receiver resolves its blocks now (as at a header), it lands
        after the link model's time for its bytes."""
        piece = queue[0]
        decode = self.workers.get(piece.peer)
        dst = decode._resolve_blocks(piece.request_id, len(piece.block_ids), piece.first_block) if decode else None
        took = self.model.transfer_s(len(piece.block_ids) * self.bytes_per_block)
        self.pieces += 1
        self.busy_s += took
        if self.handoff is not None and piece.request_id not in self._begun:  # the wire waits it out too
            self._begun.add(piece.request_id)
            took += self.handoff(piece.request_id)
        asyncio.get_running_loop().call_later(took, self._land, queue, decode, dst)

    def _land(self, queue: deque[_Piece], decode: SimDecodeWorker | None, dst: list[int] | None) -> None:
        piece = queue.popleft()
        if decode is None or dst is None:
            piece.fut.set_exception(LookupError(f"{piece.peer} is gone or holds no reservation for "
                                                f"{piece.request_id} (first block {piece.first_block})"))
        else:
            decode._on_landed(piece.request_id, dst, None)
            piece.fut.set_result(None)
        if queue:
            self._begin(queue)


@dataclass
class _Piece:
    peer: str
    request_id: str
    block_ids: list[int]
    first_block: int
    fut: asyncio.Future


class _Sender:
    """What the KV pusher sends through (`KVSender.send`'s signature) for one prefill worker."""

    def __init__(self, link: SimLink, name: str):
        self._link, self._name = link, name
        self.peers: set[str] = set()

    def send(self, peer_id: str, request_id: str, src_block_ids: list[int], first_block: int = 0) -> asyncio.Future:
        self.peers.add(peer_id)
        return self._link.send(self._name, peer_id, request_id, src_block_ids, first_block)

    @property
    def num_channels(self) -> int:
        return len(self.peers)


class SimPrefillWorker(PrefillWorker):
    def __init__(self, name: str, config: EngineConfig, emulation: Emulation, runner: SimRunner, link: SimLink,
                 stream_chunks: bool, timeout_s: float, core: SimCore | None = None):
        """`core`: the last role's (a role change, SimWorkerHost): no weights load at `ready`."""
        self.faults = Faults(None, name)
        self._startup_s = emulation.startup_s if core is None else 0.0  # a new process loads the weights
        if core is None:
            core = SimCore(name, "prefill", config, runner, emulation.cost, self._on_outputs, self._after_step)
        else:
            core.take_role(name, "prefill", self._on_outputs, None, self._after_step)
        self.core = core
        self.sender = _Sender(link, name)
        self.pusher = KVPusher(self.core.loop, self.sender, self.faults, stream_chunks,
                               on_failed=self._push_failed, on_ended=self._push_ended)
        self._timeout_s = timeout_s
        self._waiters = {}
        self._channel_locks = {}
        self._peers = {}
        self.outbox = Outbox()
        self._tasks = set()
        self._aborted = Tombstones(clock=clock.now)

    async def ready(self) -> WorkerInfo:
        await asyncio.sleep(self._startup_s)  # the emulated weights load
        return await super().ready()

    async def _ensure_channel(self, decode_name: str, decode_actor) -> None:
        """The simulated wire needs no channel: a piece finds its decode worker by name."""

    def _num_channels(self) -> int:
        return self.sender.num_channels

    async def close_channel(self, decode_name: str) -> None:
        self._peers.pop(decode_name, None)
        self.sender.peers.discard(decode_name)

    async def leave(self) -> None:
        self.sender.peers.clear()


class SimDecodeWorker(DecodeWorker):
    def __init__(self, name: str, config: EngineConfig, emulation: Emulation, runner: SimRunner,
                 link: SimLink | None, core: SimCore | None = None):
        """`core`: the last role's (a role change, SimWorkerHost): no weights load at `ready`."""
        self.faults = Faults(None, name)
        self._startup_s = emulation.startup_s if core is None else 0.0  # a new process loads the weights
        if core is None:
            core = SimCore(name, "decode", config, runner, emulation.cost, self._on_outputs)
        else:
            core.take_role(name, "decode", self._on_outputs)
        self.core = core
        self.outbox = Outbox()
        self.handoffs = HandoffTable()
        self._transfers = {}
        self._landing_since = {}
        self._block_bytes = runner.block_bytes
        self.receiver = None  # the wire is the link's (SimLink.send lands pieces through this worker)
        self._reaper = None
        self._link = link
        if link is not None:
            link.workers[name] = self

    async def ready(self) -> WorkerInfo:
        await asyncio.sleep(self._startup_s)
        return await super().ready()

    async def leave(self) -> None:
        if self._link is not None:
            self._link.workers.pop(self.core.name, None)
        await super().leave()


class SimWorkerHost(WorkerHost):
    """`WorkerHost` over simulated roles: a role change keeps the `SimCore` (no weights load)."""

    def __init__(self, pool: str, name: str, config: EngineConfig, emulation: Emulation, runner: SimRunner,
                 link: SimLink, transfer: KVTransferConfig | None):
        self._config, self._transfer, self._emulation = config, transfer, emulation
        self._runner, self._link = runner, link
        self.role = self._make_role(pool, name, None, None)

    def _make_role(self, pool: str, name: str, faults: FaultConfig | None, core: SimCore | None) -> Any:
        t = self._transfer
        if pool == "prefill":
            return SimPrefillWorker(name, self._config, self._emulation, self._runner, self._link, t.stream_chunks,
                                    t.timeout_s, core)
        return SimDecodeWorker(name, self._config, self._emulation, self._runner, self._link if t else None, core)
