"""The table of live channels that both KVSender and KVReceiver keep, one per peer.

Thread-safe. A channel object needs `peer_id`, `close()` and `join()`. Installing a channel
for a peer closes the one it replaces; a channel that ends on its own is forgotten unless it
was already replaced.
"""

from __future__ import annotations

import threading
from typing import Generic, Protocol, TypeVar


class _Channel(Protocol):
    peer_id: str

    def close(self) -> None: ...

    def join(self) -> None: ...


C = TypeVar("C", bound=_Channel)


class ChannelTable(Generic[C]):
    def __init__(self) -> None:
        self._channels: dict[str, C] = {}
        self._lock = threading.Lock()

    @property
    def num_channels(self) -> int:
        with self._lock:
            return len(self._channels)

    def _get(self, peer_id: str) -> C | None:
        with self._lock:
            return self._channels.get(peer_id)

    def _install(self, channel: C) -> None:
        with self._lock:
            replaced = self._channels.get(channel.peer_id)
            self._channels[channel.peer_id] = channel
        if replaced is not None:
            replaced.close()

    def close_channel(self, peer_id: str, wait: bool = False) -> None:
        """Close the channel to peer_id (see the subclass for what happens to its transfers);
        wait=True joins its thread."""
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

    def _forget(self, channel: C) -> None:
        """Called by a channel's thread when it ends; drops it unless already replaced."""
        with self._lock:
            if self._channels.get(channel.peer_id) is channel:
                del self._channels[channel.peer_id]
