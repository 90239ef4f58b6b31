"""One prefill->decode channel, receiver side: a thread that serves the channel's frames.

Lifecycle: wait for the sender to join the store (interruptible), build the gloo group,
answer the handshake, then loop: next header -> transfer | heartbeat | close. A transfer's
payload lands straight in the blocks resolve_blocks(request_id, n) names; the owner hears
on_complete(request_id, blocks, error) exactly once for every list resolve_blocks returned,
before the sender's future resolves. A rejected transfer's payload is drained so the stream
stays in sync. Any ChannelBroken ends the thread and closes the groups and the store's port.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kv_transfer.config import HandshakeMismatch, KVTransferConfig, KVTransferError
from kv_transfer.frames import (
    HEADER_BYTES,
    TAG_CONTROL,
    TAG_REPLY,
    TAG_TRAILER,
    FrameError,
    Header,
    Kind,
    Reply,
    Status,
)
from kv_transfer.groups import (
    JOINED_KEY,
    RECEIVER_RANK,
    SENDER_RANK,
    ChannelBroken,
    ChannelGroups,
    DeviceInfo,
    gloo_group,
    wait_for,
)
from kv_transfer.handshake import Agreement, Hello, answer_hello, rendezvous_prefix
from kv_transfer.layout import Digest, KVLayout
from kv_transfer.pace import LinkClock
from kv_transfer.pipeline import DataPath, local_slot_blocks, recv_chunks

logger = logging.getLogger(__name__)

ResolveBlocks = Callable[[str, int, int], "list[int] | None"]  # (request id, num_blocks, first_block)
OnComplete = Callable[[str, "list[int]", "BaseException | None"], None]
_JOIN_POLL_S = 0.01


@dataclass(frozen=True)
class Owner:
    """What the decode worker lends a channel: its pool and its two callbacks."""

    kv: torch.Tensor
    host: str
    config: KVTransferConfig
    resolve_blocks: ResolveBlocks
    on_complete: OnComplete
    link: LinkClock   # an emulated link's pace (kv_transfer/pace.py); holds nothing without one


class ReceiverChannel:
    def __init__(self, peer_id: str, store: dist.TCPStore, owner: Owner,
                 on_closed: Callable[[ReceiverChannel], None], secret: bytes) -> None:
        self.peer_id = peer_id
        self._secret = secret   # the peer proves it in the handshake (handshake.py)
        self.port = store.port
        self._store: dist.TCPStore | None = store
        self._owner = owner
        self._layout = KVLayout.of(owner.kv)
        self._on_closed = on_closed
        self._closing = threading.Event()
        self._path: DataPath | None = None
        self._reply = torch.empty(Reply.frame_bytes(0), dtype=torch.uint8)
        self._pending_reply: dist.Work | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-recv-{peer_id}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def close(self) -> None:
        """Takes effect at the next frame: at most heartbeat_s when idle."""
        self._closing.set()

    def _run(self) -> None:
        groups, broken = None, True
        try:
            groups = self._rendezvous()
            if groups is not None:
                self._serve(groups, self._handshake(groups))
            broken = False
        except HandshakeMismatch as err:
            logger.warning("kv_transfer: %s", err)
            broken = False
        except ChannelBroken as err:
            logger.warning("kv_transfer: channel from %s broken: %s", self.peer_id, err)
        except Exception:   # a bug or a device error: end the channel, loudly
            logger.exception("kv_transfer: channel from %s failed", self.peer_id)
        finally:
            if groups is not None:
                groups.close(broken)
            self._store = None   # last reference: the rendezvous port is released
            self._on_closed(self)

    def _rendezvous(self) -> ChannelGroups | None:
        config = self._owner.config
        # only the peer knows where its keys go: a stranger's keys elsewhere in the store are ignored
        store = dist.PrefixStore(rendezvous_prefix(self._secret), self._store)
        deadline = time.monotonic() + config.timeout_s
        while not store.check([JOINED_KEY]):
            if self._closing.is_set():
                return None
            if time.monotonic() > deadline:
                logger.warning("kv_transfer: %s never joined port %d within %.1fs",
                               self.peer_id, self.port, config.timeout_s)
                return None
            time.sleep(_JOIN_POLL_S)
        try:
            control = gloo_group(store, RECEIVER_RANK, self._owner.host, config.timeout_s)
        except RuntimeError as err:
            raise ChannelBroken(f"building the gloo group: {err}") from err
        return ChannelGroups(store, control, control, "gloo", SENDER_RANK)

    def _handshake(self, groups: ChannelGroups) -> Agreement:
        kv, config = self._owner.kv, self._owner.config
        deadline = time.monotonic() + config.timeout_s
        hello = Hello(self._layout, DeviceInfo.of(kv.device), config.backend,
                      local_slot_blocks(kv, config), config.checksum, config.heartbeat_s)
        agreement = answer_hello(groups, hello, self.peer_id, deadline, self._secret)
        groups.attach_data(agreement.backend, RECEIVER_RANK, config.timeout_s, kv.device,
                           deadline)
        self._path = DataPath.build(kv, agreement.backend, agreement.slot_blocks, config)
        return agreement

    def _serve(self, groups: ChannelGroups, agreement: Agreement) -> None:
        frame = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        # An idle sender pings every heartbeat_s: silence for this long means it is gone.
        idle_s = max(self._owner.config.timeout_s, 5 * agreement.heartbeat_s)
        while self._serve_frame(groups, agreement, frame, idle_s):
            pass
        self._reply_sent(time.monotonic() + self._owner.config.timeout_s)

    def _serve_frame(self, groups: ChannelGroups, agreement: Agreement, frame: torch.Tensor,
                     idle_s: float) -> bool:
        """Serve the next frame; False once the channel should end."""
        wait_for(groups.recv(frame, TAG_CONTROL), time.monotonic() + idle_s,
                 "waiting for the next frame")
        try:
            header = Header.decode(frame)
        except FrameError as err:
            raise ChannelBroken(str(err)) from err
        if header.kind == Kind.CLOSE:
            return False
        if header.kind == Kind.HEARTBEAT:
            status = Status.CLOSING if self._closing.is_set() else Status.OK
            self._send_reply(groups, Reply(status, header.seq, []), 0,
                             time.monotonic() + self._owner.config.timeout_s)
            return status == Status.OK
        self._receive(groups, header, agreement)
        return True

    def _receive(self, groups: ChannelGroups, header: Header, agreement: Agreement) -> None:
        self._check_framing(header, agreement)
        deadline = time.monotonic() + self._owner.config.timeout_s
        request_id, num_blocks = header.request_id, header.num_blocks
        resolved = self._resolve(request_id, num_blocks, header.first_block)
        # an emulated link's clock starts once the blocks are known, after the owner's own landing
        # clock (which `_resolve` starts), so the landing time it reports is never under the model
        arrived = time.monotonic()
        refusal = self._refusal(resolved, num_blocks)
        try:
            corruption = self._land(groups, header, None if refusal else resolved, deadline)
        except Exception as err:   # the owner must get its blocks back whatever went wrong
            if resolved is not None:
                self._complete(request_id, resolved,
                               KVTransferError(self.peer_id, request_id, str(err)))
            raise
        status = Status.REJECTED if refusal else Status.FAILED if corruption else Status.OK
        reason = refusal or corruption
        if status == Status.OK:  # an emulated link: landed no sooner than its modelled time
            self._owner.link.hold(num_blocks, arrived)
        if resolved is not None:
            error = KVTransferError(self.peer_id, request_id, reason) if reason else None
            self._complete(request_id, resolved, error)
        reply = Reply(status, header.seq, resolved if status == Status.OK else [], reason or "")
        self._send_reply(groups, reply, num_blocks, deadline)

    def _land(self, groups: ChannelGroups, header: Header, blocks: list[int] | None,
              deadline: float) -> str | None:
        """Receive the payload into `blocks` (None drains it); returns a corruption reason."""
        digest = Digest() if header.checksum else None
        with self._path.on_stream():
            recv_chunks(groups, self._path.staging, self._path.copier, header.num_blocks,
                        blocks, header.chunk_blocks, deadline, digest)
        self._path.synchronize()
        return None if digest is None else self._verify(groups, digest, deadline)

    def _check_framing(self, header: Header, agreement: Agreement) -> None:
        """A header that breaks the handshake's terms means the stream is not what we think."""
        if header.layout != self._layout:
            raise ChannelBroken(f"header layout {header.layout} != {self._layout}")
        if not (header.num_blocks >= 1 and 1 <= header.chunk_blocks <= agreement.slot_blocks):
            raise ChannelBroken(f"header with {header.num_blocks} blocks in chunks of "
                                f"{header.chunk_blocks} (agreed at most {agreement.slot_blocks})")
        if header.checksum != agreement.checksum:
            raise ChannelBroken("header checksum flag differs from the handshake")

    def _resolve(self, request_id: str, num_blocks: int, first_block: int) -> list[int] | None:
        if self._closing.is_set():
            return None
        try:
            resolved = self._owner.resolve_blocks(request_id, num_blocks, first_block)
        except Exception:   # the owner's bug must not break the channel: log, then refuse
            logger.exception("kv_transfer: resolve_blocks(%r, %d, %d) raised", request_id,
                             num_blocks, first_block)
            return None
        return None if resolved is None else [int(block) for block in resolved]

    def _refusal(self, resolved: list[int] | None, num_blocks: int) -> str | None:
        if self._closing.is_set():
            return "the receiver is closing this channel"
        if resolved is None:
            return "request unknown to the receiver (never reserved, cancelled or finished)"
        if len(resolved) != num_blocks:
            return f"receiver reserved {len(resolved)} blocks, sender sent {num_blocks}"
        pool_blocks = self._owner.kv.shape[0]
        if any(not 0 <= block < pool_blocks for block in resolved):
            return f"reserved block ids outside [0, {pool_blocks})"
        if len(set(resolved)) != num_blocks:
            return "reserved block ids are not distinct"
        return None

    def _verify(self, groups: ChannelGroups, digest: Digest, deadline: float) -> str | None:
        trailer = torch.empty(1, dtype=torch.int64)
        wait_for(groups.recv(trailer, TAG_TRAILER), deadline,
                 "receiving the checksum")
        if int(trailer.item()) != digest.value:
            return f"checksum mismatch (sender {int(trailer.item())}, received {digest.value})"
        return None

    def _complete(self, request_id: str, blocks: list[int], error: BaseException | None) -> None:
        try:
            self._owner.on_complete(request_id, blocks, error)
        except Exception:   # the owner's bug must not break the channel
            logger.exception("kv_transfer: on_complete(%r) raised", request_id)

    def _send_reply(self, groups: ChannelGroups, reply: Reply, num_blocks: int,
                    deadline: float) -> None:
        """Posts the reply; its completion is awaited before the reply buffer is reused, so
        the loop goes straight back to posting the next header's receive."""
        self._reply_sent(deadline)
        nbytes = Reply.frame_bytes(num_blocks)
        if self._reply.numel() < nbytes:
            self._reply = torch.empty(nbytes, dtype=torch.uint8)
        frame = self._reply[:nbytes]
        reply.encode_into(frame, num_blocks)
        self._pending_reply = groups.send(frame, TAG_REPLY)

    def _reply_sent(self, deadline: float) -> None:
        if self._pending_reply is not None:
            work, self._pending_reply = self._pending_reply, None
            wait_for(work, deadline, "sending the reply")
