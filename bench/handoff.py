"""The hand-off's cost on the second token: KV streamed chunk by chunk vs sent after the prefill.

Two 1 prefill + 1 decode clusters side by side, identical but for `kv_transfer.stream_chunks`
(true: each prefill chunk's full blocks leave while the next chunk computes; false: the whole
prompt's KV leaves after the first token). For prompts of 1k, 4k and 8k tokens, one request at
a time to each cluster in turn (the order alternating per sample, so drift falls on both), the
client times first token -> second token; the second token needs the KV landed on the decode
worker. Reported per length: medians of both and the ratio streamed / after-prefill
(`second_token_ratio_8k` is the headline), and the gap second -> third token (one decode step at
that context: the floor under the second token's wait in either mode), with the lowest ratio that
floor allows (`second_token_floor_8k`) and the hand-off's own share of the wait, streamed over after
(`handoff_wait_ratio_8k`). The bench model (checkpoints/tiny.py, size
"bench") is used with max_position_embeddings raised to 16k (RoPE needs no other change), in a
sibling directory whose weight files are links to the original.

    python -m bench.handoff [--samples 3] [--lengths 1024,4096,8192] [--json]
                                    [--emulate h100:llama-3.1-8b --emulate-time-scale K]

With --emulate, both clusters run at the emulated device's timings (docs/architecture.md,
"Emulation"): the tiny test model computes the tokens (its positions raised to 16k the same way),
every step and KV transfer is paced to the emulated model on the emulated device (its start-up
taken as instant: weights load 1000 GB/s), stretched by K,
and every client time and `kv_transfer_ms` is divided back by K; the JSON adds `emulation` (the
assumptions and each cluster's fidelity verdict: a run with > 1% overruns is not faithful).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpc  # noqa: E402
import ray  # noqa: E402

from bench.emulation import assumptions, collect_emulation, fidelity, format_fidelity, parse_emulate  # noqa: E402
from bench.errors import BenchError  # noqa: E402
from checkpoints.tiny import ensure_model  # noqa: E402
from proto import pdserve_pb2 as pb  # noqa: E402
from proto import pdserve_pb2_grpc as pb_grpc  # noqa: E402
from router.config.loader import parse_config  # noqa: E402
from router.config.schema import ClusterConfig  # noqa: E402
from router.launch import LocalCluster  # noqa: E402

LONG_POSITIONS = 16384
FIRST_TOKEN_ID = 3  # ids 0-2 are the tokenizer's special tokens


def long_context_model(base: Path, size: str = "bench") -> Path:
    """The `size` test model with max_position_embeddings LONG_POSITIONS, next to `base`."""
    src = ensure_model(base, size=size)
    dst = src.with_name(src.name + "-16k")
    if not (dst / "config.json").exists():
        dst.mkdir(exist_ok=True)
        for f in src.iterdir():
            if f.name != "config.json" and not (dst / f.name).exists():
                (dst / f.name).symlink_to(f.resolve())
        config = json.loads((src / "config.json").read_text())
        config["max_position_embeddings"] = LONG_POSITIONS
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def cluster_config(model: Path, stream: bool, num_blocks: int, emulate: dict | None = None) -> ClusterConfig:
    return parse_config({"emulate": emulate or {"device": None},
        "model": {"path": str(model)},
        "router": {"host": "127.0.0.1", "port": 0, "metrics_port": None, "prefill_timeout_s": 300},
        "prefill": {"replicas": 1, "num_cpus": 1, "torch_threads": 1},
        "decode": {"replicas": 1, "num_cpus": 1, "torch_threads": 1},
        "kv_cache": {"block_size": 16, "num_blocks": num_blocks},
        "kv_transfer": {"stream_chunks": stream, "timeout_s": 120},
    }, where="bench_handoff")


async def one_request(stub: pb_grpc.GenerationStub, prompt: list[int]) -> dict:
    """Client times (ms) of the first three tokens' gaps, and the KV transfer's usage."""
    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
    t0, seen, times, last = time.perf_counter(), 0, [], None
    async for message in stub.Generate(request, timeout=600):
        for _ in message.token_ids:
            seen += 1
            times.append(1e3 * (time.perf_counter() - t0))
        last = message
    assert seen == 3, f"expected 3 tokens, got {seen}"
    return {"ttft_ms": times[0], "second_ms": times[1] - times[0], "third_ms": times[2] - times[1],
            "kv_transfer_ms": last.usage.kv_transfer_ms}


def contract(raw: dict[int, list[list[dict]]], k: float) -> dict[int, list[list[dict]]]:
    """Every time divided by the emulation's time_scale k: back to emulated milliseconds."""
    return {n: [[{key: v / k for key, v in r.items()} for r in runs] for runs in modes] for n, modes in raw.items()}


async def measure(addresses: list[str], prompts: dict[int, list[list[int]]]) -> dict[int, list[list[dict]]]:
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    try:
        for stub in stubs:  # opens the KV channels; first calls pay one-off costs
            await one_request(stub, prompts[min(prompts)][0][:64])
        out: dict[int, list[list[dict]]] = {}
        for length, samples in prompts.items():
            out[length] = [[] for _ in stubs]
            for i, prompt in enumerate(samples):
                order = range(len(stubs)) if i % 2 == 0 else reversed(range(len(stubs)))
                for k in order:
                    out[length][k].append(await one_request(stubs[k], prompt))
        return out
    finally:
        for channel in channels:
            await channel.close()


def summarize(raw: dict[int, list[list[dict]]]) -> dict:
    rows = {}
    for length, (streamed, after) in raw.items():
        def med(runs: list[dict], key: str) -> float:
            return statistics.median(r[key] for r in runs)
        rows[length] = {"streamed_second_ms": med(streamed, "second_ms"), "after_second_ms": med(after, "second_ms"),
                        "streamed_ttft_ms": med(streamed, "ttft_ms"), "after_ttft_ms": med(after, "ttft_ms"),
                        "streamed_kv_ms": med(streamed, "kv_transfer_ms"), "after_kv_ms": med(after, "kv_transfer_ms"),
                        "decode_step_ms": med(streamed + after, "third_ms")}
        row = rows[length]
        row["ratio"] = row["streamed_second_ms"] / row["after_second_ms"]
        # the second token waits for the hand-off and then one decode step: what is left of the wait
        # once that step is taken out, and the lowest ratio any hand-off could reach at this step time
        streamed_wait = max(0.0, row["streamed_second_ms"] - row["decode_step_ms"])
        after_wait = row["after_second_ms"] - row["decode_step_ms"]
        row["handoff_wait_ratio"] = streamed_wait / after_wait if after_wait > 0 else None
        row["floor_ratio"] = row["decode_step_ms"] / row["after_second_ms"]
    return rows


def print_table(r: dict) -> None:
    print(f"first token -> second token, {r['samples']} samples per length and mode (alternating), medians in ms; "
          f"model {r['model']}, {os.cpu_count()} CPUs (load average {r['load_average']:.1f})")
    print(f"{'prompt':>8}{'streamed':>11}{'after':>9}{'ratio':>8}{'2nd->3rd':>10}{'floor':>7}{'hand-off':>10}"
          f"{'TTFT str.':>11}{'TTFT aft.':>11}{'KV ms str.':>12}{'KV ms aft.':>12}")
    for length, row in r["rows"].items():
        handoff = "n/a" if row["handoff_wait_ratio"] is None else f"{row['handoff_wait_ratio']:.2f}"
        print(f"{length:>8}{row['streamed_second_ms']:>11.1f}{row['after_second_ms']:>9.1f}{row['ratio']:>8.2f}"
              f"{row['decode_step_ms']:>10.1f}{row['floor_ratio']:>7.2f}{handoff:>10}"
              f"{row['streamed_ttft_ms']:>11.0f}{row['after_ttft_ms']:>11.0f}{row['streamed_kv_ms']:>12.1f}"
              f"{row['after_kv_ms']:>12.1f}")
    print("2nd->3rd: one decode step at that context, both modes (the floor under either 2nd-token wait); floor: "
          "2nd->3rd / after, the lowest ratio any hand-off reaches at this step time; hand-off: (streamed - "
          "2nd->3rd) / (after - 2nd->3rd), the wait the hand-off itself adds, streamed over after; KV ms: the "
          "decode worker's landing time summed over a request's pieces (usage.kv_transfer_ms)")


def _emulate(text: str) -> tuple[str, str]:
    try:
        return parse_emulate(text)
    except BenchError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _lengths(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or any(v < 32 or v > LONG_POSITIONS - 8 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must lie in [32, {LONG_POSITIONS - 8}]")
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3, help="requests per length and mode")
    ap.add_argument("--lengths", type=_lengths, default=[1024, 4096, 8192], help="prompt lengths, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--emulate", metavar="DEVICE:MODEL", type=_emulate,
                    help="run both clusters at this device's timings for this model, e.g. h100:llama-3.1-8b")
    ap.add_argument("--emulate-time-scale", type=float, default=1.0, metavar="K",
                    help="with --emulate: stretch modelled time by K (>= 1), times reported divided back")
    args = ap.parse_args(argv)
    if args.emulate_time_scale < 1:
        ap.error("--emulate-time-scale must be >= 1")
    load = os.getloadavg()[0]
    # start-up is not what this bench measures: the emulated weights load is taken as instant
    emulate = None if args.emulate is None else {"device": args.emulate[0], "model": args.emulate[1],
                                                  "time_scale": args.emulate_time_scale,
                                                  "load_bandwidth": "1000GB/s"}
    base = Path(tempfile.gettempdir()) / ("pdserve-bench-llama" if emulate is None else "pdserve-handoff-tiny")
    model = long_context_model(base, "bench" if emulate is None else "tiny")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    prompts = {n: [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)] for _ in range(args.samples)]
               for n in args.lengths}
    num_blocks = max(args.lengths) // 16 + 64
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    configs = [cluster_config(model, stream, num_blocks, emulate) for stream in (True, False)]
    verdicts = {}
    try:
        with LocalCluster(configs[0]) as streamed, LocalCluster(configs[1]) as after:
            raw = asyncio.run(measure([streamed.address, after.address], prompts))
            if emulate is not None:
                verdicts = {name: fidelity(collect_emulation(cluster), assumptions(configs[0]))
                            for name, cluster in (("streamed", streamed), ("after", after))}
    finally:
        ray.shutdown()
    rows = summarize(contract(raw, args.emulate_time_scale if emulate else 1.0))
    longest = max(args.lengths)
    result = {"model": str(model), "load_average": load, "samples": args.samples, "rows": rows,
              **({"emulation": verdicts} if verdicts else {}),
              f"second_token_ratio_{longest // 1024}k": rows[longest]["ratio"],
              f"second_token_floor_{longest // 1024}k": rows[longest]["floor_ratio"],
              f"handoff_wait_ratio_{longest // 1024}k": rows[longest]["handoff_wait_ratio"]}
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
        for name, verdict in verdicts.items():
            print(format_fidelity(name, verdict))
        if verdicts:
            print(f"modelled: {next(iter(verdicts.values()))['assumptions']}")


if __name__ == "__main__":
    main()
