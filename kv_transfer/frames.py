"""Wire frames of a channel's control plane (always CPU uint8 tensors on the gloo group).

Protocol on one channel (sender = prefill = rank 1, receiver = decode = rank 0):
  handshake: Hello (1 -> 0, TAG_HANDSHAKE), Verdict (0 -> 1, TAG_HANDSHAKE).
  transfer:  Header (1 -> 0, TAG_CONTROL), payload chunks (1 -> 0, TAG_DATA, data group),
             [checksum trailer (1 -> 0, TAG_TRAILER)], Reply with dst ids (0 -> 1, TAG_REPLY).
  idle:      Header(kind=HEARTBEAT) -> Reply(OK | CLOSING);  Header(kind=CLOSE) -> no reply.
Headers are fixed-size so the receiver can always have the next one's recv posted.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from kv_transfer.layout import DTYPES, KVLayout

MAGIC = b"PDKV"
VERSION = 3
TAG_HANDSHAKE, TAG_CONTROL, TAG_REPLY, TAG_TRAILER, TAG_DATA = 1, 2, 3, 4, 5
HEADER_BYTES = 512
REPLY_FIXED_BYTES = 512
HANDSHAKE_BYTES = 4096
MAX_REQUEST_ID_BYTES = 256
_DTYPE_CODES = {name: code for code, name in enumerate(sorted(DTYPES), start=1)}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}

# magic, version, kind, dtype code, checksum, seq, num_blocks, chunk_blocks, first_block,
# layers, block_size, kv_heads, head_dim, request-id length
_HEADER = struct.Struct("<4sBBBBQIIIIIIIH")
# magic, version, status, seq, num_blocks, message length
_REPLY = struct.Struct("<4sBBQIH")


class Kind(IntEnum):
    TRANSFER = 1
    HEARTBEAT = 2
    CLOSE = 3


class Status(IntEnum):
    OK = 0
    REJECTED = 1   # receiver refused (unknown request, bad block count): stream stays in sync
    FAILED = 2     # payload arrived but is wrong (checksum)
    CLOSING = 3    # receiver is closing the channel (reply to a heartbeat)


class FrameError(ValueError):
    """A frame that is not ours or not this version: the stream is out of sync."""


@dataclass(frozen=True)
class Header:
    kind: Kind
    seq: int
    request_id: str = ""
    num_blocks: int = 0
    chunk_blocks: int = 0
    checksum: bool = False
    layout: KVLayout | None = None
    # the payload is the request's blocks [first_block, first_block + num_blocks): the
    # receiver already holds the leading ones (prefix cache), so they are not sent
    first_block: int = 0

    def encode_into(self, frame: torch.Tensor) -> None:
        rid = self.request_id.encode()
        assert len(rid) <= MAX_REQUEST_ID_BYTES, "request id length is checked in send()"
        lay = self.layout
        dims = (lay.num_layers, lay.block_size, lay.kv_heads, lay.head_dim) if lay else (0,) * 4
        dtype_code = _DTYPE_CODES[lay.dtype] if lay else 0
        buffer = frame.numpy()   # shares the tensor's memory: packed in place, no copies
        _HEADER.pack_into(buffer, 0, MAGIC, VERSION, self.kind, dtype_code, self.checksum,
                          self.seq, self.num_blocks, self.chunk_blocks, self.first_block, *dims, len(rid))
        buffer[_HEADER.size:_HEADER.size + len(rid)] = memoryview(rid)

    @classmethod
    def decode(cls, frame: torch.Tensor) -> Header:
        buffer = frame.numpy()
        (magic, version, kind, dtype_code, checksum, seq, num_blocks, chunk_blocks, first_block,
         layers, block_size, kv_heads, head_dim, rid_len) = _HEADER.unpack_from(buffer)
        _check_magic(magic, version)
        rid = buffer[_HEADER.size:_HEADER.size + rid_len].tobytes().decode()
        layout = None
        if dtype_code:
            layout = KVLayout(layers, block_size, kv_heads, head_dim, _DTYPE_NAMES[dtype_code])
        return cls(Kind(kind), seq, rid, num_blocks, chunk_blocks, bool(checksum), layout, first_block)


@dataclass(frozen=True)
class Reply:
    status: Status
    seq: int
    dst_block_ids: list[int]
    message: str = ""

    @staticmethod
    def frame_bytes(num_blocks: int) -> int:
        return REPLY_FIXED_BYTES + 8 * num_blocks

    def encode_into(self, frame: torch.Tensor, num_blocks: int) -> None:
        """`num_blocks` sizes the frame (the sender expects exactly that); ids may be empty."""
        message = self.message.encode()[:REPLY_FIXED_BYTES - _REPLY.size]
        buffer = frame.numpy()
        _REPLY.pack_into(buffer, 0, MAGIC, VERSION, self.status, self.seq, num_blocks,
                         len(message))
        buffer[_REPLY.size:_REPLY.size + len(message)] = memoryview(message)
        ids = buffer[REPLY_FIXED_BYTES:].view(np.int64)   # [num_blocks]
        ids[:] = self.dst_block_ids if self.dst_block_ids else 0

    @classmethod
    def decode(cls, frame: torch.Tensor) -> Reply:
        buffer = frame.numpy()
        magic, version, status, seq, num_blocks, msg_len = _REPLY.unpack_from(buffer)
        _check_magic(magic, version)
        message = buffer[_REPLY.size:_REPLY.size + msg_len].tobytes().decode(errors="replace")
        ids: list[int] = []
        if status == Status.OK:
            ids = buffer[REPLY_FIXED_BYTES:].view(np.int64)[:num_blocks].tolist()
        return cls(Status(status), seq, ids, message)


def encode_json(frame: torch.Tensor, payload: dict) -> None:
    """Handshake frames: a 4-byte length then UTF-8 JSON, in a HANDSHAKE_BYTES frame."""
    data = json.dumps(payload).encode()
    assert len(data) + 4 <= HANDSHAKE_BYTES, f"handshake payload of {len(data)} bytes too big"
    buffer = frame.numpy()
    struct.pack_into("<I", buffer, 0, len(data))
    buffer[4:4 + len(data)] = memoryview(data)


def decode_json(frame: torch.Tensor) -> dict:
    buffer = frame.numpy()
    (length,) = struct.unpack_from("<I", buffer)
    if length > HANDSHAKE_BYTES - 4:
        raise FrameError(f"handshake frame claims {length} bytes")
    return json.loads(buffer[4:4 + length].tobytes())


def _check_magic(magic: bytes, version: int) -> None:
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"unexpected frame (magic {magic!r}, version {version})")
