"""Prefill side: KVSender owns one channel per decode peer; each channel is one thread draining
an ordered queue of transfers.

The caller owns the source blocks and must not free or overwrite them until the transfer's
future is done (result or KVTransferError). A channel that fails (timeout, dead peer,
protocol error) fails its in-flight and queued transfers, closes its groups and disappears:
is_connected() turns False and the caller re-opens it (receiver.open_channel -> connect).
A peer it cannot reach fails connect() with the address it came from, the address it tried
and the stage it got to (the store, the gloo pair, the handshake).
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch
import torch.distributed as dist

from kv_transfer.channels import ChannelTable
from kv_transfer.config import KVTransferConfig, KVTransferError, TransferResult
from kv_transfer.frames import MAX_REQUEST_ID_BYTES
from kv_transfer.groups import (
    JOINED_KEY,
    RECEIVER_RANK,
    SENDER_RANK,
    ChannelBroken,
    ChannelGroups,
    DeviceInfo,
    gloo_group,
    interface_address,
    join_store,
    local_address_towards,
    short_error,
    use_interface,
)
from kv_transfer.handshake import Hello, rendezvous_prefix, send_hello
from kv_transfer.layout import KVLayout
from kv_transfer.pipeline import DataPath, local_slot_blocks
from kv_transfer.sender_channel import SenderChannel, TransferJob


class KVSender(ChannelTable[SenderChannel]):
    """Thread-safe: connect/send/close may be called from any thread. Closing a channel lets
    its in-flight transfer finish; queued ones fail."""

    def __init__(self, kv: torch.Tensor, config: KVTransferConfig | None = None) -> None:
        super().__init__()
        self._kv = kv
        self._layout = KVLayout.of(kv)
        self._config = config or KVTransferConfig()
        self._local_host: str | None = None   # None: the route towards each peer picks it
        if self._config.interface is not None:
            try:
                self._local_host = interface_address(self._config.interface)
            except ValueError as err:   # at worker start, not at the first request
                raise ValueError(f"prefill node: {err}") from None
            use_interface(self._config.interface)

    def is_connected(self, peer_id: str) -> bool:
        return self._get(peer_id) is not None

    def backend(self, peer_id: str) -> str | None:
        """The data backend the handshake picked for peer_id ("gloo" | "nccl"), None if none."""
        channel = self._get(peer_id)
        return None if channel is None else channel.backend

    def connect(self, peer_id: str, host: str, port: int, secret: bytes) -> None:
        """Join the rendezvous the receiver opened for us (its open_channel's host, port, secret);
        blocks until the channel is up.

        Replaces an existing channel to peer_id. Raises HandshakeMismatch when the receiver
        refuses us, KVTransferError when it cannot be reached within timeout_s.
        """
        channel = self._open(peer_id, host, port, secret)
        self._install(channel)
        channel.start()

    def send(self, peer_id: str, request_id: str, src_block_ids: list[int],
             first_block: int = 0) -> Future[TransferResult]:
        """Queue the blocks for peer_id; the future resolves once they have landed there.
        `first_block`: the index of src_block_ids[0] among the request's blocks (the receiver
        already holds the ones before it, e.g. from its prefix cache)."""
        self._check_request(request_id, src_block_ids)
        if first_block < 0:
            raise ValueError(f"request {request_id!r}: first_block {first_block} < 0")
        future: Future[TransferResult] = Future()
        ready = None
        if self._kv.is_cuda:   # copy the KV as the caller's stream has it when send() is called
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._kv.device))
        job = TransferJob(request_id, list(src_block_ids), future, time.monotonic(), ready, first_block)
        channel = self._get(peer_id)
        if channel is None:
            future.set_exception(KVTransferError(
                peer_id, request_id, "no channel to this peer (never connected, or torn down "
                "after a failure): open one with receiver.open_channel + sender.connect"))
            return future
        channel.submit(job)
        return future

    def _check_request(self, request_id: str, src_block_ids: list[int]) -> None:
        if not src_block_ids:
            raise ValueError(f"request {request_id!r}: no blocks to send")
        if len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"request id longer than {MAX_REQUEST_ID_BYTES} bytes")
        num_blocks = self._kv.shape[0]
        bad = [b for b in src_block_ids if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"request {request_id!r}: block ids {bad[:8]} outside "
                             f"[0, {num_blocks})")

    def _open(self, peer_id: str, host: str, port: int, secret: bytes) -> SenderChannel:
        config = self._config
        deadline = time.monotonic() + config.timeout_s
        groups, local, stage = None, self._local_host, "finding a route"
        try:
            local = local or local_address_towards(host, port)
            stage = "joining its KV store"
            store = dist.PrefixStore(rendezvous_prefix(secret), join_store(host, port, config.timeout_s))
            store.set(JOINED_KEY, "1")
            stage = "connecting the gloo pair"
            control = gloo_group(store, SENDER_RANK, local, config.timeout_s)
            groups = ChannelGroups(store, control, control, "gloo", RECEIVER_RANK)
            stage = "the handshake"
            agreement = send_hello(groups, self._hello(), peer_id, deadline, secret)
            groups.attach_data(agreement.backend, SENDER_RANK, config.timeout_s,
                               self._kv.device, deadline)
            path = DataPath.build(self._kv, agreement.backend, agreement.slot_blocks, config)
        except KVTransferError:
            if groups is not None:
                groups.close(broken=True)
            raise
        except (OSError, RuntimeError, ChannelBroken) as err:
            if groups is not None:
                groups.close(broken=True)
            reason = short_error(err).rstrip(".")
            raise KVTransferError(peer_id, None, (
                f"node {local or '(no route)'} could not reach {host}:{port} ({stage}, timeout "
                f"{config.timeout_s:g} s): {reason}; check that TCP connections from "
                f"{local or 'this node'} to {host} are allowed (routes, firewall) or pick the "
                f"network with kv_transfer.interface")) from err
        return SenderChannel(peer_id, groups, agreement, path, config, self._forget)

    def _hello(self) -> Hello:
        return Hello(self._layout, DeviceInfo.of(self._kv.device), self._config.backend,
                     local_slot_blocks(self._kv, self._config), self._config.checksum,
                     self._config.heartbeat_s)
