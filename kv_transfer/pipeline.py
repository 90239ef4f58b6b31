"""Pipelined payload movement: pool blocks -> data group -> pool blocks, staged only when needed.

A transfer of n blocks goes as ceil(n / chunk_blocks) chunks, each one message on TAG_DATA.
Both ends derive the same chunk list from (num_blocks, chunk_blocks) in the header. Each end
decides alone how to move a chunk: blocks with consecutive ids (one block always is) go from
the pool, or into it, in place — no copy; others are gathered into, or scattered from, a
staging slot. Up to `len(slots)` chunks are in flight, so gathering chunk i+1 (sender) and
scattering chunk i-1 (receiver) overlap the wire. Staging is allocated once per channel.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kv_transfer.config import KVTransferConfig
from kv_transfer.frames import TAG_DATA
from kv_transfer.groups import ChannelGroups
from kv_transfer.layout import BlockCopier, Digest, KVLayout

PIPELINE_CHUNKS = 8          # split a transfer into at least this many chunks, ...
MIN_CHUNK_BYTES = 1 << 20    # ... none smaller (a gloo message costs a rendezvous, 0.1-0.5 ms)


class Staging:
    """A channel side's fixed staging memory: `num_slots` slots of `slot_blocks` blocks each."""

    def __init__(self, num_slots: int, slot_blocks: int, bytes_per_block: int,
                 device: torch.device, pin: bool) -> None:
        assert num_slots >= 2 and slot_blocks >= 1, "staging needs >= 2 slots of >= 1 block"
        self.slot_blocks = slot_blocks
        self.slot_bytes = slot_blocks * bytes_per_block
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device,
                                  pin_memory=pin) for _ in range(num_slots)]


@dataclass
class DataPath:
    """One channel side's copy machinery: copier, staging slots, and a CUDA side stream so
    copies neither wait behind nor block the worker's compute stream."""

    copier: BlockCopier
    staging: Staging
    stream: torch.cuda.Stream | None

    @classmethod
    def build(cls, kv: torch.Tensor, backend: str, slot_blocks: int,
              config: KVTransferConfig) -> DataPath:
        wire = kv.device if backend == "nccl" else torch.device("cpu")
        bytes_per_block = KVLayout.of(kv).bytes_per_block
        copier = BlockCopier(kv, wire, slot_blocks * bytes_per_block)
        pin = kv.is_cuda and wire.type == "cpu"
        staging = Staging(config.staging_slots, slot_blocks, bytes_per_block, wire, pin)
        stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None
        return cls(copier, staging, stream)

    def on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()

    def synchronize(self) -> None:
        """Block until the copies issued on the side stream are done (KV visible to all)."""
        if self.stream is not None:
            self.stream.synchronize()


def local_slot_blocks(kv: torch.Tensor, config: KVTransferConfig) -> int:
    """Blocks per staging slot this side offers: at least one (even for huge blocks), at most
    the pool (a small pool does not get staging bigger than itself)."""
    return max(1, min(config.slot_bytes // KVLayout.of(kv).bytes_per_block, kv.shape[0]))


def plan_chunk_blocks(num_blocks: int, bytes_per_block: int, slot_blocks: int) -> int:
    """Blocks per chunk: one when a block alone is a worthwhile message (each then moves in place,
    whatever the ids), else enough for MIN_CHUNK_BYTES and about PIPELINE_CHUNKS chunks."""
    if bytes_per_block >= MIN_CHUNK_BYTES:
        return 1
    smallest = math.ceil(MIN_CHUNK_BYTES / bytes_per_block)
    return max(1, min(slot_blocks, max(math.ceil(num_blocks / PIPELINE_CHUNKS), smallest)))


def chunk_spans(num_blocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """(first position, block count) of each chunk."""
    return [(start, min(chunk_blocks, num_blocks - start))
            for start in range(0, num_blocks, chunk_blocks)]


def send_chunks(groups: ChannelGroups, staging: Staging, copier: BlockCopier,
                block_ids: list[int], chunk_blocks: int, deadline: float,
                digest: Digest | None) -> deque[dist.Work]:
    """Returns the sends still in flight. The caller waits for them after the receiver's
    reply (by then they are done): one wake-up less on a small transfer's critical path."""
    in_flight: deque[dist.Work] = deque()
    for index, (start, count) in enumerate(chunk_spans(len(block_ids), chunk_blocks)):
        if len(in_flight) == len(staging.slots):   # the slot we are about to refill
            groups.wait_data(in_flight.popleft(), deadline, "sending a payload chunk")
        ids = block_ids[start:start + count]
        payload = copier.in_place(ids)
        if payload is None:
            payload = copier.gather(ids, staging.slots[index % len(staging.slots)])
        if digest is not None:
            digest.update(payload, count)
        in_flight.append(groups.send(payload, TAG_DATA, data=True))
    return in_flight


def recv_chunks(groups: ChannelGroups, staging: Staging, copier: BlockCopier,
                num_blocks: int, dst_block_ids: list[int] | None, chunk_blocks: int,
                deadline: float, digest: Digest | None) -> None:
    """Receive a payload into dst_block_ids; None drains it (a rejected transfer)."""
    spans = chunk_spans(num_blocks, chunk_blocks)
    num_slots = len(staging.slots)
    posted: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def post(index: int) -> None:
        start, count = spans[index]
        view = None if dst_block_ids is None else copier.in_place(dst_block_ids[start:start + count])
        landed = view is not None  # straight into the pool: nothing to scatter
        if view is None:
            view = staging.slots[index % num_slots][:count * copier.layout.bytes_per_block]
        posted.append((groups.recv(view, TAG_DATA, data=True), view, landed))

    for index in range(min(num_slots, len(spans))):
        post(index)
    for index, (start, count) in enumerate(spans):
        work, view, landed = posted.popleft()
        groups.wait_data(work, deadline, "receiving a payload chunk")
        if digest is not None:
            digest.update(view, count)
        if dst_block_ids is not None and not landed:
            copier.scatter(view, dst_block_ids[start:start + count])
        if index + num_slots < len(spans):
            post(index + num_slots)
