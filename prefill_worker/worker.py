"""The prefill worker, a Ray async actor.

`prefill(task)` queues prompt + outputs-so-far as a `prefill_only` request; when its next
token is sampled the call returns it at once (that is the user's TTFT) while the KV blocks
go to the decode worker on the channel for that pair, opened on first use: chunk by chunk as
the prefill computes, the rest after the first token (prefill_worker/push.py). The blocks
are freed when the last piece's send ended, landed or failed. Every failure is reported twice: to
the decode worker (`transfer_failed`, which frees its reservation) and to the router (`poll`
returns `TransferFailed` events, so the request moves elsewhere without waiting for a lease).
"""

from __future__ import annotations

import asyncio
import logging

import ray

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kv_transfer import KVSender, KVTransferConfig
from prefill_worker.errors import PrefillFailed, PrefillStepFailed
from prefill_worker.push import KVPusher
from protocol import clock
from protocol.deadline import within
from protocol.messages import PrefillResult, PrefillTask, TransferFailed
from protocol.outputs import FinishReason, RequestOutput
from sizing.cost_model import Emulation
from worker_runtime.core import WorkerCalls, WorkerCore
from worker_runtime.faults import FaultConfig, Faults
from worker_runtime.outbox import Outbox
from worker_runtime.threads import ray_cpu_share
from worker_runtime.tombstones import Tombstones

log = logging.getLogger(__name__)
KILL_DELAY_S = 0.05  # a kill "after the first token" lets the result leave first


class PrefillWorker(WorkerCalls):
    def __init__(self, name: str, config: EngineConfig, transfer: KVTransferConfig, cpu: int | None = None,
                 faults: FaultConfig | None = None, emulation: Emulation | None = None, core: WorkerCore | None = None):
        """`core`: the engine of this process's last role, idle and reset (worker_host/); None: load one."""
        self.faults = Faults(faults, name)
        if core is None:
            core = WorkerCore(name, "prefill", config, self._on_outputs, cpu, self.faults,
                              node_ip=ray.util.get_node_ip_address(), cpu_share=ray_cpu_share(),
                              after_step=self._after_step, emulation=emulation)
        else:
            core.take_role(name, "prefill", self._on_outputs, self.faults, self._after_step)
        self.core = core
        self.sender = KVSender(self.core.engine.runner.kv, transfer)
        self.pusher = KVPusher(self.core.loop, self.sender, self.faults, transfer.stream_chunks,
                               on_failed=self._push_failed, on_ended=self._push_ended)
        self._timeout_s = transfer.timeout_s
        self._waiters: dict[str, asyncio.Future] = {}
        self._channel_locks: dict[str, asyncio.Lock] = {}
        self._peers: dict[str, object] = {}  # decode worker name -> actor handle
        self.outbox: Outbox[TransferFailed] = Outbox()  # failed sends, for the router's poll
        self._tasks: set[asyncio.Task] = set()
        self._aborted: Tombstones[None] = Tombstones()  # a late prefill or aim for these is refused

    async def prefill(self, task: PrefillTask, decode_actor=None) -> PrefillResult:
        """`decode_actor` comes with the first request for a decode worker and is kept. A task
        with no decode worker yet computes now; its KV waits for `aim` (at most `task.hold_s`)."""
        if task.decode_name is not None:
            await self._connect(task.decode_name, decode_actor)
        arrived = clock.now()
        if task.request_id in self._aborted:
            raise asyncio.CancelledError(f"{task.request_id} was cancelled")
        if task.hold_s is not None:
            self.core.aio.call_later(task.hold_s, self._track_expiry, task.request_id)
        out = await self._first_token(task, arrived)
        if out.finish_reason is FinishReason.ERROR:
            failed = PrefillStepFailed if out.retryable else PrefillFailed
            raise failed(f"prefill failed on {self.core.name}: {out.text}")
        if not out.token_ids:  # the outputs it resumed from had already ended it: a router bug
            raise PrefillFailed(f"{task.request_id} was already finished ({out.finish_reason}) when resumed")
        if out.finish_reason is FinishReason.PREFILLED:  # the KV's last piece is on its way already
            self.core.aio.call_later(KILL_DELAY_S, self.faults.maybe_kill, "prefill.after_first_token")
        return PrefillResult(task.request_id, out.token_ids[0], out.text, out.finish_reason,
                             clock.now() - arrived, out.num_cached_tokens, out.step_kind, out.prefill_timing)

    async def _first_token(self, task: PrefillTask, arrived: float) -> RequestOutput:
        fut = self.core.aio.create_future()
        self._waiters[task.request_id] = fut
        try:
            await self.core.run(lambda e: self._add(e, task, arrived))
            return await fut
        finally:
            self._waiters.pop(task.request_id, None)

    def _add(self, e: LLMEngine, task: PrefillTask, arrived: float) -> None:
        e.add_request(task.request_id, prompt_token_ids=task.prompt_token_ids, sampling=task.sampling,
                      prefill_only=True, output_token_ids=task.output_token_ids or None,
                      emitted_chars=task.emitted_chars, arrived_at=arrived)
        self.pusher.open(task.request_id, task.decode_name, task.skip_blocks)

    async def aim(self, request_id: str, skip_blocks: int, decode_name: str | None = None,
                  decode_actor=None) -> bool:
        """The decode reservation of a prefill sent before it came back: the decode side holds the
        first `skip_blocks` blocks; the KV may leave now. `decode_name`: the decode worker chosen
        after the prefill (its `decode_actor` comes with its first request, as in `prefill`).
        False if the request is gone (aborted, or its hold ran out)."""
        if decode_name is not None:
            await self._connect(decode_name, decode_actor)
        if request_id in self._aborted:  # its stream may be gone already, or never open
            return False
        return await self.core.run(lambda e: self.pusher.aim(e, request_id, skip_blocks, decode_name))

    async def _connect(self, decode_name: str, decode_actor) -> None:
        """The pair's channel, opened on first use; `decode_actor` is kept when it comes."""
        if decode_actor is not None:
            self._peers[decode_name] = decode_actor
        if decode_name not in self._peers:
            raise KeyError(f"{self.core.name} has no handle of {decode_name}")
        await self._ensure_channel(decode_name, self._peers[decode_name])

    def _track_expiry(self, request_id: str) -> None:
        self._track(self._expire(request_id))

    async def _expire(self, request_id: str) -> None:
        """A held KV whose `aim` never came within its task's hold_s: dropped, its blocks freed."""
        if await self.core.run(lambda e: self.pusher.expire(e, request_id)):
            self._aborted.add(request_id)
            waiter = self._waiters.pop(request_id, None)
            if waiter is not None and not waiter.done():
                waiter.cancel()
            log.warning("%s: the KV of %s was never aimed at a decode worker; dropped", self.core.name, request_id)

    async def _ensure_channel(self, decode_name: str, decode_actor) -> None:
        lock = self._channel_locks.setdefault(decode_name, asyncio.Lock())
        async with lock:
            if self.sender.is_connected(decode_name):
                return
            ref = decode_actor.open_channel.remote(self.core.name)
            rendezvous = await within(ref, self._timeout_s)  # host, port and the channel's secret
            await asyncio.to_thread(self.sender.connect, decode_name, *rendezvous)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            waiter = self._waiters.get(out.request_id)
            if waiter is not None:
                self.core.aio.call_soon_threadsafe(_resolve, waiter, out)

    # ---- the KV push (prefill_worker/push.py) ----------------------------------------
    def _after_step(self, e: LLMEngine) -> None:
        self.pusher.after_step(e)

    def _push_failed(self, request_id: str, decode_name: str, error: str) -> None:
        """Loop thread: a piece failed; the router moves the request, the decode side frees."""
        self.core.aio.call_soon_threadsafe(self._report_failure, request_id, decode_name, error)

    def _push_ended(self, request_id: str) -> None:
        self.core.served += 1  # read by stats() on the loop thread too

    def _report_failure(self, request_id: str, decode_name: str, error: str) -> None:
        self.outbox.push([TransferFailed(request_id, error)])
        peer = self._peers.get(decode_name)
        if peer is not None:
            self._track(self._tell_decode(peer, request_id, error))

    async def _tell_decode(self, peer, request_id: str, error: str) -> None:
        try:
            await within(peer.transfer_failed.remote(request_id, error), self._timeout_s)
        except Exception as e:  # a dead or hung decode worker: its lease and the router cover it
            log.warning("could not tell the decode worker that %s failed: %s", request_id, e)

    def _track(self, coro) -> None:
        task = self.core.aio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- admin ----------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        await self.core.run(lambda e: (self.pusher.abandon(e, request_id), e.abort(request_id)))

    async def close_channel(self, decode_name: str) -> None:
        self._peers.pop(decode_name, None)
        await asyncio.to_thread(self.sender.close_channel, decode_name)

    def _num_channels(self) -> int:
        return self.sender.num_channels

    async def set_faults(self, faults: FaultConfig) -> None:
        """Fault injection changed while running (tests; worker_runtime/faults.py)."""
        self.faults.set(faults)

    async def leave(self) -> None:
        """Another role takes this process (worker_host/): every channel closes; the engine stays."""
        await asyncio.to_thread(self.sender.shutdown)

    async def shutdown(self) -> None:
        await self.leave()
        self.core.stop()


def _resolve(fut: asyncio.Future, out: RequestOutput) -> None:
    if not fut.done():
        fut.set_result(out)
