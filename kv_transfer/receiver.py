"""Decode side: KVReceiver hosts one rendezvous + channel per prefill peer.

open_channel(peer) binds a TCPStore on port 0 of `host` (the decode worker's node IP, given by
the caller), returns (host, port) at once, and lets the channel thread wait for the peer.
The decode worker owns its blocks: resolve_blocks names where a request's KV goes, and
on_complete hands the blocks back (landed, or failed -> the owner frees them).
"""

from __future__ import annotations

import torch

from kv_transfer.channels import ChannelTable
from kv_transfer.config import KVTransferConfig
from kv_transfer.groups import open_store
from kv_transfer.layout import KVLayout
from kv_transfer.receiver_channel import OnComplete, Owner, ReceiverChannel, ResolveBlocks


class KVReceiver(ChannelTable[ReceiverChannel]):
    """Thread-safe. Callbacks run on channel threads (one per peer, concurrently).
    A closed channel stops at its next frame (<= heartbeat_s when idle)."""

    def __init__(self, kv: torch.Tensor, host: str, config: KVTransferConfig,
                 resolve_blocks: ResolveBlocks, on_complete: OnComplete) -> None:
        super().__init__()
        KVLayout.of(kv)   # validates the pool's shape, dtype and contiguity
        self._owner = Owner(kv, host, config, resolve_blocks, on_complete)

    def open_channel(self, peer_id: str) -> tuple[str, int]:
        """Start the rendezvous for peer_id (replacing any channel to it); hand the returned
        (host, port) to that peer's sender.connect within timeout_s."""
        store = open_store(self._owner.host, self._owner.config.timeout_s)
        channel = ReceiverChannel(peer_id, store, self._owner, self._forget)
        self._install(channel)
        channel.start()
        return self._owner.host, channel.port
