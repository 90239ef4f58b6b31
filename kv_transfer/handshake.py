"""Channel handshake: the sender's Hello, the receiver's Verdict, and what both then agree on.

Peers first: the receiver makes a random secret per channel (`new_secret`) and the decode worker
hands it to its prefill peer through Ray with the store's address. The rendezvous keys live under
a prefix derived from it (`rendezvous_prefix`), so a stranger who reaches the store cannot take
the sender's rank by joining first. The Hello carries a fresh nonce and HMAC(secret, "sender" +
nonce); the receiver checks it (hmac.compare_digest) before it reads anything else, and refuses
a connection without it: no header or payload is ever read from it. An accepting Verdict carries
HMAC(secret, "receiver" + nonce), which the sender checks before it sends any KV. The secret
itself never travels on the KV network.

Then the terms: identical KV layout (layers, block shape, dtype) or the channel is refused with
every difference named; a backend both ends allow (groups.resolve_backend); staging chunks no
bigger than either side's slot; checksums on if either side asks.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kv_transfer.config import HandshakeMismatch
from kv_transfer.frames import HANDSHAKE_BYTES, TAG_HANDSHAKE, FrameError, decode_json, encode_json
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


SECRET_BYTES = 32
STRANGER = ("refused a connection that did not prove the channel secret (a stranger on the KV network, "
            "or a peer with another rendezvous)")


class Rendezvous(NamedTuple):
    """What a receiver's open_channel returns and its peer's sender.connect takes (through Ray)."""

    host: str
    port: int
    secret: bytes


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def rendezvous_prefix(secret: bytes) -> str:
    """Where the channel's store keys live: unknown to whoever does not hold the secret."""
    return hashlib.sha256(b"pdserve-kv-rendezvous" + secret).hexdigest()[:32]   # PrefixStore adds the "/"


def proof(secret: bytes, role: bytes, nonce: bytes) -> str:
    return hmac.new(secret, b"pdserve-kv-" + role + nonce, hashlib.sha256).hexdigest()


def proves(secret: bytes, role: bytes, nonce: bytes, claimed: object) -> bool:
    """Does `claimed` (from the wire, any type) show that its author holds `secret`?"""
    return isinstance(claimed, str) and hmac.compare_digest(claimed.encode(), proof(secret, role, nonce).encode())


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


def send_hello(groups: ChannelGroups, hello: Hello, peer_id: str, deadline: float,
               secret: bytes) -> Agreement:
    """Sender side: Hello out, Verdict in; HandshakeMismatch when the receiver refused, or did
    not prove the secret (then it is not the receiver Ray named, and gets no KV)."""
    frame = torch.empty(HANDSHAKE_BYTES, dtype=torch.uint8)
    nonce = secrets.token_bytes(16)
    encode_json(frame, hello.to_dict() | {"nonce": nonce.hex(), "proof": proof(secret, b"sender", nonce)})
    wait_for(groups.send(frame, TAG_HANDSHAKE), deadline,
             "sending the handshake")
    wait_for(groups.recv(frame, TAG_HANDSHAKE), deadline,
             "waiting for the handshake verdict")
    verdict = decode_json(frame)
    if not verdict["accepted"]:
        raise HandshakeMismatch(peer_id, None, f"refused by the receiver: {verdict['reason']}")
    if not proves(secret, b"receiver", nonce, verdict.get("proof")):
        raise HandshakeMismatch(peer_id, None, "the receiver did not prove the channel secret: not the "
                                               "decode worker this rendezvous belongs to")
    return Agreement(verdict["backend"], verdict["slot_blocks"], verdict["checksum"],
                     hello.heartbeat_s)


def _authenticated_hello(frame: torch.Tensor, secret: bytes) -> tuple[dict, bytes]:
    """The Hello's fields and nonce; HandshakeMismatch(STRANGER) unless it proves the secret."""
    try:
        raw = decode_json(frame)
        nonce = bytes.fromhex(raw["nonce"])
    except (FrameError, ValueError, KeyError, TypeError):  # not even a Hello
        raise HandshakeMismatch("", None, STRANGER) from None
    if not proves(secret, b"sender", nonce, raw.get("proof")):
        raise HandshakeMismatch("", None, STRANGER)
    return raw, nonce


def answer_hello(groups: ChannelGroups, receiver: Hello, peer_id: str,
                 deadline: float, secret: bytes) -> Agreement:
    """Receiver side: Hello in, Verdict out; raises HandshakeMismatch after refusing. The proof
    is checked before any other field of the Hello is looked at."""
    frame = torch.empty(HANDSHAKE_BYTES, dtype=torch.uint8)
    wait_for(groups.recv(frame, TAG_HANDSHAKE), deadline,
             "waiting for the sender's handshake")
    refusal: HandshakeMismatch | None = None
    try:
        raw, nonce = _authenticated_hello(frame, secret)
        agreement = decide(receiver, Hello.from_dict(raw))
        verdict = {"accepted": True, **vars(agreement), "proof": proof(secret, b"receiver", nonce)}
    except HandshakeMismatch as err:
        refusal = HandshakeMismatch(peer_id, None, err.reason)
        verdict = {"accepted": False, "reason": "not authenticated" if err.reason == STRANGER else err.reason}
    encode_json(frame, verdict)
    wait_for(groups.send(frame, TAG_HANDSHAKE), deadline,
             "sending the handshake verdict")
    if refusal is not None:
        raise refusal
    return agreement
