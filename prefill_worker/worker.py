"""The prefill worker, a Ray async actor.

`prefill(...)` queues a prompt as a `prefill_only` request; when its first token is sampled
the call returns it at once (that is the user's TTFT) while the KV blocks stream to the
decode worker on the channel for that pair, opened on first use. The blocks are freed when
the transfer ends, landed or failed; the decode side reports each transfer's time and size
with the request's last output.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future

from engine.config import EngineConfig
from engine.messages import PrefillResult, WorkerInfo, WorkerStats
from engine.request import RequestOutput, SamplingParams
from engine.worker_core import WorkerCore
from kv_transfer import KVSender, KVTransferConfig

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, name: str, config: EngineConfig, transfer: KVTransferConfig, cpu: int | None = None):
        self.core = WorkerCore(name, "prefill", config, self._on_outputs, cpu)
        self.sender = KVSender(self.core.engine.runner.kv, transfer)
        self._waiters: dict[str, asyncio.Future] = {}
        self._sending: set[str] = set()  # requests whose KV is on the wire (blocks must stay)
        self._channel_locks: dict[str, asyncio.Lock] = {}
        self._peers: dict[str, object] = {}  # decode worker name -> actor handle

    async def ready(self) -> WorkerInfo:
        self.core.bind()
        return self.core.info()

    async def prefill(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      decode_name: str, decode_actor=None) -> PrefillResult:
        """`decode_actor` comes with the first request for a decode worker and is kept."""
        if decode_actor is not None:
            self._peers[decode_name] = decode_actor
        await self._ensure_channel(decode_name, self._peers[decode_name])
        arrived = time.perf_counter()
        fut = self.core.aio.create_future()
        self._waiters[request_id] = fut
        try:
            await self.core.run(lambda e: e.add_request(request_id, prompt_token_ids=prompt_token_ids,
                                                        sampling=sampling, prefill_only=True))
            out: RequestOutput = await fut
        finally:
            self._waiters.pop(request_id, None)
        if out.finish_reason == "error":
            raise RuntimeError(f"prefill of {request_id} failed on {self.core.name}: {out.text}")
        if out.finish_reason == "prefilled":
            self._push_kv(request_id, decode_name)
        return PrefillResult(request_id, out.token_ids[0], out.text, out.finish_reason,
                             time.perf_counter() - arrived)

    async def _ensure_channel(self, decode_name: str, decode_actor) -> None:
        lock = self._channel_locks.setdefault(decode_name, asyncio.Lock())
        async with lock:
            if self.sender.is_connected(decode_name):
                return
            host, port = await decode_actor.open_channel.remote(self.core.name)
            await asyncio.to_thread(self.sender.connect, decode_name, host, port)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            waiter = self._waiters.get(out.request_id)
            if waiter is not None:
                self.core.aio.call_soon_threadsafe(_resolve, waiter, out)

    def _push_kv(self, request_id: str, decode_name: str) -> None:
        blocks = self.core.engine.requests[request_id].block_ids  # held until the transfer ends
        self._sending.add(request_id)
        fut = self.sender.send(decode_name, request_id, list(blocks))
        fut.add_done_callback(lambda f: self._transfer_done(request_id, f))

    def _transfer_done(self, request_id: str, fut: Future) -> None:
        self._sending.discard(request_id)
        self.core.loop.call(lambda e: e.release(request_id))
        self.core.served += 1
        if fut.exception() is not None:  # the decode side reports the failure to the router
            log.warning("KV transfer of %s failed: %s", request_id, fut.exception())

    async def abort(self, request_id: str) -> None:
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        if request_id not in self._sending:  # else the blocks are freed when the transfer ends
            await self.core.run(lambda e: e.abort(request_id))

    async def close_channel(self, decode_name: str) -> None:
        self._peers.pop(decode_name, None)
        await asyncio.to_thread(self.sender.close_channel, decode_name)

    async def stats(self) -> WorkerStats:
        return await self.core.stats(self.sender.num_channels)

    async def check(self) -> dict:
        return await self.core.check()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.sender.shutdown)
        self.core.stop()


def _resolve(fut: asyncio.Future, out: RequestOutput) -> None:
    if not fut.done():
        fut.set_result(out)
