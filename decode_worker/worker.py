"""The decode worker, a Ray async actor.

Protocol with the router (disaggregated): `reserve` blocks for a prompt -> a prefill worker
pushes the prompt's KV into them over `kv_transfer` -> `start` hands over the first token and
sampling; the request joins the running batch once both the KV has landed and `start` came.
Colocated: `generate` prefills and decodes here. Tokens leave through `poll`, which returns
every output since the last poll (one Ray call per step or more, never one per token).
Ownership: reserved blocks belong to the worker until admitted; an abort during a transfer
defers the free until the receiver is done writing into them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.messages import WorkerInfo, WorkerStats
from engine.request import RequestOutput, SamplingParams
from engine.worker_core import WorkerCore
from kv_transfer import KVReceiver, KVTransferConfig


@dataclass
class _Pending:
    """A disaggregated request between reservation and admission."""

    blocks: list[int]
    landing_since: float | None = None  # the receiver is writing into the blocks since then
    landed: bool = False
    cancelled: bool = False
    start: tuple[list[int], SamplingParams, int] | None = None  # prompt ids, sampling, first token


class DecodeWorker:
    def __init__(self, name: str, config: EngineConfig, transfer: KVTransferConfig | None, cpu: int | None = None):
        self.core = WorkerCore(name, "decode", config, self._on_outputs, cpu)
        self._outbox: list[RequestOutput] = []
        self._event: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._transfers: dict[str, tuple[float, int]] = {}  # request id -> (seconds, bytes) of its KV
        kv = self.core.engine.runner.kv
        self._block_bytes = kv[:, :, 0].numel() * kv.element_size()
        self.receiver = None
        if transfer is not None:
            self.receiver = KVReceiver(self.core.engine.runner.kv, self.core.node_ip, transfer,
                                       resolve_blocks=self._resolve_blocks, on_complete=self._on_landed)

    async def ready(self) -> WorkerInfo:
        self.core.bind()
        self._event = asyncio.Event()
        return self.core.info()

    # ---- outputs ------------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.core.served += 1
                out.kv_transfer_s, out.kv_transfer_bytes = self._transfers.pop(out.request_id, (0.0, 0))
        self._push(outputs)

    def _push(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            self._outbox.extend(outputs)
        if self.core.aio is not None and self._event is not None:
            self.core.aio.call_soon_threadsafe(self._event.set)

    async def poll(self, timeout_s: float = 1.0) -> list[RequestOutput]:
        """Every output since the last poll; waits up to `timeout_s` for at least one."""
        if not self._outbox:
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), timeout_s)
            except TimeoutError:
                return []
        with self._lock:
            out, self._outbox = self._outbox, []
        return out

    # ---- colocated ----------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        await self.core.run(lambda e: e.add_request(request_id, prompt_token_ids=prompt_token_ids, sampling=sampling))

    # ---- disaggregated --------------------------------------------------------------
    async def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        blocks = await self.core.run(lambda e: e.reserve(request_id, num_tokens))
        if blocks is not None:
            with self._lock:
                self._pending[request_id] = _Pending(blocks)
        return blocks

    async def open_channel(self, peer: str) -> tuple[str, int]:
        return await asyncio.to_thread(self.receiver.open_channel, peer)

    async def close_channel(self, peer: str) -> None:
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.close_channel, peer)

    def _resolve_blocks(self, request_id: str, num_blocks: int) -> list[int] | None:
        with self._lock:
            p = self._pending.get(request_id)
            if p is None or p.cancelled or num_blocks > len(p.blocks):
                return None
            p.landing_since = time.perf_counter()
            return p.blocks[:num_blocks]

    def _on_landed(self, request_id: str, dst_block_ids: list[int], error: BaseException | None) -> None:
        with self._lock:
            p = self._pending.get(request_id)
            if p is None:
                return
            if error is None:
                self._transfers[request_id] = (time.perf_counter() - p.landing_since,
                                               len(dst_block_ids) * self._block_bytes)
            p.landing_since = None
            p.landed = error is None
            drop = error is not None or p.cancelled
            admit = not drop and p.start is not None
        if drop:
            self._drop(request_id, None if p.cancelled else f"KV transfer failed: {error}")
        elif admit:
            self._admit(request_id)

    async def start(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    first_token: int) -> None:
        with self._lock:
            p = self._pending.get(request_id)
            if p is None:
                raise KeyError(f"no reservation for request {request_id!r} on {self.core.name}")
            p.start = (prompt_token_ids, sampling, first_token)
            admit = p.landed
        if admit:
            self._admit(request_id)

    def _admit(self, request_id: str) -> None:
        with self._lock:
            prompt, sampling, first = self._pending.pop(request_id).start
        fut = self.core.loop.call(lambda e: e.add_prefilled(request_id, prompt, sampling, first))
        fut.add_done_callback(lambda f: f.exception() and self._fail(request_id, f"cannot admit: {f.exception()}"))

    def _fail(self, request_id: str, error: str) -> None:
        self.core.loop.call(lambda e: e.release(request_id))
        self._push([RequestOutput(request_id, [], error, "error")])

    def _drop(self, request_id: str, error: str | None) -> None:
        with self._lock:
            self._pending.pop(request_id, None)
        if error is None:
            self.core.loop.call(lambda e: e.release(request_id))
        else:
            self._fail(request_id, error)

    # ---- both ---------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        self._transfers.pop(request_id, None)
        with self._lock:
            p = self._pending.get(request_id)
            if p is not None:
                p.cancelled = True
                if p.landing_since is not None:
                    return  # freed by _on_landed once the receiver stops writing
        if p is not None:
            self._drop(request_id, None)
            return
        await self.core.run(lambda e: e.abort(request_id))

    async def stats(self) -> WorkerStats:
        return await self.core.stats(self.receiver.num_channels if self.receiver else 0)

    async def check(self) -> dict:
        return await self.core.check()

    async def shutdown(self) -> None:
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.shutdown)
        self.core.stop()
