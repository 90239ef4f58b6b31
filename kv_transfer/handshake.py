"""Channel handshake: the sender's Hello, the receiver's Verdict, and what both then agree on.

The receiver decides: identical KV layout (layers, block shape, dtype) or the channel is
refused with every difference named; a backend both ends allow (groups.resolve_backend);
staging chunks no bigger than either side's slot; checksums on if either side asks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.config import HandshakeMismatch
from kv_transfer.frames import HANDSHAKE_BYTES, TAG_HANDSHAKE, decode_json, encode_json
from kv_transfer.groups import ChannelGroups, DeviceInfo, resolve_backend, wait_for
from kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class Hello:
    layout: KVLayout
    device: DeviceInfo
    backend: str
    slot_blocks: int
    checksum: bool
    heartbeat_s: float

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "device": vars(self.device),
                "backend": self.backend, "slot_blocks": self.slot_blocks,
                "checksum": self.checksum, "heartbeat_s": self.heartbeat_s}

    @classmethod
    def from_dict(cls, raw: dict) -> Hello:
        return cls(KVLayout(**raw["layout"]), DeviceInfo(**raw["device"]), raw["backend"],
                   raw["slot_blocks"], raw["checksum"], raw["heartbeat_s"])


@dataclass(frozen=True)
class Agreement:
    backend: str
    slot_blocks: int
    checksum: bool
    heartbeat_s: float


def decide(receiver: Hello, sender: Hello) -> Agreement:
    """Receiver side; HandshakeMismatch (peer filled in by the caller) when refused."""
    differences = receiver.layout.mismatches(sender.layout, ("receiver", "sender"))
    if differences:
        raise HandshakeMismatch("", None, "KV layout differs: " + "; ".join(differences))
    try:
        backend = resolve_backend(sender.backend, receiver.backend, sender.device,
                                  receiver.device)
    except ValueError as err:
        raise HandshakeMismatch("", None, str(err)) from err
    return Agreement(backend, min(receiver.slot_blocks, sender.slot_blocks),
                     receiver.checksum or sender.checksum, sender.heartbeat_s)


def send_hello(groups: ChannelGroups, hello: Hello, peer_id: str, deadline: float) -> Agreement:
    """Sender side: Hello out, Verdict in; HandshakeMismatch when the receiver refused."""
    frame = torch.empty(HANDSHAKE_BYTES, dtype=torch.uint8)
    encode_json(frame, hello.to_dict())
    wait_for(groups.send(frame, TAG_HANDSHAKE), deadline,
             "sending the handshake")
    wait_for(groups.recv(frame, TAG_HANDSHAKE), deadline,
             "waiting for the handshake verdict")
    verdict = decode_json(frame)
    if not verdict["accepted"]:
        raise HandshakeMismatch(peer_id, None, f"refused by the receiver: {verdict['reason']}")
    return Agreement(verdict["backend"], verdict["slot_blocks"], verdict["checksum"],
                     hello.heartbeat_s)


def answer_hello(groups: ChannelGroups, receiver: Hello, peer_id: str,
                 deadline: float) -> Agreement:
    """Receiver side: Hello in, Verdict out; raises HandshakeMismatch after refusing."""
    frame = torch.empty(HANDSHAKE_BYTES, dtype=torch.uint8)
    wait_for(groups.recv(frame, TAG_HANDSHAKE), deadline,
             "waiting for the sender's handshake")
    refusal: HandshakeMismatch | None = None
    try:
        agreement = decide(receiver, Hello.from_dict(decode_json(frame)))
        verdict = {"accepted": True, **vars(agreement)}
    except HandshakeMismatch as err:
        refusal = HandshakeMismatch(peer_id, None, err.reason)
        verdict = {"accepted": False, "reason": err.reason}
    encode_json(frame, verdict)
    wait_for(groups.send(frame, TAG_HANDSHAKE), deadline,
             "sending the handshake verdict")
    if refusal is not None:
        raise refusal
    return agreement
