"""KV transfer: block-granular prefill -> decode channels over torch.distributed.

Each worker's KV pool is ONE tensor [num_blocks, layers, 2, block_size, kv_heads, head_dim]
(float32 / bfloat16 / float16, cpu or cuda). A channel joins one prefill and one decode
worker through its own 2-rank process group built on a TCPStore the decode side hosts (no
global init_process_group), so workers join and leave while the cluster runs.

Decode side (owns the destination blocks):
    receiver = KVReceiver(kv, host, config, resolve_blocks, on_complete)
    host, port, secret = receiver.open_channel(prefill_id)   # a Rendezvous, at once; to the peer via Ray
    receiver.close_channel(prefill_id, wait=False); receiver.shutdown(wait=True)
    receiver.num_channels
  `host` is the decode worker's reachable address (e.g. ray.util.get_node_ip_address());
  each channel binds its own port (port 0, read back while held) until it closes.
  resolve_blocks(request_id, num_blocks, first_block) -> list[int] | None: where the
    request's blocks [first_block, first_block + num_blocks) go; None (unknown / cancelled) rejects the transfer and the sender's future fails.
  on_complete(request_id, dst_block_ids, error): exactly once per list resolve_blocks
    returned, on the channel thread, BEFORE the sender's future resolves. error is None when
    the KV has fully landed; otherwise a KVTransferError and the owner frees the blocks.
  Both callbacks run on channel threads (one per prefill peer, concurrently): make them
  thread-safe and quick. Never free or reuse blocks between resolve_blocks returning them and
  on_complete; to cancel, mark the request and free in on_complete (or return None from
  resolve_blocks if the header has not arrived yet). An idle channel closes at the next
  heartbeat (<= heartbeat_s); one mid-transfer finishes that transfer first.

Prefill side (owns the source blocks):
    sender = KVSender(kv, config)
    sender.connect(decode_id, host, port, secret)   # blocks until the handshake is done
  The secret (random, one per channel) is what keeps strangers off the channel: the rendezvous
  keys hide under a prefix derived from it and each side proves it with an HMAC in the handshake
  before any header or payload is read (handshake.py; the trust boundary: docs/security.md).
    future = sender.send(decode_id, request_id, src_block_ids, first_block=0)   # Future[TransferResult]
  first_block > 0 sends only the tail of a request whose leading blocks the receiver holds.
    sender.is_connected(decode_id); sender.backend(decode_id)    # "gloo" | "nccl" | None
    sender.close_channel(decode_id, wait=False); sender.shutdown(wait=True); sender.num_channels
  TransferResult: request_id, dst_block_ids, num_bytes, seconds (on the wire),
  queued_seconds (behind earlier transfers of the channel).
  Transfers on one channel run in submission order, one at a time; channels run
  concurrently. Keep the source blocks untouched until the future is done, then free them
  (result or error). Future.cancel() on a still-queued transfer skips it. A failed channel
  is torn down before its futures fail (is_connected is already False): re-create it with
  receiver.open_channel + sender.connect. send() to an unconnected peer returns a failed
  future; bad block ids raise ValueError. CUDA pools: send() records an event on the
  caller's current stream and the copy waits for it.

Emulated link (config.pace, a LinkPace): the receiver completes each transfer no sooner than
its modelled time after its blocks were resolved (kv_transfer/pace.py); receiver.link_stats()
counts transfers, overruns and lateness.

Failure: a transfer not done within config.timeout_s of reaching the wire fails with a
KVTransferError naming peer and request, on both sides; a dead peer fails in-flight work
at once (connection closed) and an idle one within max(timeout_s, 5 * heartbeat_s).
Layout (layers, block shape, dtype) or backend disagreement is refused at connect() with
HandshakeMismatch. Backend "auto" = NCCL when both pools are CUDA tensors on distinct GPUs,
gloo otherwise; "gloo"/"nccl" force one (control frames always travel over gloo).
"""

from __future__ import annotations

import importlib
import typing

from kv_transfer.config import (
    HandshakeMismatch,
    KVTransferConfig,
    KVTransferError,
    LinkPace,
    TransferResult,
)

if typing.TYPE_CHECKING:
    from kv_transfer.handshake import Rendezvous
    from kv_transfer.layout import KVLayout
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.sender import KVSender

# the channel classes need torch: imported on first use, so the config types (read by the router's
# config loader and the CLI before they know they will start anything) cost no torch import
_LAZY = {"Rendezvous": "kv_transfer.handshake", "KVLayout": "kv_transfer.layout",
         "KVReceiver": "kv_transfer.receiver", "KVSender": "kv_transfer.sender"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")


__all__ = [
    "HandshakeMismatch",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVTransferConfig",
    "KVTransferError",
    "LinkPace",
    "Rendezvous",
    "TransferResult",
]
