"""The engine's step, side by side: the forward paths against each other and against this host's floor.

One process holds one `LLMEngine` per variant on the same checkpoint:
- `plain`: eager, torch's default CPU linear (MKL GEMM) — the engine before the fast paths;
- `sdpa`: eager, linear weights prepacked for oneDNN (engine/forward/dense.py), decode attention by SDPA
  over gathered blocks (`engine.cpu_kernels: off`);
- `unfused`: eager, prepacked linears and the attention and GEMM kernels, every projection on its
  own, norms by `F.rms_norm` (`fuse_layers` off: no fused layers, no rotary, SiLU or norm kernel);
- `modules`: eager, prepacked linears, the CPU kernels and fused layers, each decoder layer still
  its modules (`kernel_layers` off: engine/kernels/cpu_kernel.py, engine/forward/fused.py);
- `packed`: all of that with each decoder layer one kernel call (the default on CPU:
  engine/forward/kernel_layer.py), and an all-greedy step's tokens from the half-float head
  (engine/forward/greedy_head.py; every request here is greedy);
- `fullhead`: `packed` with `greedy_head` off: the float32 logits and the argmax;
- `compiled`: `engine.compile: on` (inductor around the opaque paged-attention op), with `--compile`;
- `bfloat16`: the eager path in bfloat16, with `--bf16` (where the CPU computes bfloat16 natively:
  fused layers with the bfloat16 rotary, norm and activation kernels; where the bfloat16 GEMM runs,
  on AMX tiles, by AVX512-BF16's vdpbf16ps or AVX2's FMAs, each layer one kernel call as `packed`'s, else linears
  prepacked for oneDNN and the decoder's loop as direct calls, engine/forward/lean_decoder.py);
- `bf16-onednn`: `bfloat16` with its linears all oneDNN's (the bfloat16 GEMM withheld), as the
  engine ran bfloat16 on CPUs without AMX before the vdpbf16ps GEMM.
Each variant is brought to the same state (every request decoding at `--context` tokens, or one
`--prefill`-token prompt waiting), then the variants take turns, `--steps` steps each per round,
for `--rounds` rounds, so a noisy neighbour slows all of them alike; each reports the median step.
The floor is `pdserve plan --measure`'s: the larger of weight + KV bytes over measured read
bandwidth and the step's FLOPs over measured matmul throughput, each rate measured before and
after the cases and the better one kept (a neighbour that slowed one measurement does not lower
the bar). It is per dtype: the float32 variants' best step against float32's floor (4-byte weights
and KV, float32 matmul FLOP/s), the `bfloat16` variant against bfloat16's (2 bytes, bfloat16
matmul FLOP/s: AMX where the CPU has it). With `--paired`
the host is also measured at the start of every round, and `paired` is the median over rounds of
the round's best step over that round's floor (a shared host's load changes by the minute).
`recompilations` counts
graphs the compiled variant built after its warm-up (it must be 0). It runs with the allocator a
CPU worker would (`--malloc`: tcmalloc preloaded where the host has it, by restarting itself).

    python -m microbench.step [--model DIR] [--batches 1,4,16,64] [--context 256] [--prefill 512]
                                 [--threads 2] [--compile] [--bf16] [--variants modules,packed]
                                 [--paired] [--malloc auto|system] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time

import torch
from transformers import AutoConfig

from bench import host_measure
from engine.config import EngineConfig
from engine.kernels import cpu_kernel
from engine.llm_engine import LLMEngine
from microbench.profile_step import _model
from protocol.sampling import SamplingParams
from sizing.memory import ModelShape, kv_bytes_per_token
from worker_runtime import malloc

VARIANTS = {  # name -> EngineConfig overrides
    "plain": {"compile": "off", "prepack_linears": False, "dtype": "float32"},
    "sdpa": {"compile": "off", "dtype": "float32", "cpu_kernels": "off"},
    "unfused": {"compile": "off", "dtype": "float32", "fuse_layers": False},
    "modules": {"compile": "off", "dtype": "float32", "kernel_layers": False},
    "packed": {"compile": "off", "dtype": "float32"},
    "fullhead": {"compile": "off", "dtype": "float32", "greedy_head": False},
    "compiled": {"compile": "on", "dtype": "float32"},
    "bfloat16": {"compile": "off", "dtype": "bfloat16"},
    "bf16-onednn": {"compile": "off", "dtype": "bfloat16", "bf16_gemm": False},  # bf16_gemm: see _engine
}


DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _dtype(name: str) -> str:
    return VARIANTS[name]["dtype"]


def _host(threads: int, dtypes: set[str], quick: bool = False) -> dict[str, float]:
    """This host's read bandwidth and matmul FLOP/s in each of `dtypes` now (`flops` for float32,
    `flops_bfloat16`; `quick`: fewer repeats, for a round)."""
    found = {"bandwidth": host_measure.reads(threads, sweeps=2 if quick else 4)["bandwidth"]}
    for dtype in sorted(dtypes):
        key = "flops" if dtype == "float32" else f"flops_{dtype}"
        found[key] = host_measure.flops(threads, repeats=3 if quick else 5, dtype=dtype)
    return found


def _floors(case: dict, names: list[str], host: dict, shape: ModelShape, params: int) -> dict[str, tuple[float, float]]:
    """dtype -> (its variants' best step in `case`, that dtype's floor on `host`)."""
    out = {}
    for dtype in sorted({_dtype(n) for n in names}):
        best = min(case[n] for n in names if _dtype(n) == dtype)
        flops = host["flops" if dtype == "float32" else f"flops_{dtype}"]
        out[dtype] = best, floor_s(shape, params, DTYPE_BYTES[dtype], case["batch"], case["context"],
                                   case["tokens"], host["bandwidth"], flops)
    return out


@contextlib.contextmanager
def _without_bf16_gemm():
    """While in the block, the kernels offer no bfloat16 GEMM (oneDNN takes every bfloat16 linear)."""
    gemm_for = cpu_kernel.Kernels.gemm_for
    cpu_kernel.Kernels.gemm_for = lambda self, dtype: None if dtype == torch.bfloat16 else gemm_for(self, dtype)
    try:
        yield
    finally:
        cpu_kernel.Kernels.gemm_for = gemm_for


def _engine(model: str, batch: int, threads: int, overrides: dict, tokens: int = 1024) -> LLMEngine:
    """An engine of the variant `overrides` (EngineConfig fields; `bf16_gemm: False` builds it without
    the bfloat16 GEMM, which no config field turns off) whose step takes up to `tokens` tokens, a
    prompt of that many in one chunk."""
    overrides = dict(overrides)
    withheld = _without_bf16_gemm() if not overrides.pop("bf16_gemm", True) else contextlib.nullcontext()
    with withheld:
        return LLMEngine(EngineConfig(model_path=model, num_blocks=4096, block_size=16, max_num_seqs=max(batch, 1),
                                      max_num_batched_tokens=tokens, chunk_size=tokens, enable_prefix_caching=False,
                                      torch_threads=threads, **overrides))


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _decoding(engine: LLMEngine, batch: int, context: int, steps: int) -> None:
    rng = random.Random(batch)
    for i in range(batch):
        engine.add_request(f"r{i}", prompt_token_ids=_prompt(rng, context, engine.vocab_size),
                           sampling=SamplingParams(max_tokens=1024, ignore_eos=True))
    while any(r.num_uncomputed_tokens > 1 for r in engine.requests.values()):
        engine.step()


def _queue_prefills(engine: LLMEngine, tokens: int, count: int) -> None:
    rng = random.Random(tokens)
    for i in range(count):
        engine.add_request(f"p{len(engine.requests)}-{i}", prompt_token_ids=_prompt(rng, tokens, engine.vocab_size),
                           sampling=SamplingParams(max_tokens=1, ignore_eos=True))


def _timed_steps(engine: LLMEngine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t0)
    return out


def side_by_side(engines: dict[str, LLMEngine], steps: int, rounds: int, before_round=None,
                 on_round=None, per_round: list | None = None) -> dict[str, float]:
    """Median step (s) per variant, the variants taking turns each round. `on_round()` runs at the
    start of each round (`--paired`: the host measured); `per_round` gets each round's medians."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        if before_round:
            before_round(engine)
        engine.step()  # warm
    for _ in range(rounds):
        if on_round:
            on_round()
        this_round = {}
        for name, engine in engines.items():
            if before_round:
                before_round(engine)
            this_round[name] = _timed_steps(engine, steps)
            times[name] += this_round[name]
        if per_round is not None:
            per_round.append({name: statistics.median(t) for name, t in this_round.items()})
    return {name: statistics.median(t) for name, t in times.items()}


def _paired(case: dict, rounds: list[dict], hosts: list[dict], shape: ModelShape, params: int) -> None:
    """`--paired`: each round's best step over the floor from the host measured just before it, and
    their median (`paired`; `paired_bfloat16` for the bfloat16 variant): on a shared host whose load
    changes by the minute, the step and its floor then see the same neighbours."""
    names = list(rounds[0])
    per_round = [_floors({**case, **r}, names, h, shape, params) for r, h in zip(rounds, hosts, strict=True)]
    for dtype in per_round[0]:
        ratios = [best / floor for best, floor in (f[dtype] for f in per_round)]
        suffix = "" if dtype == "float32" else f"_{dtype}"
        case[f"paired_rounds{suffix}"] = [{"ratio": ratio, **host} for ratio, host in zip(ratios, hosts, strict=True)]
        case[f"paired{suffix}"] = statistics.median(ratios)


def floor_s(shape: ModelShape, params: int, dtype_bytes: int, batch: int, context: int, tokens: int,
            bandwidth: float, flops: float) -> float:
    """max(weights + KV read / bandwidth, 2 * params * tokens / flops) for one step."""
    kv = batch * context * kv_bytes_per_token(shape, dtype_bytes)
    return max((params * dtype_bytes + kv) / bandwidth, 2 * params * tokens / flops)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill case (0 = skip)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="add the compiled variant (minutes to compile on CPU)")
    p.add_argument("--bf16", action="store_true", help="add the bfloat16 variant")
    p.add_argument("--no-floor", action="store_true", help="skip measuring this host's bandwidth and FLOP/s")
    p.add_argument("--paired", action="store_true", help="also measure the host at the start of every round and "
                   "report the median of each round's best step over that round's floor")
    p.add_argument("--variants", default="", help="comma-separated variants to run instead of the default set "
                   "(the first is the others' baseline)")
    p.add_argument("--malloc", default="auto", choices=("auto", "system"),
                   help="the allocator, as a worker's `malloc` (auto: tcmalloc where the host has it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    malloc.exec_as_worker(args.malloc)
    model = _model(args.model)
    torch.set_num_threads(args.threads)
    names = args.variants.split(",") if args.variants else (
        ["plain", "sdpa", "unfused", "modules", "packed"] + ["compiled"] * args.compile + ["bfloat16"] * args.bf16)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    dtypes = {_dtype(n) for n in names}
    host_samples = [] if args.no_floor else [_host(args.threads, dtypes)]
    paired = args.paired and not args.no_floor
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model))
    params = shape.num_params
    cases: dict[str, dict] = {}
    recompilations = 0

    def run(case: dict, engines: dict[str, LLMEngine], steps: int, before_round=None) -> dict:
        rounds, hosts = [], []
        on_round = (lambda: hosts.append(_host(args.threads, dtypes, quick=True))) if paired else None
        case.update(side_by_side(engines, steps, args.rounds, before_round=before_round, on_round=on_round,
                                 per_round=rounds))
        if paired:
            _paired(case, rounds, hosts, shape, params)
        return case

    for batch in (int(b) for b in args.batches.split(",") if b):  # --batches "": the prefill case alone
        engines = {n: _engine(model, batch, args.threads, VARIANTS[n]) for n in names}
        for engine in engines.values():
            _decoding(engine, batch, args.context, args.steps)
        cases[f"decode b={batch}"] = run({"batch": batch, "tokens": batch, "context": args.context}, engines,
                                         args.steps)
        recompilations += sum(e.runner.forward.recompilations for e in engines.values())
        del engines
    if args.prefill:
        engines = {n: _engine(model, 1, args.threads, VARIANTS[n], max(1024, args.prefill)) for n in names}
        refill = lambda e: _queue_prefills(e, args.prefill, 1 + 1)  # noqa: E731 - one per timed step
        cases[f"prefill {args.prefill}"] = run({"batch": 1, "tokens": args.prefill, "context": 0}, engines, 1,
                                               before_round=refill)
        recompilations += sum(e.runner.forward.recompilations for e in engines.values())
    if host_samples:  # again after the cases; the floor takes the best of each rate (the lowest floor)
        host_samples.append(_host(args.threads, dtypes))
    host = {key: max(h[key] for h in host_samples) for key in host_samples[0]} if host_samples else None
    if host:
        for case in cases.values():
            for dtype, (_, floor) in _floors(case, names, host, shape, params).items():
                case["floor" if dtype == "float32" else f"floor_{dtype}"] = floor
    report = {"model": model, "threads": args.threads, "malloc": malloc.in_use(), "torch": torch.__version__, "host": host,
              "host_samples": host_samples,
              "variants": names, "cases": cases, "recompilations": recompilations}
    print(json.dumps(report, indent=1) if args.json else format_report(report))


def format_report(r: dict) -> str:
    names = r["variants"]
    base = names[0]  # plain, unless --variants says otherwise
    dtypes = sorted({_dtype(n) for n in names}, reverse=True)  # float32 first
    suffix = {d: "" if d == "float32" else f"_{d}" for d in dtypes}
    tag = {d: "" if len(dtypes) == 1 else {"float32": " f32", "bfloat16": " bf16"}[d] for d in dtypes}
    paired = any("paired" + suffix[d] in row for row in r["cases"].values() for d in dtypes)
    head = f"{'ms per step':16}" + "".join(f"{n:>11}" for n in names)
    head += "".join(f"{n + '/' + base:>16}" for n in names[1:])
    if r["host"]:
        head += "".join(f"{'floor' + tag[d]:>11}{'best/floor' + tag[d]:>16}" + (f"{'paired' + tag[d]:>12}" if paired else "")
                        for d in dtypes)
    lines = [f"{r['model']}, {r['threads']} thread(s), {r['malloc']} malloc, torch {r['torch']}", head]
    for case, row in r["cases"].items():
        line = f"{case:16}" + "".join(f"{1e3 * row[n]:11.1f}" for n in names)
        line += "".join(f"{row[n] / row[base]:16.2f}" for n in names[1:])
        for d in dtypes:
            if "floor" + suffix[d] in row:
                best = min(row[n] for n in names if _dtype(n) == d)
                line += f"{1e3 * row['floor' + suffix[d]]:11.1f}{best / row['floor' + suffix[d]]:16.2f}"
            if "paired" + suffix[d] in row:
                line += f"{row['paired' + suffix[d]]:12.2f}"
        lines.append(line)
    if r["host"]:
        def rates(h: dict) -> str:
            return f"{h['bandwidth'] / 1e9:.1f} GB/s read, " + ", ".join(
                f"{h['flops' + suffix[d]] / 1e9:.1f} GFLOP/s {d} matmul" for d in dtypes)
        lines.append(f"host: {rates(r['host'])} (the best of " + "; ".join(map(rates, r["host_samples"])) + ")")
    if paired:
        lines.append("paired: the median over rounds of the round's best step (of that dtype) over the floor from "
                     "the host measured at the round's start")
    lines.append(f"recompilations after warm-up: {r['recompilations']}")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
