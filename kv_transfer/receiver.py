"""Decode side: KVReceiver hosts one rendezvous + channel per prefill peer.

open_channel(peer) binds a TCPStore on port 0 of `host` (the decode worker's node IP, given by
the caller; with config.interface set, that interface's address instead), returns (host, port)
at once, and lets the channel thread wait for the peer.
The decode worker owns its blocks: resolve_blocks names where a request's KV goes, and
on_complete hands the blocks back (landed, or failed -> the owner frees them).
"""

from __future__ import annotations

import torch

from kv_transfer.channels import ChannelTable
from kv_transfer.config import KVTransferConfig
from kv_transfer.groups import interface_address, open_store, use_interface
from kv_transfer.handshake import Rendezvous, new_secret
from kv_transfer.layout import KVLayout
from kv_transfer.pace import LinkClock, LinkStats
from kv_transfer.receiver_channel import OnComplete, Owner, ReceiverChannel, ResolveBlocks


class KVReceiver(ChannelTable[ReceiverChannel]):
    """Thread-safe. Callbacks run on channel threads (one per peer, concurrently).
    A closed channel stops at its next frame (<= heartbeat_s when idle)."""

    def __init__(self, kv: torch.Tensor, host: str, config: KVTransferConfig,
                 resolve_blocks: ResolveBlocks, on_complete: OnComplete) -> None:
        super().__init__()
        KVLayout.of(kv)   # validates the pool's shape, dtype and contiguity
        if config.interface is not None:
            try:
                host = interface_address(config.interface)
            except ValueError as err:   # at worker start, naming the node, not at the 1st request
                raise ValueError(f"decode node {host}: {err}") from None
            use_interface(config.interface)
        self._owner = Owner(kv, host, config, resolve_blocks, on_complete, LinkClock(config.pace))

    def link_stats(self) -> LinkStats:
        """How faithfully transfers kept an emulated link's time (all zero without one)."""
        return self._owner.link.stats()

    def open_channel(self, peer_id: str) -> Rendezvous:
        """Start the rendezvous for peer_id (replacing any channel to it); hand the returned
        (host, port, secret) to that peer's sender.connect within timeout_s, through Ray only:
        the secret is what keeps everyone else off the channel (handshake.py)."""
        store = open_store(self._owner.host, self._owner.config.timeout_s)
        secret = new_secret()
        channel = ReceiverChannel(peer_id, store, self._owner, self._forget, secret)
        self._install(channel)
        channel.start()
        return Rendezvous(self._owner.host, channel.port, secret)
