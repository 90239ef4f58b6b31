"""Calibration of emulated devices: this host emulated, against this host for real.

1. Replay one seeded workload on the real 1 prefill + 1 decode SmolLM2 cluster.
2. Fit this CPU's cost model for SmolLM2 (bench/calibrate.py) from that run's own engine steps
   (`--fit run`, the default: the fit shares the contention of the figures it is compared with), or
   from steps of a spread of shapes run in this process before (`--fit bench`); the bandwidth is
   measured as `pdserve plan --measure` does.
3. Replay the workload on an emulated cluster: the tiny test model computing the tokens, every step
   paced to SmolLM2 on this CPU as fitted, the same KV pool size. Workers are pinned to the same
   cores in both.
4. Print TTFT and ITL p50 / p99 of both (ms) and the emulated figures' relative error, with the fit
   and the emulated run's fidelity (overrun share) beside them.

    python -m bench.emulation_check [--model DIR] [--requests 12] [--rate 0.5] [--input-len 128]
                                      [--output-len 16] [--fit run|bench] [--json]

JSON: {"real": {ttft_p50, ttft_p99, itl_p50, itl_p99}, "emulated": {...}, "error": {...}, "fit": {...},
"emulation": {...}, "assumptions": "..."} (errors are emulated / real - 1). The KV link is not fitted:
--link sets it (default 2GB/s with 1 ms latency, loopback gloo on this host); prompt lengths are kept
short so that transfer stays small next to the steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from bench import host_measure  # noqa: E402
from bench.bottleneck import fetch_step_records  # noqa: E402
from bench.calibrate import fit, from_records, measure_steps  # noqa: E402
from bench.client import replay  # noqa: E402
from bench.emulation import assumptions, collect_emulation, fidelity  # noqa: E402
from bench.metrics import RequestRecord, itls, ttft  # noqa: E402
from bench.workload import (  # noqa: E402
    Workload,
    arrival_times,
    make_workload,
    sample_lengths,
    synthetic_requests,
)
from checkpoints.gguf import SMOLLM2_OUT_DIR  # noqa: E402
from checkpoints.tiny import ensure_model  # noqa: E402
from router.config.loader import parse_config  # noqa: E402
from router.config.schema import ClusterConfig  # noqa: E402
from router.launch import LocalCluster  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE = 512, 16
KEYS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def _config(model: Path, emulate: dict | None = None) -> ClusterConfig:
    raw = {"model": {"path": str(model)}, "router": {"port": 0, "shutdown_grace_s": 5},
           "prefill": {"replicas": 1, "num_cpus": 0.5, "cpus": [0]}, "decode": {"replicas": 1, "num_cpus": 0.5,
                                                                               "cpus": [1]},
           "kv_cache": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS, "prefix_caching": False}}
    if emulate is not None:
        raw["emulate"] = emulate
    return parse_config(raw)


def _workload(args: argparse.Namespace) -> Workload:
    rng = np.random.default_rng(args.seed)
    n = args.requests
    specs = synthetic_requests("cal", arrival_times(n, args.rate, 1.0, rng), sample_lengths(n, args.input_len, 0.25, rng),
                               np.full(n, args.output_len), 2048, (16, 256), rng)
    return make_workload("calibration", specs, None, {"seed": args.seed})


def _figures(records: list[RequestRecord]) -> dict[str, float]:
    done = [r for r in records if r.ok]
    if len(done) != len(records):
        raise RuntimeError(f"{len(records) - len(done)} requests failed: {[r.error for r in records if not r.ok][:3]}")
    first = np.array([ttft(r) for r in done]) * 1e3
    gaps = np.concatenate([itls(r) for r in done]) * 1e3
    return {"ttft_p50": float(np.percentile(first, 50)), "ttft_p99": float(np.percentile(first, 99)),
            "itl_p50": float(np.percentile(gaps, 50)), "itl_p99": float(np.percentile(gaps, 99))}


def _run(cfg: ClusterConfig, workload: Workload, name: str) -> tuple[list[RequestRecord], dict | None, list]:
    """The run's request records, its fidelity verdict (emulated) and its workers' step records."""
    with LocalCluster(cfg) as cluster:
        started = time.time()
        records = asyncio.run(replay(cluster.address, workload, name, show_progress=False))
        emulated = fidelity(collect_emulation(cluster), assumptions(cfg)) if cfg.emulate.device else None
        steps = [r for _, rs in fetch_step_records(cluster).values() for r in rs if r.end_unix >= started]
    return records, emulated, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2_OUT_DIR, help="the real model (default: SmolLM2)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rate", type=float, default=0.5, help="requests/s, Poisson")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--link", default="2GB/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fit", choices=("run", "bench"), default="run",
                        help="fit the cost model from the real run's own steps, or from a spread of shapes run first")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        print(f"bench_emulation: {args.model} has no config.json (bash scripts/run.sh converts SmolLM2)",
              file=sys.stderr)
        return 2
    bandwidth = host_measure.reads(1)["bandwidth"]
    if args.fit == "bench":
        print("bench_emulation: fitting this host's cost model (1 torch thread)...", file=sys.stderr)
        host = fit(args.model, "float32", measure_steps(args.model, threads=1), bandwidth)
    workload = _workload(args)
    real, _, steps = _run(_config(args.model), workload, "real")
    if args.fit == "run":
        host = fit(args.model, "float32", from_records(steps), bandwidth)
    tiny = ensure_model(Path(tempfile.gettempdir()) / "pdserve-bench-emulation-tiny")
    emulate = host.emulate_section(str(args.model), "float32") | {
        "link": args.link, "link_latency_s": 0.001, "load_bandwidth": "1000GB/s"}
    emulated_records, verdict, _ = _run(_config(tiny, emulate), workload, "emulated")
    result = {"real": _figures(real), "emulated": _figures(emulated_records)}
    result["error"] = {k: result["emulated"][k] / result["real"][k] - 1 for k in KEYS}
    result |= {"fit": vars(host) | {"source": args.fit, "emulate": emulate}, "emulation": verdict,
               "assumptions": verdict["assumptions"]}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"fit ({'the real run' if args.fit == 'run' else 'shapes run first'}): {host.bandwidth / 1e9:.2f} GB/s, "
          f"{host.flops / 1e9:.1f} GFLOP/s, {host.overhead_s * 1e3:.1f} ms per step (rms error "
          f"{host.rms_error_s * 1e3:.1f} ms over {host.steps} steps)")
    print(f"{'':<10}" + "".join(f"{k:>12}" for k in KEYS))
    for row in ("real", "emulated"):
        print(f"{row:<10}" + "".join(f"{result[row][k]:>10.1f}ms" for k in KEYS))
    print(f"{'error':<10}" + "".join(f"{result['error'][k]:>12.1%}" for k in KEYS))
    print(f"modelled: {verdict['assumptions']}; {verdict['overruns']} of {verdict['steps']} emulated steps overran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
