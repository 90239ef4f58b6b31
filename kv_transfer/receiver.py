"""Decode side: KVReceiver hosts one rendezvous + channel per prefill peer.

open_channel(peer) binds a TCPStore on port 0 of `host` (the decode worker's node IP, given by
the caller), returns (host, port) at once, and lets the channel thread wait for the peer.
The decode worker owns its blocks: resolve_blocks names where a request's KV goes, and
on_complete hands the blocks back (landed, or failed -> the owner frees them).
"""

from __future__ import annotations

import threading

import torch

from kv_transfer.config import KVTransferConfig
from kv_transfer.groups import open_store
from kv_transfer.layout import KVLayout
from kv_transfer.receiver_channel import OnComplete, Owner, ReceiverChannel, ResolveBlocks


class KVReceiver:
    """Thread-safe. Callbacks run on channel threads (one per peer, concurrently)."""

    def __init__(self, kv: torch.Tensor, host: str, config: KVTransferConfig,
                 resolve_blocks: ResolveBlocks, on_complete: OnComplete) -> None:
        KVLayout.of(kv)   # validates the pool's shape, dtype and contiguity
        self._owner = Owner(kv, host, config, resolve_blocks, on_complete)
        self._channels: dict[str, ReceiverChannel] = {}
        self._lock = threading.Lock()

    @property
    def num_channels(self) -> int:
        with self._lock:
            return len(self._channels)

    def open_channel(self, peer_id: str) -> tuple[str, int]:
        """Start the rendezvous for peer_id (replacing any channel to it); hand the returned
        (host, port) to that peer's sender.connect within timeout_s."""
        with self._lock:
            store = open_store(self._owner.host, self._owner.config.timeout_s)
            channel = ReceiverChannel(peer_id, store, self._owner, self._forget)
            replaced = self._channels.get(peer_id)
            self._channels[peer_id] = channel
        if replaced is not None:
            replaced.close()
        channel.start()
        return self._owner.host, channel.port

    def close_channel(self, peer_id: str, wait: bool = False) -> None:
        """Closes at the channel's next frame (<= heartbeat_s when idle); wait=True joins."""
        with self._lock:
            channel = self._channels.pop(peer_id, None)
        if channel is not None:
            channel.close()
            if wait:
                channel.join()

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()
        for channel in channels if wait else []:
            channel.join()

    def _forget(self, channel: ReceiverChannel) -> None:
        with self._lock:
            if self._channels.get(channel.peer_id) is channel:
                del self._channels[channel.peer_id]
