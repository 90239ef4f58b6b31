"""Configuration, results and errors of KV transfer channels.

Every value here may cross a Ray boundary: the config is a frozen dataclass, the result a small
dataclass and the errors pickle with their peer/request fields intact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Backend = Literal["auto", "gloo", "nccl"]


@dataclass(frozen=True)
class LinkPace:
    """An emulated link (docs/architecture.md, "Emulation"): the receiver completes a transfer of
    n blocks no sooner than (latency_s + n x block_bytes / bytes_per_s) x time_scale after its
    blocks were resolved on arrival, `block_bytes` being the emulated model's KV per block
    (kv_transfer/pace.py)."""

    block_bytes: int
    bytes_per_s: float
    latency_s: float = 0.0
    time_scale: float = 1.0

    def seconds(self, num_blocks: int) -> float:
        return (self.latency_s + num_blocks * self.block_bytes / self.bytes_per_s) * self.time_scale


@dataclass(frozen=True)
class KVTransferConfig:
    backend: Backend = "auto"
    timeout_s: float = 30.0          # per transfer, from the moment it reaches the wire
    checksum: bool = False           # sender digests the payload, receiver verifies it
    staging_bytes: int = 64 << 20    # per channel and side, split into `staging_slots` slots
    staging_slots: int = 4           # pipeline depth: chunks in flight while the next is copied
    heartbeat_s: float = 1.0         # idle sender pings; bounds how fast an idle receiver can close
    # network interface the channels use on every node (e.g. "eth1"): the store and the gloo
    # pair bind its IPv4 address and GLOO_/NCCL_SOCKET_IFNAME name it; None = the address the
    # caller gives the receiver (the Ray node IP) and the route towards it on the sender
    interface: str | None = None
    # the prefill worker sends each prefill chunk's full blocks while the next chunk computes
    # (prefill_worker/push.py); False = the whole prompt's KV after the first token
    stream_chunks: bool = True
    pace: LinkPace | None = None  # an emulated link's time per transfer; None = as fast as the real one

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"kv_transfer.backend must be auto, gloo or nccl, not {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"kv_transfer.timeout_s must be > 0, not {self.timeout_s}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"kv_transfer.heartbeat_s must be > 0, not {self.heartbeat_s}")
        if self.staging_slots < 2:
            raise ValueError(f"kv_transfer.staging_slots must be >= 2, not {self.staging_slots}")
        if self.staging_bytes < self.staging_slots:
            raise ValueError(f"kv_transfer.staging_bytes too small: {self.staging_bytes}")
        if self.interface is not None and not 0 < len(self.interface) < 16 \
                or any(c.isspace() or c == "/" for c in self.interface or ""):
            raise ValueError(f"kv_transfer.interface must be a network interface name (1-15 "
                             f"characters, no spaces or '/'), not {self.interface!r}")

    @property
    def slot_bytes(self) -> int:
        return self.staging_bytes // self.staging_slots


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    dst_block_ids: list[int]
    num_bytes: int
    seconds: float          # on the wire: dequeued by the channel thread -> receiver's reply
    queued_seconds: float   # send() -> dequeued (waiting behind earlier transfers on the channel)


class KVTransferError(RuntimeError):
    """A transfer or channel failed; names the peer and (when there is one) the request."""

    def __init__(self, peer_id: str, request_id: str | None, reason: str) -> None:
        self.peer_id = peer_id
        self.request_id = request_id
        self.reason = reason
        subject = f"request {request_id!r}" if request_id is not None else "channel"
        super().__init__(f"KV transfer of {subject} with peer {peer_id!r} failed: {reason}")

    def __reduce__(self):
        return (type(self), (self.peer_id, self.request_id, self.reason))


class HandshakeMismatch(KVTransferError):
    """The two ends disagree on layers, block shape, dtype or backend; the channel is refused."""
