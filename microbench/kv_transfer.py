"""Benchmark kv_transfer channels: effective GB/s vs a raw send/recv, latency, Ray object store.

Two Ray actors (prefill side, decode side) hold Llama-3.1-8B-shaped KV pools (32 layers x 8 kv
heads x 128 dims, bf16; 16-token blocks = 2 MiB; 8,192 tokens = 1 GiB), sized to the largest
payload. Per payload: the channel moves random non-contiguous source blocks into random
non-contiguous reserved blocks (send() -> future done, i.e. landed and acknowledged); the raw
baseline sends one contiguous tensor of the same size over a group of the same backend and
waits for a 1-byte ack. Ratio = channel / raw. Latency: one-block transfer vs raw round trip.

    python -m microbench.kv_transfer                     # table, up to 1 GiB (~1 min)
    python -m microbench.kv_transfer --max-bytes 64MiB --json

Across machines: join a running Ray cluster and put each end on a node that offers a custom
resource (each end takes 0.01 of it); --link-gbit adds, per payload, the time the link's rate
alone would take (bytes / rate) and measured / that, to judge a shaped or slow network:

    python -m microbench.kv_transfer --address HEAD:6379 --sender-resource prefill_node \
        --receiver-resource decode_node --link veth --link-gbit 1 --max-bytes 64MiB
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass

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

GIB, MIB = 1 << 30, 1 << 20
TARGET_RATIO, TARGET_LATENCY, TARGET_LINK_SLACK = 0.9, 2.0, 0.2
CALL_TIMEOUT_S = 600.0  # the longest one actor call may take (a whole 256 MiB sweep on a slow host)


def _get(refs):
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
        payload = torch.from_numpy(_get(refs[0]))   # zero-copy view of the shared object
        self.copier.scatter(payload.to(self.kv.device), block_ids)
        if self.kv.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": MIB, "gib": GIB, "k": 1 << 10, "m": MIB, "g": GIB}
    lowered = text.strip().lower()
    for suffix, scale in sorted(units.items(), key=lambda item: -len(item[0])):
        if lowered.endswith(suffix):
            return int(float(lowered[:-len(suffix)]) * scale)
    return int(lowered)


def human(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB" \
        if nbytes >= MIB else f"{nbytes / 1024:.0f} KiB"


def payload_blocks(bytes_per_block: int, max_bytes: int) -> list[int]:
    sizes = [1, 2, 8, 32, 128, 512, 2048]
    return [n for n in sizes if n * bytes_per_block <= max_bytes] or [1]


def start_pair(args, shape: Shape, num_blocks: int, config: KVTransferConfig):
    options = dict(num_cpus=0, num_gpus=1 if args.device == "cuda" else 0)
    prefill = Endpoint.options(**options, **_on(args.sender_resource)).remote(
        shape, num_blocks, config, args.device, True)
    decode = Endpoint.options(**options, **_on(args.receiver_resource)).remote(
        shape, num_blocks, config, args.device, False)
    host, port, secret = _get(decode.open_channel.remote("prefill"))
    backend = _get(prefill.connect.remote("decode", host, port, secret))
    port = _get(decode.raw_open.remote())
    _get([prefill.raw_join.remote(host, port, backend), decode.raw_accept.remote(backend)])
    return prefill, decode, backend


def _on(resource: str | None) -> dict:
    """Ray options that put an endpoint on a node offering `resource` (a sliver of it)."""
    return {"resources": {resource: 0.01}} if resource else {}


def raw_times(prefill, decode, nbytes: int, repeats: int) -> list[float]:
    mine = prefill.raw_round_trips.remote(nbytes, repeats, True)
    theirs = decode.raw_round_trips.remote(nbytes, repeats, False)
    return _get([mine, theirs])[0]


def compare(prefill, decode, num_blocks: int, bytes_per_block: int, pool_blocks: int,
            repeats: int) -> tuple[float, float]:
    """Median seconds of (channel, raw) for one payload; runs interleave so that load from
    elsewhere on the host hits both alike. One untimed warm-up of each first."""
    rng = random.Random(num_blocks)
    _get(decode.set_destination.remote(rng.sample(range(pool_blocks), num_blocks)))
    src = rng.sample(range(pool_blocks), num_blocks)
    channel, raw = [], []
    for attempt in range(repeats + 1):
        channel_s = _get(prefill.channel_times.remote("decode", src, 1))
        raw_s = raw_times(prefill, decode, num_blocks * bytes_per_block, 1)
        if attempt:
            channel += channel_s
            raw += raw_s
    return statistics.median(channel), statistics.median(raw)


def throughput_rows(prefill, decode, blocks: list[int], bytes_per_block: int, pool_blocks: int,
                    repeats: int, link_gbit: float | None = None) -> list[dict]:
    rows = []
    for num_blocks in blocks:
        nbytes = num_blocks * bytes_per_block
        channel, raw = compare(prefill, decode, num_blocks, bytes_per_block, pool_blocks,
                               repeats)
        row = {"bytes": nbytes, "blocks": num_blocks, "channel_s": channel,
               "channel_gbps": nbytes / channel / 1e9, "raw_gbps": nbytes / raw / 1e9,
               "ratio": raw / channel}
        if link_gbit:   # what the link's rate alone allows: the floor for this payload
            row["link_s"] = nbytes * 8 / (link_gbit * 1e9)
            row["vs_link"] = channel / row["link_s"]
        rows.append(row)
    return rows


def latency_row(prefill, decode, bytes_per_block: int, pool_blocks: int, repeats: int) -> dict:
    rng = random.Random(1)
    _get(decode.set_destination.remote(rng.sample(range(pool_blocks), 1)))
    src = rng.sample(range(pool_blocks), 1)
    channel = _get(prefill.channel_times.remote("decode", src, repeats + 1))[1:]
    raw = raw_times(prefill, decode, bytes_per_block, repeats + 1)[1:]
    channel_ms, raw_ms = statistics.median(channel) * 1e3, statistics.median(raw) * 1e3
    return {"block_bytes": bytes_per_block, "channel_ms_p50": channel_ms,
            "raw_round_trip_ms_p50": raw_ms, "ratio": channel_ms / raw_ms}


def ray_row(prefill, decode, num_blocks: int, bytes_per_block: int, pool_blocks: int,
            repeats: int) -> dict:
    rng = random.Random(7)
    times = []
    for _ in range(repeats + 1):
        src, dst = rng.sample(range(pool_blocks), num_blocks), rng.sample(range(pool_blocks),
                                                                            num_blocks)
        start = time.perf_counter()
        refs, _ = _get(prefill.ray_put.remote(src))
        _get(decode.ray_get.remote(refs, dst))
        times.append(time.perf_counter() - start)
        del refs
    seconds = statistics.median(times[1:])
    nbytes = num_blocks * bytes_per_block
    return {"bytes": nbytes, "blocks": num_blocks, "gbps": nbytes / seconds / 1e9}


def host_limits(copy: dict[str, float], largest: dict) -> dict[str, float]:
    """What the host allows a gather -> wire -> scatter pipeline, against the measured channel."""
    stages = (copy["gather"], largest["raw_gbps"], copy["scatter"])
    overlapped, serial = min(stages), 1 / sum(1 / g for g in stages)
    channel = largest["channel_gbps"]
    return {"memcpy_gbps": copy["memcpy"], "gather_gbps": copy["gather"], "scatter_gbps": copy["scatter"],
            "wire_gbps": largest["raw_gbps"], "overlapped_gbps": overlapped, "serial_gbps": serial,
            "channel_gbps": channel, "channel_vs_overlapped": channel / overlapped,
            "channel_vs_serial": channel / serial}


def print_table(report: dict) -> None:
    config = report["config"]
    where = f"{config['link']} link, {config['sender_node']} -> {config['receiver_node']}, "
    print(f"kv_transfer benchmark: {where}backend {config['backend']}, device {config['device']}, "
          f"{config['shape']['layers']} layers x {config['shape']['kv_heads']} kv heads x "
          f"{config['shape']['head_dim']} dims, {config['shape']['dtype']}, "
          f"{config['shape']['block_size']}-token blocks of {human(config['block_bytes'])}, "
          f"median of {config['repeats']}")
    link = config.get("link_gbit")
    print(f"{'payload':>10} {'blocks':>7} {'channel GB/s':>13} {'raw GB/s':>9} {'ratio':>6}  "
          "target" + (f"  {'channel ms':>10} {'bytes/rate ms':>13} {'vs rate':>7}" if link
                      else ""))
    for row in report["throughput"]:
        target = f">= {TARGET_RATIO}" if row["bytes"] >= 16 * MIB else "-"
        shaped = (f"  {row['channel_s'] * 1e3:>10.1f} {row['link_s'] * 1e3:>13.1f} "
                  f"{row['vs_link']:>7.2f}") if link else ""
        print(f"{human(row['bytes']):>10} {row['blocks']:>7} {row['channel_gbps']:>13.2f} "
              f"{row['raw_gbps']:>9.2f} {row['ratio']:>6.2f}  {target:<6}{shaped}".rstrip())
    lat = report["latency"]
    print(f"single-block latency ({human(lat['block_bytes'])}): channel p50 "
          f"{lat['channel_ms_p50']:.2f} ms, raw round trip p50 {lat['raw_round_trip_ms_p50']:.2f}"
          f" ms, ratio {lat['ratio']:.2f} (target <= {TARGET_LATENCY})")
    lim = report["host_limits"]
    print(f"this host's limits: memcpy {lim['memcpy_gbps']:.2f} GB/s, block gather {lim['gather_gbps']:.2f}, "
          f"block scatter {lim['scatter_gbps']:.2f}, wire (raw send/recv, largest payload) {lim['wire_gbps']:.2f}")
    print(f"  a channel must gather, send and scatter: {lim['overlapped_gbps']:.2f} GB/s if the three overlap "
          f"perfectly (the slowest sets the pace), {lim['serial_gbps']:.2f} GB/s if they run one after another")
    print(f"  largest payload: channel {lim['channel_gbps']:.2f} GB/s = {lim['channel_vs_overlapped']:.2f} of the "
          f"overlapped bound, {lim['channel_vs_serial']:.2f} of the serial one")
    if report.get("ray_object_store"):
        row = report["ray_object_store"]
        print(f"ray object store ({human(row['bytes'])}, put + get incl. gather/scatter): "
              f"{row['gbps']:.2f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", default="1GiB", help="largest payload (e.g. 64MiB)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per payload")
    parser.add_argument("--latency-repeats", type=int, default=30)
    parser.add_argument("--no-ray-row", action="store_true", help="skip the object store row")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--address", help="join this Ray cluster (HOST:PORT), don't start one")
    parser.add_argument("--sender-resource", help="put the sending end on a node offering this")
    parser.add_argument("--receiver-resource", help="put the receiving end on a node offering this")
    parser.add_argument("--interface", help="kv_transfer.interface: the NIC both ends use")
    parser.add_argument("--link", default="local", help="the link's name in the table (e.g. veth)")
    parser.add_argument("--link-gbit", type=float, help="the link's rate: adds bytes / rate rows")
    args = parser.parse_args()

    shape = Shape(block_size=args.block_size)
    config = KVTransferConfig(backend=args.backend, timeout_s=120.0, interface=args.interface)
    bytes_per_block = KVLayout.of(shape.pool(1, "cpu", fill=False)).bytes_per_block
    blocks = payload_blocks(bytes_per_block, parse_bytes(args.max_bytes))
    pool_blocks = max(blocks)   # pools hold just the largest payload: 2 x 1 GiB at most
    store_bytes = max(200 * MIB, int(1.5 * pool_blocks * bytes_per_block))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(num_cpus=2, num_gpus=torch.cuda.device_count(), include_dashboard=False,
                 object_store_memory=store_bytes, log_to_driver=False)
    prefill, decode, backend = start_pair(args, shape, pool_blocks, config)
    report = {
        "config": {"backend": backend, "device": args.device, "shape": asdict(shape),
                   "link": args.link, "link_gbit": args.link_gbit,
                   "sender_node": _get(prefill.node.remote()),
                   "receiver_node": _get(decode.node.remote()),
                   "block_bytes": bytes_per_block, "repeats": args.repeats,
                   "staging_bytes": config.staging_bytes,
                   "host_copy_gbps": _get(prefill.copy_gbps.remote(
                       min(pool_blocks, max(1, 64 * MIB // bytes_per_block))))},
        "throughput": throughput_rows(prefill, decode, blocks, bytes_per_block, pool_blocks,
                                      args.repeats, args.link_gbit),
        "latency": latency_row(prefill, decode, bytes_per_block, pool_blocks,
                               args.latency_repeats),
    }
    if not args.no_ray_row:
        report["ray_object_store"] = ray_row(prefill, decode, pool_blocks, bytes_per_block,
                                             pool_blocks, args.repeats)
    report["host_limits"] = host_limits(report["config"]["host_copy_gbps"], report["throughput"][-1])
    big = [row for row in report["throughput"] if row["bytes"] >= 16 * MIB]
    report["targets_met"] = {
        "ratio_ge_0.9_from_16MiB": all(row["ratio"] >= TARGET_RATIO for row in big) if big
        else None,   # no payload of 16 MiB or more in this run
        "latency_le_2x_raw": report["latency"]["ratio"] <= TARGET_LATENCY,
    }
    if args.link_gbit:   # a shaped link: the channel should take bytes / rate, within 20%
        report["targets_met"]["within_20pct_of_link_rate_from_16MiB"] = all(
            abs(row["vs_link"] - 1) <= TARGET_LINK_SLACK for row in big) if big else None
    ray.shutdown()
    print(json.dumps(report)) if args.json else print_table(report)


if __name__ == "__main__":
    main()
