"""kv_transfer: channels between real processes (Ray actors); in-process checks: test_kv_transfer_channel.py.

Ray tests share one Ray instance (module fixture) and one 3 prefill x 2 decode float32 pool
of actors; failure tests start their own victims. Toy KV: 3 layers, blocks of 4 tokens x 2
heads x 16 dims; staging of 64 KiB so 300 blocks go as dozens of pipelined chunks.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import ray
import torch

from kv_transfer import (
    KVReceiver,
    KVSender,
    KVTransferConfig,
    KVTransferError,
)
from tests.kv_util import CONFIG, DTYPES, as_bits, make_pool, wait_until


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

    def _resolve(self, request_id: str, num_blocks: int, first_block: int = 0) -> list[int] | None:
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

    def open_channel(self, peer_id: str) -> tuple[str, int, bytes]:
        return self.receiver.open_channel(peer_id)

    def pool(self) -> torch.Tensor:
        return self.kv.cpu().clone()

    def state(self) -> dict:
        with self.lock:
            used = sum(len(blocks) for blocks in self.reserved.values())
            return {"free": len(self.free), "used": used, "total": self.kv.shape[0],
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

    def connect(self, peer_id: str, host: str, port: int, secret: bytes) -> None:
        self.sender.connect(peer_id, host, port, secret)

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
def ray_cluster(ray_instance):
    # The actors live in this test module, which workers cannot import: ship them by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield


def start_decode(num_blocks=800, dtype="float32", config=CONFIG):
    return DecodeActor.options(num_cpus=0).remote(num_blocks, dtype, config)


def start_prefill(seed, num_blocks=400, dtype="float32", config=CONFIG):
    return PrefillActor.options(num_cpus=0).remote(num_blocks, dtype, seed, config)


SLACK_S = 5.0  # over a transfer's deadline, for a loaded CI machine; a hang would take far longer


def link(prefill, prefill_id: str, decode, decode_id: str) -> None:
    # Both actors up first: the rendezvous waits timeout_s for the sender, and a new actor's
    # process start (imports included) can take longer than that on a loaded machine.
    ray.get([prefill.state.remote(), decode.state.remote()])
    ray.get(prefill.connect.remote(decode_id, *ray.get(decode.open_channel.remote(prefill_id))))


@pytest.fixture(scope="module")
def pool(ray_cluster):
    """3 prefill x 2 decode float32 actors, every pair linked."""
    prefills = {f"p{i}": start_prefill(seed=i) for i in range(3)}
    decodes = {f"d{i}": start_decode() for i in range(2)}
    for prefill_id, prefill in prefills.items():
        for decode_id, decode in decodes.items():
            link(prefill, prefill_id, decode, decode_id)
    return prefills, decodes


def transfer_and_compare(prefill, decode, decode_id: str, request_id: str, num_blocks: int,
                         seed: int) -> None:
    """Random non-contiguous source blocks -> random non-contiguous reserved blocks."""
    src_kv, before = ray.get([prefill.pool.remote(), decode.pool.remote()])
    src = random.Random(seed).sample(range(src_kv.shape[0]), num_blocks)
    dst = ray.get(decode.reserve.remote(request_id, num_blocks, seed))
    ray.get(prefill.start.remote(decode_id, request_id, src))
    outcome = ray.get(prefill.outcome.remote(request_id))
    assert outcome.get("dst") == dst, outcome
    after = ray.get(decode.pool.remote())
    assert torch.equal(as_bits(after[dst]), as_bits(src_kv[src]))
    others = sorted(set(range(after.shape[0])) - set(dst))
    assert torch.equal(as_bits(after[others]), as_bits(before[others])), \
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
        assert torch.equal(as_bits(dst_pools[decode_id][dst]),
                           as_bits(src_pools[prefill_id][src])), request_id
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
    # A payload far bigger than the sockets can buffer (about 24 MiB): a small one may land
    # whole before the kill, and then there is no failure to see.
    big = 8000
    decode = start_decode(num_blocks=big)
    channels = ray.get(decode.state.remote())["channels"]
    victim = start_prefill(seed=3, num_blocks=big)
    link(victim, "victim", decode, "d1")
    ray.get(decode.hold_transfers.remote(True))
    ray.get(decode.reserve.remote("k1", big, 0))
    ray.get(victim.start.remote("d1", "k1", list(range(big))))
    wait_until(lambda: "k1" in ray.get(decode.state.remote())["resolving"], 10, "the header")
    killed = kill_and_wait(victim)
    ray.get(decode.hold_transfers.remote(False))   # the payload it now waits for never comes
    state = wait_until(lambda: "k1" in (s := ray.get(decode.state.remote()))["failed"] and s,
                       CONFIG.timeout_s + 10, "the decode side to fail the transfer")
    assert time.monotonic() - killed < CONFIG.timeout_s + SLACK_S  # within its deadline: no hang
    assert "'k1'" in state["failed"]["k1"] and "'victim'" in state["failed"]["k1"]
    assert state["free"] == state["total"] and state["used"] == 0
    wait_until(lambda: ray.get(decode.state.remote())["channels"] == channels, 5,
               "the dead channel's teardown")

    restarted = start_prefill(seed=4)
    link(restarted, "victim", decode, "d1")
    transfer_and_compare(restarted, decode, "d1", "k2", 9, seed=5)
    ray.get(restarted.sender_shutdown.remote())
    ray.kill(restarted)
    ray.kill(decode)


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
    assert time.monotonic() - killed < CONFIG.timeout_s + SLACK_S
    assert outcome["peer"] == "victim" and outcome["request"] == "k3", outcome
    assert "k3" not in ray.get(prefill.state.remote())["held"]   # source blocks freed
    assert not ray.get(prefill.is_connected.remote("victim"))

    restarted = start_decode()
    link(prefill, "p2", restarted, "victim")
    transfer_and_compare(prefill, restarted, "victim", "k4", 9, seed=6)
    ray.get(prefill.close_channel.remote("victim"))
    ray.kill(restarted)


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
