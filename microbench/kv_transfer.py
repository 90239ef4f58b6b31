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
from dataclasses import asdict

import ray
import torch

from kv_transfer import KVTransferConfig
from kv_transfer.layout import KVLayout
from microbench.kv_endpoint import Endpoint, Shape, within_deadline

GIB, MIB = 1 << 30, 1 << 20
TARGET_RATIO, TARGET_LATENCY, TARGET_LINK_SLACK = 0.9, 2.0, 0.2
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
    host, port, secret = within_deadline(decode.open_channel.remote("prefill"))
    backend = within_deadline(prefill.connect.remote("decode", host, port, secret))
    port = within_deadline(decode.raw_open.remote())
    within_deadline([prefill.raw_join.remote(host, port, backend), decode.raw_accept.remote(backend)])
    return prefill, decode, backend


def _on(resource: str | None) -> dict:
    """Ray options that put an endpoint on a node offering `resource` (a sliver of it)."""
    return {"resources": {resource: 0.01}} if resource else {}


def raw_times(prefill, decode, nbytes: int, repeats: int) -> list[float]:
    mine = prefill.raw_round_trips.remote(nbytes, repeats, True)
    theirs = decode.raw_round_trips.remote(nbytes, repeats, False)
    return within_deadline([mine, theirs])[0]


def compare(prefill, decode, num_blocks: int, bytes_per_block: int, pool_blocks: int,
            repeats: int) -> tuple[float, float]:
    """Median seconds of (channel, raw) for one payload; runs interleave so that load from
    elsewhere on the host hits both alike. One untimed warm-up of each first."""
    rng = random.Random(num_blocks)
    within_deadline(decode.set_destination.remote(rng.sample(range(pool_blocks), num_blocks)))
    src = rng.sample(range(pool_blocks), num_blocks)
    channel, raw = [], []
    for attempt in range(repeats + 1):
        channel_s = within_deadline(prefill.channel_times.remote("decode", src, 1))
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
    within_deadline(decode.set_destination.remote(rng.sample(range(pool_blocks), 1)))
    src = rng.sample(range(pool_blocks), 1)
    channel = within_deadline(prefill.channel_times.remote("decode", src, repeats + 1))[1:]
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
        refs, _ = within_deadline(prefill.ray_put.remote(src))
        within_deadline(decode.ray_get.remote(refs, dst))
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
                   "sender_node": within_deadline(prefill.node.remote()),
                   "receiver_node": within_deadline(decode.node.remote()),
                   "block_bytes": bytes_per_block, "repeats": args.repeats,
                   "staging_bytes": config.staging_bytes,
                   "host_copy_gbps": within_deadline(prefill.copy_gbps.remote(
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
