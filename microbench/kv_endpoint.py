"""microbench/kv_transfer.py's two ends: a KV pool's shape (Llama-3.1-8B's by default) and the Ray
actor that holds one end's pool and runs the channel, the raw baseline and the object-store path
on it."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import ray
import torch

from kv_transfer import KVReceiver, KVSender, KVTransferConfig
from kv_transfer.groups import (
    gloo_group,
    interface_address,
    join_store,
    local_address_towards,
    nccl_group,
    open_store,
)
from kv_transfer.layout import BlockCopier, KVLayout

CALL_TIMEOUT_S = 600.0  # the longest one actor call may take (a whole 256 MiB sweep on a slow host)


def within_deadline(refs):
    """ray.get with the deadline every cross-process wait has."""
    return ray.get(refs, timeout=CALL_TIMEOUT_S)


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    block_size: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    def pool(self, num_blocks: int, device: str, fill: bool) -> torch.Tensor:
        dims = (num_blocks, self.layers, 2, self.block_size, self.kv_heads, self.head_dim)
        kv = torch.empty(dims, dtype=getattr(torch, self.dtype), device=device)
        return kv.normal_() if fill else kv.zero_()


@ray.remote
class Endpoint:
    """One side of the benchmark: a KV pool, a channel end, a raw group end."""

    def __init__(self, shape: Shape, num_blocks: int, config: KVTransferConfig, device: str,
                 sender: bool) -> None:
        self.kv = shape.pool(num_blocks, device, fill=sender)
        self.host = (interface_address(config.interface) if config.interface
                     else ray.util.get_node_ip_address())
        self.config, self.device = config, device
        self.destinations: dict[int, list[int]] = {}
        self.copier = BlockCopier(self.kv, self.kv.device, 0)
        if sender:
            self.sender = KVSender(self.kv, config)
        else:
            self.receiver = KVReceiver(self.kv, self.host, config, self._resolve,
                                       lambda *_: None)
        self.raw = None

    def node(self) -> str:
        return self.host

    def _resolve(self, request_id: str, num_blocks: int, first_block: int = 0) -> list[int]:
        return self.destinations[num_blocks]

    def open_channel(self, peer_id: str) -> tuple[str, int, bytes]:
        return self.receiver.open_channel(peer_id)

    def connect(self, peer_id: str, host: str, port: int, secret: bytes) -> str | None:
        self.sender.connect(peer_id, host, port, secret)
        return self.sender.backend(peer_id)

    def set_destination(self, block_ids: list[int]) -> None:
        self.destinations[len(block_ids)] = block_ids

    def channel_times(self, peer_id: str, block_ids: list[int], repeats: int) -> list[float]:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.sender.send(peer_id, f"bench-{len(block_ids)}", block_ids).result()
            times.append(time.perf_counter() - start)
        return times

    def copy_gbps(self, num_blocks: int) -> dict[str, float]:
        """This host's copy bandwidths (GB/s) for `num_blocks` blocks' bytes: a plain contiguous
        memcpy (the ceiling), the channel's gather (random pool blocks -> contiguous) and its
        scatter (contiguous -> random pool blocks): the copies a channel adds to the wire."""
        rng = random.Random(0)
        src = rng.sample(range(self.kv.shape[0]), num_blocks)
        dst = rng.sample(range(self.kv.shape[0]), num_blocks)
        out = torch.empty(num_blocks * KVLayout.of(self.kv).bytes_per_block, dtype=torch.uint8,
                          device=self.kv.device)
        flat = self.kv.view(-1).view(torch.uint8)[:out.numel()]
        return {"memcpy": self._gbps(lambda: out.copy_(flat), out.numel()),
                "gather": self._gbps(lambda: self.copier.gather(src, out), out.numel()),
                "scatter": self._gbps(lambda: self.copier.scatter(out, dst), out.numel())}

    def _gbps(self, copy, nbytes: int) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            copy()
            if self.kv.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return nbytes / statistics.median(times[1:]) / 1e9

    def raw_open(self) -> int:
        self._store = open_store(self.host, self.config.timeout_s)
        return self._store.port

    def raw_join(self, host: str, port: int, backend: str) -> None:
        self._store = join_store(host, port, self.config.timeout_s)
        self._build_raw(1, local_address_towards(host, port), backend)

    def raw_accept(self, backend: str) -> None:
        self._build_raw(0, self.host, backend)

    def _build_raw(self, rank: int, local_host: str, backend: str) -> None:
        if backend == "nccl":
            self.raw = nccl_group(self._store, rank, self.config.timeout_s)
        else:
            self.raw = gloo_group(self._store, rank, local_host, self.config.timeout_s)
        self.wire = torch.device(self.device if backend == "nccl" else "cpu")
        self.ack = torch.zeros(1, dtype=torch.uint8, device=self.wire)

    def raw_round_trips(self, nbytes: int, repeats: int, initiator: bool) -> list[float]:
        """Initiator (rank 1): send nbytes, wait for a 1-byte ack; the other side mirrors."""
        payload = self._raw_payload(nbytes)
        peer = 0 if initiator else 1
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            if initiator:
                self.raw.send([payload], peer, 0).wait()
                self.raw.recv([self.ack], peer, 1).wait()
            else:
                self.raw.recv([payload], peer, 0).wait()
                self.raw.send([self.ack], peer, 1).wait()
            if self.wire.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return times

    def _raw_payload(self, nbytes: int) -> torch.Tensor:
        """The pool's own first nbytes (contiguous): no extra memory for the 1 GiB case."""
        flat = self.kv.view(-1).view(torch.uint8)[:nbytes]
        return flat if flat.device == self.wire else flat.to(self.wire)

    def ray_put(self, block_ids: list[int]) -> tuple[list[ray.ObjectRef], float]:
        start = time.perf_counter()
        payload = torch.empty(len(block_ids) * KVLayout.of(self.kv).bytes_per_block,
                              dtype=torch.uint8, device=self.kv.device)
        self.copier.gather(block_ids, payload)
        ref = ray.put(payload.cpu().numpy())
        return [ref], time.perf_counter() - start

    def ray_get(self, refs: list[ray.ObjectRef], block_ids: list[int]) -> float:
        start = time.perf_counter()
        payload = torch.from_numpy(within_deadline(refs[0]))   # zero-copy view of the shared object
        self.copier.scatter(payload.to(self.kv.device), block_ids)
        if self.kv.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start
