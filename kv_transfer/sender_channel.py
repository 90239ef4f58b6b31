"""One prefill->decode channel, sender side: a thread that runs queued transfers in order.

Per transfer: header, payload chunks, [checksum trailer], then the receiver's reply (dst ids or
a refusal; on an emulated link, config.pace, the receiver holds it until the modelled time). Idle for heartbeat_s -> a heartbeat (the receiver's idle loop wakes on it, and a
receiver that is closing answers CLOSING). Any ChannelBroken ends the thread: the in-flight
future and every queued one fail with KVTransferError, and the groups are aborted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kv_transfer.config import KVTransferConfig, KVTransferError, TransferResult
from kv_transfer.frames import (
    HEADER_BYTES,
    TAG_CONTROL,
    TAG_REPLY,
    TAG_TRAILER,
    Header,
    Kind,
    Reply,
    Status,
)
from kv_transfer.groups import ChannelBroken, ChannelGroups, wait_for
from kv_transfer.handshake import Agreement
from kv_transfer.layout import Digest
from kv_transfer.pipeline import DataPath, plan_chunk_blocks, send_chunks

logger = logging.getLogger(__name__)


@dataclass
class TransferJob:
    request_id: str
    block_ids: list[int]
    future: Future[TransferResult]
    enqueued: float
    ready: torch.cuda.Event | None   # the caller's stream had written the KV at this event
    first_block: int = 0   # index of block_ids[0] in the request (the receiver holds the rest)


class _PeerClosing(Exception):
    """The receiver answered a heartbeat with CLOSING: a clean end of the channel."""


class SenderChannel:
    def __init__(self, peer_id: str, groups: ChannelGroups, agreement: Agreement,
                 path: DataPath, config: KVTransferConfig,
                 on_closed: Callable[[SenderChannel], None]) -> None:
        self.peer_id = peer_id
        self._groups = groups
        self._agreement = agreement
        self._path = path
        self._config = config
        self._on_closed = on_closed
        self._jobs: queue.SimpleQueue[TransferJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()   # orders submit() against the thread's final drain
        self._closed = False
        self._closing = threading.Event()
        self._seq = 0
        self._in_flight: TransferJob | None = None
        self._header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        self._reply = torch.empty(Reply.frame_bytes(0), dtype=torch.uint8)
        self._trailer = torch.empty(1, dtype=torch.int64)
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{peer_id}",
                                        daemon=True)

    @property
    def backend(self) -> str:
        return self._agreement.backend

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def submit(self, job: TransferJob) -> None:
        with self._lock:
            if not self._closed:
                self._jobs.put(job)
                return
        job.future.set_exception(KVTransferError(self.peer_id, job.request_id,
                                                 "channel closed"))

    def close(self) -> None:
        self._closing.set()
        self._jobs.put(None)

    def _run(self) -> None:
        reason, broken = "channel closed", False
        try:
            self._serve()
        except _PeerClosing:
            reason = "the receiver closed the channel"
        except ChannelBroken as err:
            reason, broken = str(err), True
            logger.warning("kv_transfer: channel to %s broken: %s", self.peer_id, err)
        except Exception as err:   # a bug or a device error: futures must fail, never hang
            reason, broken = f"internal error: {err!r}", True
            logger.exception("kv_transfer: channel to %s failed", self.peer_id)
        finally:
            # Forget the channel before failing futures: a caller that sees the error and asks
            # is_connected() must already get False.
            self._on_closed(self)
            self._groups.close(broken)
            if self._in_flight is not None:
                self._fail(self._in_flight, reason)
            self._drain(f"channel torn down: {reason}" if broken else reason)

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._agreement.heartbeat_s)
            except queue.Empty:
                self._heartbeat()
                continue
            if job is None or self._closing.is_set():
                if job is not None and job.future.set_running_or_notify_cancel():
                    self._fail(job, "channel closed")
                self._say_goodbye()
                return
            if job.future.set_running_or_notify_cancel():   # False: cancelled while queued
                self._transfer(job)

    def _transfer(self, job: TransferJob) -> None:
        start = time.monotonic()
        self._in_flight = job   # failed by _run if the exchange breaks the channel
        reply = self._exchange(job, start + self._config.timeout_s)
        self._in_flight = None
        if reply.status != Status.OK:
            self._fail(job, f"{reply.status.name.lower()} by the receiver: {reply.message}")
            return
        nbytes = len(job.block_ids) * self._path.copier.layout.bytes_per_block
        job.future.set_result(TransferResult(job.request_id, reply.dst_block_ids, nbytes,
                                             time.monotonic() - start, start - job.enqueued))

    def _exchange(self, job: TransferJob, deadline: float) -> Reply:
        groups, checksum = self._groups, self._agreement.checksum
        num_blocks = len(job.block_ids)
        chunk_blocks = plan_chunk_blocks(num_blocks, self._path.copier.layout.bytes_per_block,
                                         self._agreement.slot_blocks)
        self._seq += 1
        Header(Kind.TRANSFER, self._seq, job.request_id, num_blocks, chunk_blocks, checksum,
               self._path.copier.layout, job.first_block).encode_into(self._header)
        header_sent = groups.send(self._header, TAG_CONTROL)
        reply_frame = self._reply_frame(num_blocks)
        reply_in = groups.recv(reply_frame, TAG_REPLY)   # posted early: no wake-up lag
        digest = Digest() if checksum else None
        with self._path.on_stream():
            if job.ready is not None:
                self._path.stream.wait_event(job.ready)
            payload_sent = send_chunks(groups, self._path.staging, self._path.copier,
                                       job.block_ids, chunk_blocks, deadline, digest)
            sent = [header_sent]
            if digest is not None:
                self._trailer.fill_(digest.value)
                sent.append(groups.send(self._trailer, TAG_TRAILER))
            wait_for(reply_in, deadline, "waiting for the receiver's reply")
            for work in payload_sent:
                groups.wait_data(work, deadline, "sending a payload chunk")
            for work in sent:
                wait_for(work, deadline, "sending the header")
        return self._checked(Reply.decode(reply_frame))

    def _heartbeat(self) -> None:
        self._seq += 1
        Header(Kind.HEARTBEAT, self._seq).encode_into(self._header)
        deadline = time.monotonic() + self._config.timeout_s
        reply_frame = self._reply_frame(0)
        reply_in = self._groups.recv(reply_frame, TAG_REPLY)
        wait_for(self._groups.send(self._header, TAG_CONTROL),
                 deadline, "sending a heartbeat")
        wait_for(reply_in, deadline, "waiting for a heartbeat reply")
        if self._checked(Reply.decode(reply_frame)).status == Status.CLOSING:
            raise _PeerClosing()

    def _say_goodbye(self) -> None:
        self._seq += 1
        Header(Kind.CLOSE, self._seq).encode_into(self._header)
        wait_for(self._groups.send(self._header, TAG_CONTROL),
                 time.monotonic() + self._config.timeout_s, "sending close")

    def _checked(self, reply: Reply) -> Reply:
        if reply.seq != self._seq:
            raise ChannelBroken(f"reply for frame {reply.seq}, expected {self._seq}")
        return reply

    def _reply_frame(self, num_blocks: int) -> torch.Tensor:
        nbytes = Reply.frame_bytes(num_blocks)
        if self._reply.numel() < nbytes:
            self._reply = torch.empty(nbytes, dtype=torch.uint8)
        return self._reply[:nbytes]

    def _fail(self, job: TransferJob, reason: str) -> None:
        job.future.set_exception(KVTransferError(self.peer_id, job.request_id, reason))

    def _drain(self, reason: str) -> None:
        with self._lock:
            self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                self._fail(job, reason)
