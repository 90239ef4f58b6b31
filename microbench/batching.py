"""Continuous batching vs static batching on the same requests, side by side in one run.

The engine (paged KV, continuous batching, optional chunked prefill) and `model.generate` in
static padded batches of the same maximum batch size serve the same requests (`ignore_eos`,
so lengths are exact) on the `bench` model. Prints a table, or one JSON object with --json.

    python -m microbench.batching [--requests 64] [--batch 32] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from checkpoints.tiny import ensure_model
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams


def make_requests(n: int, seed: int, prompt_range, output_range, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


def run_engine(path: str, requests, batch: int, chunk: int | None, budget: int, threads: int,
               device: str = "cpu", dtype: str = "float32", cuda_graphs: bool = False) -> dict:
    engine = LLMEngine(EngineConfig(model_path=path, num_blocks=4096, block_size=16, max_num_seqs=batch,
                                    max_num_batched_tokens=budget, chunk_size=chunk, torch_threads=threads,
                                    device=device, dtype=dtype, cuda_graphs=cuda_graphs))
    engine.generate([requests[0][0]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    engine.stats = type(engine.stats)()
    seen = engine.telemetry.last_seq
    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=out_len, ignore_eos=True))
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
    wall = time.perf_counter() - t0
    s = engine.stats
    full = [r for r in engine.telemetry.since(seen) if r.prefill_rows == 0 and r.decode_rows >= batch]
    return {
        "output_tokens": produced, "seconds": wall, "tok_per_s": produced / wall,
        "decode_steps": s.decode_steps,
        "mean_decode_step_ms": 1e3 * s.decode_step_s / max(s.decode_steps, 1),
        "outside_forward_share": 1 - s.decode_forward_s / max(s.decode_step_s, 1e-9),
        "full_batch_steps": len(full),
    }


def run_generate(path: str, requests, batch: int, device: str = "cpu", dtype: str = "float32") -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = model.config.vocab_size + 1  # never stop early: same lengths as the engine
    config.pad_token_id = 0
    config.do_sample = False
    produced = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch):
        group = requests[start:start + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group], device=device)
        # a static batch runs until its longest request is done; shorter ones waste those rows
        config.max_new_tokens = max(n for _, n in group)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, generation_config=config).cpu()  # waits for the device
        produced += sum(n for _, n in group)  # only the tokens each request asked for count
    wall = time.perf_counter() - t0
    return {"output_tokens": produced, "seconds": wall, "tok_per_s": produced / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="maximum batch size for both")
    ap.add_argument("--prompt", default="16,512", help="prompt length range")
    ap.add_argument("--output", default="16,256", help="output length range")
    ap.add_argument("--chunk", type=int, default=512, help="engine prefill chunk (0 = off)")
    ap.add_argument("--budget", type=int, default=2048, help="engine token budget per step")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--model", help="checkpoint dir (default: the bench model, created if absent)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or str(ensure_model(Path(tempfile.gettempdir()) / "pdserve-bench-llama", size="bench"))
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    reqs = make_requests(args.requests, args.seed, tuple(map(int, args.prompt.split(","))),
                         tuple(map(int, args.output.split(","))), min(vocab, 11000))
    engine = run_engine(path, reqs, args.batch, args.chunk or None, args.budget, args.threads)
    static = run_generate(path, reqs, args.batch)
    result = {"model": path, "requests": args.requests, "batch": args.batch, "threads": args.threads,
              "engine": engine, "generate": static, "ratio": engine["tok_per_s"] / static["tok_per_s"]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.requests} requests, prompts {args.prompt}, outputs {args.output}, batch {args.batch}, "
          f"engine chunk {args.chunk or 'off'} / budget {args.budget}, {args.threads} threads, model {path}")
    print(f"{'':28}{'output tok/s':>14}{'seconds':>10}")
    print(f"{'engine (continuous)':28}{engine['tok_per_s']:>14.1f}{engine['seconds']:>10.1f}")
    print(f"{'generate (static padded)':28}{static['tok_per_s']:>14.1f}{static['seconds']:>10.1f}")
    print(f"ratio engine / generate: {result['ratio']:.2f}")
    print(f"engine mean decode step: {engine['mean_decode_step_ms']:.1f} ms; outside the forward "
          f"(scheduling, batch building, sampling): {100 * engine['outside_forward_share']:.1f}%")


if __name__ == "__main__":
    main()
