"""The decode worker, a Ray async actor.

Protocol with the router (disaggregated; see protocol/messages.py): `reserve` a lease on blocks
-> a prefill worker pushes the KV into them over `kv_transfer` -> `start` hands over the
tokens so far; the request joins the running batch once both the KV has landed and `start`
came (decode_worker/handoff.py keeps that state). Colocated: `generate` prefills and decodes
here. Tokens leave through `poll`, which returns every output since the last poll (one Ray
call per step or more, never one per token). A hand-off that fails (transfer error, lease
ended) leaves as an output with finish reason ERROR and `retryable=True`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import ray

from decode_worker.handoff import Action, HandoffTable, Outcome
from engine.config import EngineConfig
from kv_transfer import KVReceiver, KVTransferConfig, Rendezvous
from protocol import clock
from protocol.deadline import within
from protocol.messages import GenerateTask, Reservation, Reserved, StartDecode, WorkerInfo
from protocol.outputs import FinishReason, RequestOutput
from protocol.telemetry import EmulationStats
from sizing.cost_model import Emulation
from worker_runtime.core import WorkerCalls, WorkerCore
from worker_runtime.faults import FaultConfig, Faults
from worker_runtime.outbox import Outbox
from worker_runtime.threads import ray_cpu_share

REAP_EVERY_S = 0.1
RESERVE_WAIT_S = 1.0  # a reserve the engine has not taken by then answers "no room" (_reserve_in_time)


class DecodeWorker(WorkerCalls):
    def __init__(self, name: str, config: EngineConfig, transfer: KVTransferConfig | None, cpu: int | None = None,
                 faults: FaultConfig | None = None, emulation: Emulation | None = None, core: WorkerCore | None = None):
        """`core`: the engine of this process's last role, idle and reset (worker_host/); None: load one."""
        self.faults = Faults(faults, name)
        if core is None:
            core = WorkerCore(name, "decode", config, self._on_outputs, cpu, self.faults,
                              node_ip=ray.util.get_node_ip_address(), cpu_share=ray_cpu_share(),
                              colocated=transfer is None, emulation=emulation)
        else:
            core.take_role(name, "decode", self._on_outputs, self.faults)
        self.core = core
        self.outbox: Outbox[RequestOutput] = Outbox()
        self.handoffs = HandoffTable()
        self._transfers: dict[str, tuple[float, int]] = {}  # request id -> (seconds, bytes) of its KV
        self._landing_since: dict[str, float] = {}
        self._block_bytes = self.core.engine.runner.block_bytes
        self.receiver = None
        if transfer is not None:
            self.receiver = KVReceiver(self.core.engine.runner.kv, self.core.node_ip, transfer,
                                       resolve_blocks=self._resolve_blocks, on_complete=self._on_landed)
        self._reaper: asyncio.Task | None = None

    async def ready(self) -> WorkerInfo:
        info = await super().ready()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_leases())
        return info

    # ---- outputs ------------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.core.served += 1
                out.kv_transfer_s, out.kv_transfer_bytes = self._transfers.pop(out.request_id, (0.0, 0))
        self.outbox.push(outputs)
        if any(out.token_ids for out in outputs):
            self.faults.maybe_kill("decode.mid_stream")

    # ---- colocated ----------------------------------------------------------------
    async def generate(self, task: GenerateTask) -> None:
        """Prefill and decode here, after the tokens an earlier attempt streamed."""
        if self.handoffs.is_ended(task.request_id):  # its abort ran first (Ray need not keep the order)
            return
        arrived = clock.now()
        await self.core.run(lambda e: e.add_request(task.request_id, prompt_token_ids=task.prompt_token_ids,
                                                    sampling=task.sampling,
                                                    output_token_ids=task.output_token_ids or None,
                                                    emitted_chars=task.emitted_chars, arrived_at=arrived))

    # ---- disaggregated --------------------------------------------------------------
    async def reserve(self, r: Reservation) -> Reserved | None:
        """Blocks for `r.num_tokens`, the leading ones from the prefix cache where it holds
        `r.token_ids`' blocks; None when they don't fit (or the request was cancelled)."""
        if self.handoffs.is_ended(r.request_id) or self.faults.refuse_reserve():
            return None
        got = await self._reserve_in_time(r)
        if got is None:
            return None
        blocks, cached = got
        pushed = self.core.engine.blocks_for(r.num_tokens - 1) - cached  # all but the next token's KV
        if not self.handoffs.add(r.request_id, blocks, r.lease_s, cached=cached, expected=pushed):  # cancelled while reserving
            await self.core.run(lambda e: e.release(r.request_id))
            return None
        self.faults.maybe_kill("decode.after_reserve")
        return Reserved(len(blocks), cached)

    async def _reserve_in_time(self, r: Reservation) -> tuple[list[int], int] | None:
        """The engine's reservation, or None ("no room") if the engine has not taken the call within
        RESERVE_WAIT_S, or `r.wait_s` when shorter (the request's queue deadline): the router waits
        for this answer holding its admission lock, an engine in a long or stalled step must not
        stop placement for everyone, and a request refused at its deadline must hear so then.
        Whichever comes first, the engine thread running it or the actor giving up, decides under
        `lock`: a reservation given up on is never made, so no block is left held."""
        lock, ran, gave_up = threading.Lock(), threading.Event(), threading.Event()

        def reserve(e):
            with lock:
                if gave_up.is_set():
                    return None
                ran.set()
                return e.reserve(r.request_id, r.num_tokens, list(r.token_ids) or None, r.cache_salt)
        fut = self.core.loop.call(reserve)
        try:
            return await within(asyncio.shield(asyncio.wrap_future(fut)), min(RESERVE_WAIT_S, r.wait_s))
        except TimeoutError:
            with lock:  # held by the engine thread at most for one reserve, never across a step
                if not ran.is_set():
                    gave_up.set()
                    return None
            return await asyncio.wrap_future(fut)  # it ran: its answer is on its way

    async def start(self, msg: StartDecode) -> None:
        """Raises ReservationGone when the reservation ended: the router places the request again."""
        self._act(msg.request_id, self.handoffs.start(msg))
        self.faults.maybe_kill("decode.after_start")

    async def transfer_failed(self, request_id: str, reason: str) -> None:
        """The prefill side could not send this request's KV."""
        self._act(request_id, self.handoffs.transfer_failed(request_id, reason))

    async def open_channel(self, peer: str) -> Rendezvous:
        """(host, port, secret) of a fresh channel for `peer`; Ray carries it to that peer only."""
        return await asyncio.to_thread(self.receiver.open_channel, peer)

    async def close_channel(self, peer: str) -> None:
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.close_channel, peer)

    def _resolve_blocks(self, request_id: str, num_blocks: int, first_block: int = 0) -> list[int] | None:
        blocks = self.handoffs.resolve(request_id, num_blocks, first_block)
        if blocks is not None:
            self._landing_since[request_id] = clock.now()
        return blocks

    def _on_landed(self, request_id: str, dst_block_ids: list[int], error: BaseException | None) -> None:
        since = self._landing_since.pop(request_id, None)
        if error is None and since is not None:  # summed over the pieces of a streamed push
            seconds, nbytes = self._transfers.get(request_id, (0.0, 0))
            self._transfers[request_id] = (seconds + clock.now() - since,
                                           nbytes + len(dst_block_ids) * self._block_bytes)
        self._act(request_id, self.handoffs.landed(request_id, error))

    def _act(self, request_id: str, outcome: Outcome) -> None:
        """Carry out what the hand-off table decided (any thread)."""
        if outcome.action is Action.ADMIT:
            s = outcome.slot.start
            fut = self.core.loop.call(lambda e: e.add_prefilled(request_id, s.prompt_token_ids, s.output_token_ids,
                                                                s.sampling, s.emitted_chars))
            fut.add_done_callback(lambda f: f.exception() and self._fail(request_id, f"cannot admit: {f.exception()}",
                                                                       retryable=False))
        elif outcome.action is Action.FREE:
            self._transfers.pop(request_id, None)
            self.core.loop.call(lambda e: e.release(request_id))
        elif outcome.action is Action.FAIL:
            self._transfers.pop(request_id, None)
            self._fail(request_id, outcome.reason, retryable=True)

    def _fail(self, request_id: str, error: str, retryable: bool) -> None:
        self.core.loop.call(lambda e: e.release(request_id))
        self.outbox.push([RequestOutput(request_id, [], error, FinishReason.ERROR, retryable=retryable)])

    async def _reap_leases(self) -> None:
        while True:
            for request_id, outcome in self.handoffs.expire():
                self._act(request_id, outcome)
            await asyncio.sleep(REAP_EVERY_S)

    # ---- both ---------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        """Free whatever the request holds here, in any state (idempotent)."""
        self._transfers.pop(request_id, None)
        outcome = self.handoffs.cancel(request_id)
        if outcome.slot is not None:
            self._act(request_id, outcome)
            return
        await self.core.run(lambda e: e.abort(request_id))

    async def emulation(self) -> EmulationStats | None:
        """The steps' pacing counters and the KV transfers' over the emulated link."""
        stats = await self.core.emulation()
        if stats is None or self.receiver is None:
            return stats
        link = self.receiver.link_stats()
        return dataclasses.replace(stats, transfers=link.transfers, transfer_overruns=link.overruns,
                                   transfer_lateness_s=link.lateness_s, transfer_max_lateness_s=link.max_lateness_s,
                                   transfer_ratio_max=link.ratio_max)

    def _num_channels(self) -> int:
        return self.receiver.num_channels if self.receiver else 0

    async def set_faults(self, faults: FaultConfig) -> None:
        """Fault injection changed while running (tests; worker_runtime/faults.py)."""
        self.faults.set(faults)

    async def leave(self) -> None:
        """Another role takes this process (worker_host/): the lease reaper stops, every channel
        closes; the engine stays."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.shutdown)

    async def shutdown(self) -> None:
        await self.leave()
        self.core.stop()
