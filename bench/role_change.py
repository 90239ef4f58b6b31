"""A role change against a fresh start-up, side by side on this host: `python -m bench.role_change`.

On a live 2 prefill + 1 decode cluster of the checkpoint (`--model`; default the tiny random
Llama the tests use), idle, each round times, through the router's admin API as an operator's
commands go: (a) a fresh decode worker: Admin/Scale from 1 to 2 decode workers (`pdserve scale`:
a Ray actor process, the weights loaded, the kernels warmed up), then scaled back; and (b) a
prefill worker becoming a decode worker and back: Admin/ChangeRole (`pdserve role`: drain,
channels closed, KV ledger reset, the other role built over the loaded engine). Prints JSON: each
round's seconds as the client saw them (and the router's own for a role change), the medians,
the ratio, the CPU and the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from client import grpc_client
from router.config.loader import parse_config
from router.launch import LocalCluster


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cluster(model: str | None, tmp: str):
    raw = {"model": {"path": model or f"{tmp}/tiny", "dtype": "float32", "create_tiny": "off" if model else "llama"},
           "router": {"port": 0, "metrics_port": None, "http_port": None},
           "prefill": {"replicas": 2, "num_cpus": 0.5, "torch_threads": 1},
           "decode": {"replicas": 1, "num_cpus": 0.5, "torch_threads": 1},
           "kv_cache": {"block_size": 16, "num_blocks": 256}}
    return LocalCluster(parse_config(raw), start_timeout_s=600)  # a loaded host starts slowly


def timed(call) -> tuple[float, object]:
    began = time.perf_counter()
    result = call()
    return time.perf_counter() - began, result


def measure(model: str | None, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, cluster(model, tmp) as c:
        start_s, to_decode_s, to_prefill_s, on_router_s = [], [], [], []
        moving = "prefill-1"
        for _ in range(rounds):
            took, _ = timed(lambda: grpc_client.scale(c.address, "decode", 2))
            start_s.append(took)
            grpc_client.scale(c.address, "decode", 1)  # the newest worker drains and stops
            took, reply = timed(lambda m=moving: grpc_client.change_role(c.address, m, "decode"))
            to_decode_s.append(took)
            on_router_s.append(reply.seconds)
            took, reply = timed(lambda name=reply.new_name: grpc_client.change_role(c.address, name, "prefill"))
            to_prefill_s.append(took)
            on_router_s.append(reply.seconds)
            moving = reply.new_name
    change = statistics.median(to_decode_s + to_prefill_s)
    start = statistics.median(start_s)
    return {"model": model or "tiny random llama (tests)", "cpu": cpu_name(), "rounds": rounds,
            "path": "gRPC Admin/Scale (pdserve scale) and Admin/ChangeRole (pdserve role)",
            "fresh_start_s": start_s, "change_to_decode_s": to_decode_s, "change_to_prefill_s": to_prefill_s,
            "role_change_on_router_s": on_router_s,
            "median_fresh_start_s": start, "median_role_change_s": change,
            "role_change_over_start": change / start}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: a tiny random Llama made for the run)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.rounds), indent=2))


if __name__ == "__main__":
    main()
