"""The engine alone under a burst, scheduler settings side by side: `bench.peer`'s workload shape
(requests arriving `--concurrency` at a time, a new one as each finishes; prompts of 128-512 tokens,
64 output tokens) on one `LLMEngine` per setting, the settings taking turns each round, the same
prompts for each in a round. Reports TTFT p50, ITL p50 / p99 (the gaps between a request's tokens)
and output tokens/s, per setting the median over rounds.

Settings are `max_num_partial_prefills` values (`none` for no limit): docs/engine_speed.md,
"One prompt part-way at a time"; and `chunk_size` values (`none`: whole prompts), each pair.

    python -m microbench.schedule [--model models/smollm2-135m-instruct] [--dtype bfloat16]
        [--threads 2] [--partial 1,none] [--chunk 256] [--requests 32] [--concurrency 16] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams


def burst(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int, tag: str) -> dict:
    """Run `prompts` through `engine`, `concurrency` at a time; the latency figures in seconds."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    pending, added, first, last, gaps, tokens = list(enumerate(prompts)), {}, {}, {}, [], 0

    def add() -> None:
        i, ids = pending.pop(0)
        rid = f"{tag}-{i}"
        added[rid] = time.perf_counter()
        engine.add_request(rid, prompt_token_ids=ids, sampling=sampling)

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        add()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if not o.token_ids:
                continue
            tokens += len(o.token_ids)
            if o.request_id in first:
                gaps.append(now - last[o.request_id])
            else:
                first[o.request_id] = now - added[o.request_id]
            last[o.request_id] = now
            if o.finished and pending:
                add()
    wall = time.perf_counter() - t0
    return {"ttft_p50_s": statistics.median(first.values()), "itl_p50_s": statistics.median(gaps),
            "itl_p99_s": statistics.quantiles(gaps, n=100)[98], "output_tok_s": tokens / wall}


def measure(engines: dict[str, LLMEngine], args: argparse.Namespace, vocab: int) -> dict:
    rows = {name: [] for name in engines}
    for r in range(args.rounds):
        rng = random.Random(r)
        prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(128, 512))] for _ in range(args.requests)]
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            rows[name].append(burst(engines[name], prompts, args.concurrency, args.max_tokens, f"r{r}{name}"))
    return {name: {key: round(statistics.median(row[key] for row in runs), 4) for key in runs[0]}
            | {"rounds": runs} for name, runs in rows.items()}


def _limit(text: str) -> int | None:
    return None if text == "none" else int(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m microbench.schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--partial", type=lambda s: s.split(","), default=["1", "none"],
                   help="max_num_partial_prefills values side by side (none: no limit)")
    p.add_argument("--chunk", type=lambda s: s.split(","), default=["256"],
                   help="chunk_size values side by side (none: whole prompts)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {f"partial={v}" + (f",chunk={c}" if len(args.chunk) > 1 else ""): LLMEngine(EngineConfig(
        model_path=args.model, dtype=args.dtype, num_blocks=4096, enable_prefix_caching=False,
        torch_threads=args.threads, max_num_partial_prefills=_limit(v), chunk_size=_limit(c)))
        for v in args.partial for c in args.chunk}
    vocab = next(iter(engines.values())).runner.hf_config.vocab_size
    report = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "settings": measure(engines, args, vocab)}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for name, row in report["settings"].items():
            print(name, {k: v for k, v in row.items() if k != "rounds"})


if __name__ == "__main__":
    main()
