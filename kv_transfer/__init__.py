"""KV transfer: block-granular prefill -> decode channels over torch.distributed.

Each worker's KV pool is ONE tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim]
(float32 / bfloat16 / float16, cpu or cuda). A channel joins one prefill and one decode
worker through its own 2-rank process group built on a TCPStore the decode side hosts (no
global init_process_group), so workers join and leave while the cluster runs.

Decode side (owns the destination blocks):
    receiver = KVReceiver(kv, host, config, resolve_blocks, on_complete)
    host, port = receiver.open_channel(prefill_id)     # returns at once; hand to the peer
    receiver.close_channel(prefill_id); receiver.shutdown(); receiver.num_channels
  resolve_blocks(request_id, num_blocks) -> list[int] | None: the blocks reserved for the
    request; None (unknown / cancelled) rejects the transfer, the sender's future fails.
  on_complete(request_id, dst_block_ids, error): exactly once per list resolve_blocks
    returned, on the channel thread, BEFORE the sender's future resolves. error is None when
    the KV has fully landed; otherwise a KVTransferError and the owner frees the blocks.
  Both callbacks run on channel threads (one per prefill peer, concurrently): make them
  thread-safe and quick. Never free or reuse blocks between resolve_blocks returning them and
  on_complete; to cancel, mark the request and free in on_complete (or return None from
  resolve_blocks if the header has not arrived yet).

Prefill side (owns the source blocks):
    sender = KVSender(kv, config)
    sender.connect(decode_id, host, port)        # blocks until the handshake is done
    future = sender.send(decode_id, request_id, src_block_ids)   # Future[TransferResult]
    sender.is_connected(decode_id); sender.close_channel(decode_id); sender.shutdown()
  Transfers on one channel run in submission order; channels run concurrently. Keep the
  source blocks untouched until the future is done; on KVTransferError free them. A future
  cancelled while still queued is skipped. A failed channel is torn down (is_connected ->
  False); re-create it with receiver.open_channel + sender.connect. CUDA pools: send()
  records an event on the caller's current stream; the copy waits for it.

Failure: a transfer not done within config.timeout_s of reaching the wire fails with a
KVTransferError naming peer and request, on both sides; a dead peer fails in-flight work
at once (connection closed). Layout (layers, block shape, dtype) or backend disagreement
is refused at connect() with HandshakeMismatch. Backend "auto" = NCCL when both pools are
CUDA tensors on distinct GPUs, gloo otherwise; "gloo"/"nccl" force one.
"""

from __future__ import annotations

from kv_transfer.config import (
    HandshakeMismatch,
    KVTransferConfig,
    KVTransferError,
    TransferResult,
)
from kv_transfer.layout import KVLayout
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender

__all__ = [
    "HandshakeMismatch",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVTransferConfig",
    "KVTransferError",
    "TransferResult",
]
