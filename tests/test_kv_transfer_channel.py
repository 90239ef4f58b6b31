"""kv_transfer in one process over loopback: handshake refusals, rejection, cancellation,
checksums, timeouts, teardown, and the pure helpers (backend choice, digest, chunking, frames).
Toy KV as in test_kv_transfer.py."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from kv_transfer import (
    HandshakeMismatch,
    KVReceiver,
    KVSender,
    KVTransferConfig,
    KVTransferError,
    sender_channel,
)
from kv_transfer.frames import Header, Kind, Reply, Status
from kv_transfer.groups import DeviceInfo, resolve_backend
from kv_transfer.layout import BlockCopier, Digest, KVLayout, contiguous_runs
from kv_transfer.pipeline import chunk_spans, plan_chunk_blocks
from tests.kv_util import CONFIG, Owner, as_bits, make_pool, wait_until


@pytest.fixture
def loopback():
    """Builds (receiver, sender) pairs in this process over 127.0.0.1; shuts them all down."""
    made = []

    def build(owner: Owner, src: torch.Tensor | None = None, dst: torch.Tensor | None = None,
              receiver_config=CONFIG, sender_config=CONFIG):
        dst = make_pool(64, torch.float32) if dst is None else dst
        src = make_pool(64, torch.float32, seed=0) if src is None else src
        receiver = KVReceiver(dst, "127.0.0.1", receiver_config, owner.resolve, owner.complete)
        sender = KVSender(src, sender_config)
        made.append((receiver, sender))
        return receiver, sender, *receiver.open_channel("p")   # host, port, secret

    yield build
    for receiver, sender in made:
        sender.shutdown()
        receiver.shutdown()


def test_handshake_refuses_layout_mismatch(loopback):
    receiver, sender, host, port, secret = loopback(
        Owner({}), src=make_pool(8, torch.bfloat16, seed=0, layers=2))
    with pytest.raises(HandshakeMismatch) as refused:
        sender.connect("d", host, port, secret)
    message = str(refused.value)
    assert "'d'" in message
    assert "num_layers: receiver 3 != sender 2" in message
    assert "dtype: receiver float32 != sender bfloat16" in message
    assert not sender.is_connected("d")
    wait_until(lambda: receiver.num_channels == 0, 5, "the refused channel to close")


def test_handshake_refuses_backend_conflict(loopback):
    nccl = KVTransferConfig(backend="nccl", timeout_s=5.0)
    _, sender, host, port, secret = loopback(Owner({}), sender_config=nccl)
    with pytest.raises(HandshakeMismatch, match="backend nccl needs CUDA pools"):
        sender.connect("d", host, port, secret)


def test_rejected_request_keeps_channel_in_sync(loopback):
    owner = Owner({"ok": [5, 9], "short": [1]})
    receiver, sender, host, port, secret = loopback(owner)
    sender.connect("d", host, port, secret)
    unknown = sender.send("d", "cancelled", [1, 2, 3])
    short = sender.send("d", "short", [1, 2])
    good = sender.send("d", "ok", [10, 20])
    with pytest.raises(KVTransferError, match="rejected by the receiver: request unknown"):
        unknown.result(10)
    with pytest.raises(KVTransferError, match="reserved 1 blocks, sender sent 2"):
        short.result(10)
    assert good.result(10).dst_block_ids == [5, 9]
    assert [(r, b, e is None) for r, b, e in owner.completed] == [
        ("short", [1], False), ("ok", [5, 9], True)]   # once per list resolve_blocks returned


def test_tail_transfer_lands_after_the_blocks_the_receiver_holds(loopback):
    """A prefix-cache hit on the decode side: only the request's blocks [2:] travel."""
    src = make_pool(64, torch.float32, seed=0)
    dst = make_pool(64, torch.float32)
    owner = Owner({"tail": [40, 41, 42, 43, 44]})
    _, sender, host, port, secret = loopback(owner, src=src, dst=dst)
    sender.connect("d", host, port, secret)
    before = dst[[40, 41]].clone()
    result = sender.send("d", "tail", [7, 8, 9], first_block=2).result(10)
    assert owner.first_blocks == {"tail": 2}
    assert result.dst_block_ids == [42, 43, 44]
    assert result.num_bytes == 3 * dst[0].numel() * dst.element_size()
    assert torch.equal(dst[[42, 43, 44]], src[[7, 8, 9]])
    assert torch.equal(dst[[40, 41]], before)  # the held blocks are not touched
    with pytest.raises(ValueError, match="first_block -1"):
        sender.send("d", "tail", [7], first_block=-1)


def test_transfer_cancelled_while_queued_is_skipped(loopback):
    owner = Owner({"first": [1], "cancelled": [2], "third": [3]}, resolve_delay_s=0.3)
    _, sender, host, port, secret = loopback(owner)
    sender.connect("d", host, port, secret)
    first = sender.send("d", "first", [10])
    cancelled = sender.send("d", "cancelled", [11])
    third = sender.send("d", "third", [12])
    assert cancelled.cancel()   # still queued behind "first"
    assert first.result(10).dst_block_ids == [1] and third.result(10).dst_block_ids == [3]
    assert [request_id for request_id, _, _ in owner.completed] == ["first", "third"]


def test_checksum_requested_by_receiver_only(loopback):
    owner = Owner({"r": [3, 4, 60]})
    src = make_pool(64, torch.float32, seed=1)
    dst = make_pool(64, torch.float32)
    with_checksum = KVTransferConfig(timeout_s=5.0, checksum=True, staging_bytes=8 << 10)
    _, sender, host, port, secret = loopback(owner, src=src, dst=dst, receiver_config=with_checksum)
    sender.connect("d", host, port, secret)
    assert sender.send("d", "r", [7, 0, 63]).result(10).dst_block_ids == [3, 4, 60]
    assert torch.equal(dst[[3, 4, 60]], src[[7, 0, 63]])


class _CorruptingDigest(Digest):
    """The sender's digest, which flips one payload byte after hashing the first chunk it sees:
    the checksum trailer then describes bytes that differ from what goes on the wire."""

    armed = True

    def update(self, chunk: torch.Tensor, num_blocks: int) -> None:
        super().update(chunk, num_blocks)
        if _CorruptingDigest.armed:
            _CorruptingDigest.armed = False
            chunk[5] ^= 0x10


def test_corrupted_payload_fails_both_sides_and_channel_stays_usable(loopback, monkeypatch):
    monkeypatch.setattr(_CorruptingDigest, "armed", True)
    monkeypatch.setattr(sender_channel, "Digest", _CorruptingDigest)   # the receiver keeps the real one
    owner = Owner({"bad": [3, 4, 60], "good": [10, 11]})
    src = make_pool(64, torch.float32, seed=1)
    dst = make_pool(64, torch.float32)
    with_checksum = KVTransferConfig(timeout_s=5.0, checksum=True, staging_bytes=8 << 10)
    receiver, sender, host, port, secret = loopback(owner, src=src, dst=dst, receiver_config=with_checksum)
    sender.connect("d", host, port, secret)
    with pytest.raises(KVTransferError, match="failed by the receiver: checksum mismatch"):
        sender.send("d", "bad", [7, 0, 63]).result(10)
    assert not _CorruptingDigest.armed, "the payload was never corrupted"
    (request_id, blocks, error), = owner.completed
    assert (request_id, blocks) == ("bad", [3, 4, 60])
    assert isinstance(error, KVTransferError) and "checksum mismatch" in str(error)
    assert sender.is_connected("d") and receiver.num_channels == 1
    assert sender.send("d", "good", [5, 6]).result(10).dst_block_ids == [10, 11]
    assert [(r, e is None) for r, _, e in owner.completed] == [("bad", False), ("good", True)]
    assert torch.equal(as_bits(dst[[10, 11]]), as_bits(src[[5, 6]]))


def test_timeout_fails_both_sides_and_tears_down(loopback):
    fast = KVTransferConfig(timeout_s=1.0, heartbeat_s=0.5)
    owner = Owner({"slow": [1, 2]}, resolve_delay_s=1.5)
    receiver, sender, host, port, secret = loopback(owner, receiver_config=fast, sender_config=fast)
    sender.connect("d", host, port, secret)
    started = time.monotonic()
    future = sender.send("d", "slow", [3, 4])
    with pytest.raises(KVTransferError, match="request 'slow' with peer 'd'.*timed out"):
        future.result(10)
    assert time.monotonic() - started < fast.timeout_s + 0.5
    assert not sender.is_connected("d")
    wait_until(lambda: owner.completed, 2 * fast.timeout_s + 1, "the receiver's failure")
    (request_id, blocks, error), = owner.completed
    assert (request_id, blocks) == ("slow", [1, 2]) and isinstance(error, KVTransferError)
    wait_until(lambda: receiver.num_channels == 0, 5, "the receiver's teardown")


def test_send_without_channel_fails_future():
    sender = KVSender(make_pool(4, torch.float32), CONFIG)
    with pytest.raises(KVTransferError, match="no channel to this peer"):
        sender.send("nobody", "r", [0]).result(1)
    with pytest.raises(ValueError, match="outside"):
        sender.send("nobody", "r", [4])


def test_close_releases_port_and_tells_the_sender(loopback):
    receiver, sender, host, port, secret = loopback(Owner({}))
    sender.connect("d", host, port, secret)
    receiver.shutdown(wait=True)   # idle channel: closes on the next heartbeat
    assert receiver.num_channels == 0
    wait_until(lambda: not sender.is_connected("d"), 3 * CONFIG.heartbeat_s + 2,
               "the sender to see CLOSING")
    # nobody listens on the rendezvous port any more (once the store's last reference is gone).
    # Not "bindable": the store's accepted connections may leave TIME_WAIT sockets on the port
    # that refuse a bind for a minute even with SO_REUSEADDR, though nothing listens there.
    wait_until(lambda: _refused(port), 5, "the rendezvous port to be released")


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sender_close_ends_receiver_channel(loopback):
    receiver, sender, host, port, secret = loopback(Owner({}))
    sender.connect("d", host, port, secret)
    assert receiver.num_channels == 1 and sender.num_channels == 1
    sender.close_channel("d", wait=True)
    wait_until(lambda: receiver.num_channels == 0, 10, "the receiver to see CLOSE")  # bounds a hang only


def test_backend_resolution():
    cpu, gpu0, gpu1 = DeviceInfo("cpu", None), DeviceInfo("cuda", "a"), DeviceInfo("cuda", "b")
    nccl = torch.distributed.is_nccl_available()
    assert resolve_backend("auto", "auto", cpu, cpu) == "gloo"
    assert resolve_backend("auto", "auto", gpu0, gpu0) == "gloo"   # one GPU: no NCCL p2p
    assert resolve_backend("auto", "auto", gpu0, gpu1) == ("nccl" if nccl else "gloo")
    assert resolve_backend("gloo", "auto", gpu0, gpu1) == "gloo"
    with pytest.raises(ValueError, match="sender forces gloo, receiver forces nccl"):
        resolve_backend("gloo", "nccl", gpu0, gpu1)
    with pytest.raises(ValueError, match="distinct GPUs"):
        resolve_backend("auto", "nccl", cpu, gpu1)


def test_digest_sees_reordered_and_flipped_blocks():
    chunk = make_pool(4, torch.float32, seed=2).view(4, -1)   # [blocks, elems]: block-major

    def digest(tensor: torch.Tensor) -> int:
        d = Digest()
        d.update(tensor.contiguous().view(torch.uint8).view(-1), 4)
        return d.value

    swapped = chunk[[1, 0, 2, 3]]
    flipped = chunk.clone()
    flipped[3, 7] += 1
    assert len({digest(chunk), digest(swapped), digest(flipped)}) == 3


def test_chunking_and_runs():
    assert contiguous_runs([4, 5, 6, 9, 2, 3]) == [(4, 0, 3), (9, 3, 1), (2, 4, 2)]
    assert chunk_spans(7, 3) == [(0, 3), (3, 3), (6, 1)]
    assert plan_chunk_blocks(1, 1 << 20, slot_blocks=16) == 1
    assert plan_chunk_blocks(512, 2 << 20, slot_blocks=8) == 1       # a 2 MiB block moves alone, in place
    assert plan_chunk_blocks(512, 64 << 10, slot_blocks=8) == 8      # small blocks: capped by the slot
    assert plan_chunk_blocks(64, 1 << 10, slot_blocks=4096) == 1024  # >= 1 MiB per message
    layout = KVLayout.of(make_pool(2, torch.bfloat16))
    assert layout.bytes_per_block == 3 * 2 * 4 * 2 * 16 * 2


def test_consecutive_blocks_move_in_place_and_others_through_staging():
    kv = make_pool(8, torch.float32, seed=3)
    copier = BlockCopier(kv, kv.device, 4 * KVLayout.of(kv).bytes_per_block)
    run = copier.in_place([2, 3, 4])
    assert run is not None and run.data_ptr() == kv[2].data_ptr()  # the pool's own bytes: no copy
    assert torch.equal(run, kv[2:5].contiguous().view(-1).view(torch.uint8))
    assert copier.in_place([2, 4]) is None and copier.in_place([5, 4]) is None
    slot = torch.empty(4 * KVLayout.of(kv).bytes_per_block, dtype=torch.uint8)
    gathered = copier.gather([6, 1], slot)
    assert torch.equal(gathered.view(torch.float32).view(2, -1), kv[[6, 1]].reshape(2, -1))
    other = make_pool(8, torch.float32)
    BlockCopier(other, other.device, slot.numel()).scatter(gathered, [0, 7])
    assert torch.equal(other[[0, 7]], kv[[6, 1]]) and not other[1:7].any()


def test_frames_round_trip():
    layout = KVLayout.of(make_pool(2, torch.float16))
    frame = torch.empty(512, dtype=torch.uint8)
    header = Header(Kind.TRANSFER, 7, "req-é", 300, 16, True, layout, first_block=41)
    header.encode_into(frame)
    assert Header.decode(frame) == header
    reply_frame = torch.empty(Reply.frame_bytes(3), dtype=torch.uint8)
    Reply(Status.OK, 7, [9, 1, 4], "").encode_into(reply_frame, 3)
    assert Reply.decode(reply_frame) == Reply(Status.OK, 7, [9, 1, 4], "")
