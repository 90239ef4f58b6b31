"""The LM head of an all-greedy bfloat16 step alone: pdserve's GEMM then the argmax kernel, its fused
head as the engine runs it (engine/forward/greedy_head.py: with AMX-INT8, the int8 copy's first pass
and the exact rerun), the exact fused head alone (`pd_bf16_greedy`) and torch's `F.linear` then
`argmax` (the unfused path a torch-based server takes), taking turns in one process, per thread
count and rows.

    python -m microbench.head --model models/gemma3-270m-shape [--rows 1,16] [--threads 1,2] [--reps 21] [--cold]

`--cold` reads 512 MiB before each timed call, so the head comes from memory as in a decode step,
where the layers' weights have just passed through the cache; without it a loop of calls keeps a
head smaller than the last-level cache in it.

Prints one JSON object: per `<threads>t_<rows>rows`, the median ms of each, the fused over the
unfused paired (median of the per-repetition ratios) and the load average. The engine is a decode
worker's (bfloat16); a head without the fused path here says why and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from engine.forward.greedy_head import Bf16GreedyHead
from engine.llm_engine import LLMEngine
from router.config.loader import parse_config


def _timed(fn, sweep: torch.Tensor | None = None) -> float:
    if sweep is not None:
        sweep.sum()  # read past the last-level cache first: the head starts from memory
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(engine: LLMEngine, rows: int, reps: int, sweep: torch.Tensor | None = None) -> dict:
    head, argmax, fused = engine.runner.model.lm_head, engine.runner.argmax, engine.runner.forward.greedy_head
    weight = torch.randn(head.out_features, head.in_features).bfloat16()  # torch's side: only its time counts
    x = torch.randn(rows, head.in_features).bfloat16()
    assert torch.equal(fused(x), argmax(head(x))), "the fused head's tokens differ from the unfused head's"
    cases = {"unfused": lambda: argmax(head(x)), "fused": lambda: fused(x),
             "fused_exact": lambda: fused.gemm.greedy(x, fused.panels, fused.bias, fused.n),
             "torch_linear_argmax": lambda: torch.nn.functional.linear(x, weight).argmax(-1)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            times[name].append(_timed(fn, sweep))
    out = {f"{name}_ms": round(1e3 * statistics.median(v), 2) for name, v in times.items()}
    out["fused_over_unfused_paired"] = round(statistics.median(
        f / u for f, u in zip(times["fused"], times["unfused"], strict=True)), 3)
    out["int8_panels_reread_per_call"] = round(fused.reread / max(fused.int8_calls, 1), 1)
    out["load_avg_1min"] = round(os.getloadavg()[0], 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m microbench.head", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--cold", action="store_true",
                   help="read 512 MiB before each timed call, so the head streams from memory as it does in a "
                        "decode step (after the layers' weights), not from cache as in a loop of calls")
    args = p.parse_args()
    cfg = parse_config({"model": {"path": args.model, "dtype": "bfloat16"},
                        "kv_cache": {"memory": "256MiB", "prefix_caching": False}})
    engine = LLMEngine(cfg.engine_config(cfg.decode, device="cpu"))
    if not isinstance(engine.runner.forward.greedy_head, Bf16GreedyHead):
        print(f"no fused bfloat16 head here: {engine.runner.forward.greedy_reason}", file=sys.stderr)
        return 1
    report = {"cold": args.cold}
    sweep = torch.ones(128 << 20) if args.cold else None  # 512 MiB of float32
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            report[f"{threads}t_{rows}rows"] = measure(engine, rows, args.reps, sweep)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
