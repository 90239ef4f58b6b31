"""kv_transfer: channels between real processes (Ray actors), plus in-process protocol checks.

Ray tests share one Ray instance (module fixture) and one 3 prefill x 2 decode float32 pool
of actors; failure tests start their own victims. Toy KV: 3 layers, blocks of 4 tokens x 2
heads x 16 dims; staging of 64 KiB so 300 blocks go as dozens of pipelined chunks.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time

import pytest
import ray
import torch

from kv_transfer import (
    HandshakeMismatch,
    KVReceiver,
    KVSender,
    KVTransferConfig,
    KVTransferError,
)
from kv_transfer.frames import Header, Kind, Reply, Status
from kv_transfer.groups import DeviceInfo, resolve_backend
from kv_transfer.layout import Digest, KVLayout, contiguous_runs
from kv_transfer.pipeline import chunk_spans, plan_chunk_blocks

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

SHAPE = dict(layers=3, block_size=4, kv_heads=2, head_dim=16)
CONFIG = KVTransferConfig(timeout_s=5.0, heartbeat_s=0.5, staging_bytes=64 << 10)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_pool(num_blocks: int, dtype: torch.dtype, seed: int | None = None,
              layers: int = SHAPE["layers"]) -> torch.Tensor:
    shape = (layers, 2, num_blocks, SHAPE["block_size"], SHAPE["kv_heads"], SHAPE["head_dim"])
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def as_bits(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.uint8)


@ray.remote
class DecodeActor:
    """A decode worker's KV side: pool, allocator, receiver; frees blocks on failed transfers."""

    def __init__(self, num_blocks: int, dtype: str, config: KVTransferConfig,
                 device: str = "cpu") -> None:
        self.kv = make_pool(num_blocks, DTYPES[dtype]).to(device)
        self.free = set(range(num_blocks))
        self.reserved: dict[str, list[int]] = {}
        self.landed: dict[str, int] = {}        # request -> times on_complete said "landed"
        self.failed: dict[str, str] = {}
        self.resolving: list[str] = []
        self.released = threading.Event()   # cleared: resolve_blocks holds transfers
        self.released.set()
        self.lock = threading.Lock()
        self.receiver = KVReceiver(self.kv, ray.util.get_node_ip_address(), config,
                                   self._resolve, self._on_complete)

    def _resolve(self, request_id: str, num_blocks: int) -> list[int] | None:
        self.resolving.append(request_id)
        self.released.wait(timeout=60)
        with self.lock:
            return self.reserved.get(request_id)

    def _on_complete(self, request_id: str, blocks: list[int], error: BaseException | None):
        with self.lock:
            if error is None:
                self.landed[request_id] = self.landed.get(request_id, 0) + 1
                return
            self.failed[request_id] = str(error)
            self.free.update(self.reserved.pop(request_id))

    def reserve(self, request_id: str, num_blocks: int, seed: int) -> list[int]:
        with self.lock:
            blocks = random.Random(seed).sample(sorted(self.free), num_blocks)
            self.free.difference_update(blocks)
            self.reserved[request_id] = blocks
            return blocks

    def finish(self, request_id: str) -> None:
        with self.lock:
            self.free.update(self.reserved.pop(request_id))

    def hold_transfers(self, hold: bool) -> None:
        """hold=True parks the next transfers after their header (mid-transfer)."""
        self.released.clear() if hold else self.released.set()

    def open_channel(self, peer_id: str) -> tuple[str, int]:
        return self.receiver.open_channel(peer_id)

    def pool(self) -> torch.Tensor:
        return self.kv.cpu().clone()

    def state(self) -> dict:
        with self.lock:
            used = sum(len(blocks) for blocks in self.reserved.values())
            return {"free": len(self.free), "used": used, "total": self.kv.shape[2],
                    "landed": dict(self.landed), "failed": dict(self.failed),
                    "resolving": list(self.resolving),
                    "channels": self.receiver.num_channels}


@ray.remote
class PrefillActor:
    """A prefill worker's KV side: random pool, sender, frees source blocks when a transfer ends."""

    def __init__(self, num_blocks: int, dtype: str, seed: int, config: KVTransferConfig,
                 device: str = "cpu") -> None:
        self.kv = make_pool(num_blocks, DTYPES[dtype], seed).to(device)
        self.sender = KVSender(self.kv, config)
        self.held: dict[str, list[int]] = {}
        self.futures = {}
        self.done_order: dict[str, list[str]] = {}

    def connect(self, peer_id: str, host: str, port: int) -> None:
        self.sender.connect(peer_id, host, port)

    def start(self, peer_id: str, request_id: str, block_ids: list[int]) -> None:
        self.held[request_id] = block_ids
        future = self.sender.send(peer_id, request_id, block_ids)
        future.add_done_callback(lambda _: self._done(peer_id, request_id))
        self.futures[request_id] = future

    def _done(self, peer_id: str, request_id: str) -> None:
        self.done_order.setdefault(peer_id, []).append(request_id)
        self.held.pop(request_id)   # the owner frees its source blocks either way

    def outcome(self, request_id: str) -> dict:
        try:
            result = self.futures.pop(request_id).result(timeout=60)
        except KVTransferError as err:
            return {"error": str(err), "peer": err.peer_id, "request": err.request_id}
        return {"dst": result.dst_block_ids, "bytes": result.num_bytes}

    def transfer_many(self, jobs: list[tuple[str, str, list[int]]]) -> list[dict]:
        for peer_id, request_id, block_ids in jobs:
            self.start(peer_id, request_id, block_ids)
        return [self.outcome(request_id) for _, request_id, _ in jobs]

    def pool(self) -> torch.Tensor:
        return self.kv.cpu().clone()

    def backend(self, peer_id: str) -> str | None:
        return self.sender.backend(peer_id)

    def state(self) -> dict:
        return {"held": dict(self.held), "done_order": self.done_order,
                "channels": self.sender.num_channels}

    def is_connected(self, peer_id: str) -> bool:
        return self.sender.is_connected(peer_id)

    def close_channel(self, peer_id: str) -> None:
        self.sender.close_channel(peer_id, wait=True)

    def sender_shutdown(self) -> None:
        self.sender.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    # The actors live in this test module, which workers cannot import: ship them by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, num_gpus=torch.cuda.device_count(), include_dashboard=False,
             object_store_memory=100 << 20, log_to_driver=False)
    yield
    ray.shutdown()


def start_decode(num_blocks=800, dtype="float32", config=CONFIG):
    return DecodeActor.options(num_cpus=0).remote(num_blocks, dtype, config)


def start_prefill(seed, num_blocks=400, dtype="float32", config=CONFIG):
    return PrefillActor.options(num_cpus=0).remote(num_blocks, dtype, seed, config)


def link(prefill, prefill_id: str, decode, decode_id: str) -> None:
    host, port = ray.get(decode.open_channel.remote(prefill_id))
    ray.get(prefill.connect.remote(decode_id, host, port))


@pytest.fixture(scope="module")
def pool(ray_cluster):
    """3 prefill x 2 decode float32 actors, every pair linked."""
    prefills = {f"p{i}": start_prefill(seed=i) for i in range(3)}
    decodes = {f"d{i}": start_decode() for i in range(2)}
    for prefill_id, prefill in prefills.items():
        for decode_id, decode in decodes.items():
            link(prefill, prefill_id, decode, decode_id)
    return prefills, decodes


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def transfer_and_compare(prefill, decode, decode_id: str, request_id: str, num_blocks: int,
                         seed: int) -> None:
    """Random non-contiguous source blocks -> random non-contiguous reserved blocks."""
    src_kv, before = ray.get([prefill.pool.remote(), decode.pool.remote()])
    src = random.Random(seed).sample(range(src_kv.shape[2]), num_blocks)
    dst = ray.get(decode.reserve.remote(request_id, num_blocks, seed))
    ray.get(prefill.start.remote(decode_id, request_id, src))
    outcome = ray.get(prefill.outcome.remote(request_id))
    assert outcome.get("dst") == dst, outcome
    after = ray.get(decode.pool.remote())
    assert torch.equal(as_bits(after[:, :, dst]), as_bits(src_kv[:, :, src]))
    others = sorted(set(range(after.shape[2])) - set(dst))
    assert torch.equal(as_bits(after[:, :, others]), as_bits(before[:, :, others])), \
        "a block outside the reservation changed"
    ray.get(decode.finish.remote(request_id))


def check_bit_identical_transfers(prefill, decode, decode_id: str, tag: str) -> None:
    for index, num_blocks in enumerate([1, 7, 300]):
        transfer_and_compare(prefill, decode, decode_id, f"{tag}{num_blocks}", num_blocks,
                             seed=index)
    state = ray.get(decode.state.remote())
    assert all(state["landed"][f"{tag}{n}"] == 1 for n in (1, 7, 300)), state["landed"]
    assert state["free"] == state["total"] and state["used"] == 0


def test_blocks_arrive_bit_identical_float32(pool):
    prefills, decodes = pool
    check_bit_identical_transfers(prefills["p0"], decodes["d0"], "d0", "f32-")


def test_blocks_arrive_bit_identical_bfloat16(ray_cluster):
    prefill, decode = start_prefill(seed=7, dtype="bfloat16"), start_decode(dtype="bfloat16")
    link(prefill, "p", decode, "d")
    check_bit_identical_transfers(prefill, decode, "d", "bf16-")
    ray.kill(prefill)
    ray.kill(decode)


def test_concurrent_transfers_land_exactly_once(pool):
    prefills, decodes = pool
    rng = random.Random(1)
    jobs: dict[str, list[tuple[str, str, list[int]]]] = {p: [] for p in prefills}
    expected: dict[str, tuple[str, list[int], str, list[int]]] = {}
    for index in range(50):
        prefill_id, decode_id = rng.choice(sorted(prefills)), rng.choice(sorted(decodes))
        request_id, num_blocks = f"c{index}", rng.randint(1, 24)
        src = rng.sample(range(400), num_blocks)
        dst = ray.get(decodes[decode_id].reserve.remote(request_id, num_blocks, index))
        jobs[prefill_id].append((decode_id, request_id, src))
        expected[request_id] = (prefill_id, src, decode_id, dst)
    outcomes = ray.get([prefills[p].transfer_many.remote(jobs[p]) for p in prefills])

    for prefill_id, results in zip(prefills, outcomes, strict=True):
        for (_, request_id, _), outcome in zip(jobs[prefill_id], results, strict=True):
            assert outcome.get("dst") == expected[request_id][3], (request_id, outcome)
    src_pools = {p: ray.get(actor.pool.remote()) for p, actor in prefills.items()}
    dst_pools = {d: ray.get(actor.pool.remote()) for d, actor in decodes.items()}
    for request_id, (prefill_id, src, decode_id, dst) in expected.items():
        assert torch.equal(as_bits(dst_pools[decode_id][:, :, dst]),
                           as_bits(src_pools[prefill_id][:, :, src])), request_id
    for prefill_id, actor in prefills.items():   # one channel = one ordered queue
        state = ray.get(actor.state.remote())
        assert not state["held"]
        for decode_id in decodes:
            ours = [r for r in state["done_order"][decode_id] if r in expected]
            assert ours == [r for d, r, _ in jobs[prefill_id] if d == decode_id]
    for decode_id, actor in decodes.items():
        state = ray.get(actor.state.remote())
        mine = [r for r, e in expected.items() if e[2] == decode_id]
        assert {r: state["landed"].get(r) for r in mine} == {r: 1 for r in mine}
        assert not set(mine) & set(state["failed"])
        assert state["used"] == sum(len(expected[r][3]) for r in mine)
        assert state["free"] + state["used"] == state["total"]
        ray.get([actor.finish.remote(request_id) for request_id in mine])
        assert ray.get(actor.state.remote())["free"] == state["total"]


def kill_and_wait(actor) -> float:
    """ray.kill, then wait until the process is really gone; returns the time of the kill."""
    ray.kill(actor)
    killed = time.monotonic()

    def dead() -> bool:
        try:
            ray.get(actor.state.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return True
        return False

    wait_until(dead, 10, "the killed actor to be gone")
    return killed


def test_prefill_killed_mid_transfer(pool):
    """The decode side fails the transfer, frees its blocks, and accepts the restarted peer."""
    decode = pool[1]["d1"]
    channels = ray.get(decode.state.remote())["channels"]
    victim = start_prefill(seed=3)
    link(victim, "victim", decode, "d1")
    ray.get(decode.hold_transfers.remote(True))
    ray.get(decode.reserve.remote("k1", 40, 0))
    ray.get(victim.start.remote("d1", "k1", list(range(0, 80, 2))))
    wait_until(lambda: "k1" in ray.get(decode.state.remote())["resolving"], 10, "the header")
    killed = kill_and_wait(victim)
    ray.get(decode.hold_transfers.remote(False))   # the payload it now waits for never comes
    state = wait_until(lambda: "k1" in (s := ray.get(decode.state.remote()))["failed"] and s,
                       CONFIG.timeout_s + 2, "the decode side to fail the transfer")
    assert time.monotonic() - killed < CONFIG.timeout_s + 1.0
    assert "'k1'" in state["failed"]["k1"] and "'victim'" in state["failed"]["k1"]
    assert state["free"] == state["total"] and state["used"] == 0
    wait_until(lambda: ray.get(decode.state.remote())["channels"] == channels, 5,
               "the dead channel's teardown")

    restarted = start_prefill(seed=4)
    link(restarted, "victim", decode, "d1")
    transfer_and_compare(restarted, decode, "d1", "k2", 9, seed=5)
    ray.get(restarted.sender_shutdown.remote())
    ray.kill(restarted)


def test_decode_killed_mid_transfer(pool):
    """The prefill side's future fails naming peer and request, the source blocks are freed,
    the dead channel is gone, and a restarted decode worker is reachable again."""
    prefill = pool[0]["p2"]
    victim = start_decode()
    link(prefill, "p2", victim, "victim")
    ray.get(victim.hold_transfers.remote(True))
    ray.get(victim.reserve.remote("k3", 12, 0))
    ray.get(prefill.start.remote("victim", "k3", list(range(12))))
    wait_until(lambda: "k3" in ray.get(victim.state.remote())["resolving"], 10, "the header")
    killed = kill_and_wait(victim)
    outcome = ray.get(prefill.outcome.remote("k3"))
    assert time.monotonic() - killed < CONFIG.timeout_s + 1.0
    assert outcome["peer"] == "victim" and outcome["request"] == "k3", outcome
    assert "k3" not in ray.get(prefill.state.remote())["held"]   # source blocks freed
    assert not ray.get(prefill.is_connected.remote("victim"))

    restarted = start_decode()
    link(prefill, "p2", restarted, "victim")
    transfer_and_compare(prefill, restarted, "victim", "k4", 9, seed=6)
    ray.get(prefill.close_channel.remote("victim"))
    ray.kill(restarted)


class Owner:
    """In-process decode owner: fixed reservations, records every on_complete."""

    def __init__(self, reserved: dict[str, list[int]], resolve_delay_s: float = 0.0) -> None:
        self.reserved = reserved
        self.resolve_delay_s = resolve_delay_s
        self.completed: list[tuple[str, list[int], BaseException | None]] = []

    def resolve(self, request_id: str, num_blocks: int) -> list[int] | None:
        time.sleep(self.resolve_delay_s)
        return self.reserved.get(request_id)

    def complete(self, request_id: str, blocks: list[int], error: BaseException | None):
        self.completed.append((request_id, blocks, error))


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
        host, port = receiver.open_channel("p")
        return receiver, sender, host, port

    yield build
    for receiver, sender in made:
        sender.shutdown()
        receiver.shutdown()


def test_handshake_refuses_layout_mismatch(loopback):
    receiver, sender, host, port = loopback(
        Owner({}), src=make_pool(8, torch.bfloat16, seed=0, layers=2))
    with pytest.raises(HandshakeMismatch) as refused:
        sender.connect("d", host, port)
    message = str(refused.value)
    assert "'d'" in message
    assert "num_layers: receiver 3 != sender 2" in message
    assert "dtype: receiver float32 != sender bfloat16" in message
    assert not sender.is_connected("d")
    wait_until(lambda: receiver.num_channels == 0, 5, "the refused channel to close")


def test_handshake_refuses_backend_conflict(loopback):
    nccl = KVTransferConfig(backend="nccl", timeout_s=5.0)
    _, sender, host, port = loopback(Owner({}), sender_config=nccl)
    with pytest.raises(HandshakeMismatch, match="backend nccl needs CUDA pools"):
        sender.connect("d", host, port)


def test_rejected_request_keeps_channel_in_sync(loopback):
    owner = Owner({"ok": [5, 9], "short": [1]})
    receiver, sender, host, port = loopback(owner)
    sender.connect("d", host, port)
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


def test_transfer_cancelled_while_queued_is_skipped(loopback):
    owner = Owner({"first": [1], "cancelled": [2], "third": [3]}, resolve_delay_s=0.3)
    _, sender, host, port = loopback(owner)
    sender.connect("d", host, port)
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
    _, sender, host, port = loopback(owner, src=src, dst=dst, receiver_config=with_checksum)
    sender.connect("d", host, port)
    assert sender.send("d", "r", [7, 0, 63]).result(10).dst_block_ids == [3, 4, 60]
    assert torch.equal(dst[:, :, [3, 4, 60]], src[:, :, [7, 0, 63]])


def test_timeout_fails_both_sides_and_tears_down(loopback):
    fast = KVTransferConfig(timeout_s=1.0, heartbeat_s=0.5)
    owner = Owner({"slow": [1, 2]}, resolve_delay_s=1.5)
    receiver, sender, host, port = loopback(owner, receiver_config=fast, sender_config=fast)
    sender.connect("d", host, port)
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
    receiver, sender, host, port = loopback(Owner({}))
    sender.connect("d", host, port)
    receiver.shutdown(wait=True)   # idle channel: closes on the next heartbeat
    assert receiver.num_channels == 0
    wait_until(lambda: not sender.is_connected("d"), 3 * CONFIG.heartbeat_s + 2,
               "the sender to see CLOSING")
    with socket.socket() as probe:   # nobody listens on the rendezvous port any more
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # ignore TIME_WAIT
        probe.bind(("127.0.0.1", port))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_sender_close_ends_receiver_channel(loopback):
    receiver, sender, host, port = loopback(Owner({}))
    sender.connect("d", host, port)
    assert receiver.num_channels == 1 and sender.num_channels == 1
    sender.close_channel("d", wait=True)
    wait_until(lambda: receiver.num_channels == 0, 2, "the receiver to see CLOSE")


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
    chunk = make_pool(4, torch.float32, seed=2).view(6, 4, -1)   # [slabs, blocks, elems]

    def digest(tensor: torch.Tensor) -> int:
        d = Digest(slabs=6)
        d.update(tensor.contiguous().view(torch.uint8).view(-1), 4)
        return d.value

    swapped = chunk[:, [1, 0, 2, 3]]
    flipped = chunk.clone()
    flipped[5, 3, 7] += 1
    assert len({digest(chunk), digest(swapped), digest(flipped)}) == 3


def test_chunking_and_runs():
    assert contiguous_runs([4, 5, 6, 9, 2, 3]) == [(4, 0, 3), (9, 3, 1), (2, 4, 2)]
    assert chunk_spans(7, 3) == [(0, 3), (3, 3), (6, 1)]
    assert plan_chunk_blocks(1, 1 << 20, slot_blocks=16) == 1
    assert plan_chunk_blocks(512, 2 << 20, slot_blocks=8) == 8       # capped by the slot
    assert plan_chunk_blocks(64, 1 << 10, slot_blocks=4096) == 1024  # >= 1 MiB per message
    layout = KVLayout.of(make_pool(2, torch.bfloat16))
    assert layout.bytes_per_block == 3 * 2 * 4 * 2 * 16 * 2


def test_frames_round_trip():
    layout = KVLayout.of(make_pool(2, torch.float16))
    frame = torch.empty(512, dtype=torch.uint8)
    header = Header(Kind.TRANSFER, 7, "req-é", 300, 16, True, layout)
    header.encode_into(frame)
    assert Header.decode(frame) == header
    reply_frame = torch.empty(Reply.frame_bytes(3), dtype=torch.uint8)
    Reply(Status.OK, 7, [9, 1, 4], "").encode_into(reply_frame, 3)
    assert Reply.decode(reply_frame) == Reply(Status.OK, 7, [9, 1, 4], "")


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="the NCCL path needs >= 2 visible CUDA devices")
def test_nccl_between_two_gpus(ray_cluster):
    gpu = dict(num_cpus=0, num_gpus=1)
    prefill = PrefillActor.options(**gpu).remote(64, "bfloat16", 11, CONFIG, "cuda")
    decode = DecodeActor.options(**gpu).remote(64, "bfloat16", CONFIG, "cuda")
    link(prefill, "p", decode, "d")
    assert ray.get(prefill.backend.remote("d")) == "nccl"
    for index, num_blocks in enumerate([1, 7, 40]):
        transfer_and_compare(prefill, decode, "d", f"g{num_blocks}", num_blocks, seed=index)
    ray.kill(prefill)
    ray.kill(decode)
