"""One run that says whether pdserve works on a CUDA machine, written to one JSON file.

Checks, each independent (a failing one never stops the others) and recorded as
`{"name", "ok", "seconds", "error", ...figures}`:
- `kv_transfer` (microbench/device_kv.py): a KV transfer between two processes on the one device
  through the project's channel (kv_transfer: KVReceiver in one process, KVSender in the other;
  on one GPU the channel picks gloo with pinned staging, NCCL needing two devices): device
  tensors in, bit-identical device tensors out, bytes/s on the wire.
- `token_exact/<dtype>/<path>`: the engine's greedy tokens against transformers' `generate` (the
  same checkpoint, dtype and device, one prompt at a time) for `eager`, `compiled`
  (engine.compile: on) and, on CUDA, `cuda_graphs` (compiled, decode steps replaying captured
  CUDA graphs): recompilations after warm-up must be 0; the graphs variant records the decode
  buckets it captured. bfloat16 is skipped, with the reason, where the device does not compute it.
- `bench_engine`: microbench/batching.py's continuous batching against `generate` in static batches:
  tok/s of both and the ratio (a figure, not a pass mark).

The exit code is 0 only if every check ran ok. The JSON is rewritten after each check, so a run
cut short by the wrapper's timeout still leaves what it finished. `--device cpu` runs the same
logic here (tests/test_device_check.py); `--isolate` (the default on CUDA) runs each check in a
child process, so a CUDA fault in one cannot poison the others.

    python -m microbench.device_check [--device cuda|cpu] [--model DIR] [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from microbench.device_kv import check_kv_transfer

DEFAULT_MODEL = "models/smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: `--quick` shrinks every check."""

    prompts: int
    max_tokens: int
    bench_requests: int
    bench_batch: int
    bench_prompt: tuple[int, int]
    bench_output: tuple[int, int]
    kv_blocks: int
    kv_transfers: int


FULL = Plan(prompts=8, max_tokens=24, bench_requests=64, bench_batch=32, bench_prompt=(16, 512),
            bench_output=(16, 256), kv_blocks=512, kv_transfers=4)
QUICK = Plan(prompts=4, max_tokens=8, bench_requests=8, bench_batch=4, bench_prompt=(8, 48),
             bench_output=(4, 16), kv_blocks=32, kv_transfers=2)


def environment(device: torch.device) -> dict:
    env = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "host": platform.node()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported())
    else:
        env.update(name=platform.processor() or platform.machine(), bf16=_computes_bf16(device))
    return env


def _computes_bf16(device: torch.device) -> bool:
    from engine.model_runner import computes_bf16

    return computes_bf16(device)


# ---------------------------------------------------------------- token-exactness


def _prompts(model: str, n: int, seed: int = 7) -> list[list[int]]:
    """Slices of English prose (the tiny checkpoints' corpus) through the model's tokenizer, from
    1 to 70 tokens: single-token prompts, several 16-token chunks, decode batches of every width
    up to n (3, 5, ... are padded to a CUDA-graph bucket). Prose rather than random ids: its next
    tokens are rarely near-ties, which low precision could flip either way."""
    from transformers import AutoTokenizer

    from checkpoints.tiny import CORPUS_DIR

    text = "\n".join((CORPUS_DIR / name).read_text()[:3000] for name in ("stories.txt", "essays.txt"))
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    rng = random.Random(seed)
    lengths = [1, 70] + [rng.randint(2, 60) for _ in range(max(n - 2, 0))]
    starts = [rng.randrange(0, len(ids) - 70) for _ in lengths]
    return [ids[s:s + k] for s, k in zip(starts, lengths[:n], strict=False)]


@functools.lru_cache(maxsize=2)
def _reference_model(path: str, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def hf_greedy(path: str, dtype: str, device: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate`, one prompt, never stopping early (as the engine's ignore_eos)."""
    model = _reference_model(path, dtype, device)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = model.config.vocab_size + 1  # an id no token can take
    config.pad_token_id = 0
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def staggered_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Arrivals staggered one per step, so steps mix decodes, fresh prompts and chunks, and the
    decode batch widens one row at a time."""
    from protocol.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", prompt_token_ids=p, sampling=sampling)
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    engine.check()
    return [out[f"r{i}"] for i in range(len(prompts))]


def _recorded_cuda_graphs(device: torch.device) -> int | None:
    """How many CUDA graphs inductor's graph trees hold on `device` (a private structure: None
    where this torch lays it out differently)."""
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
        if manager is None:
            return 0
        count, todo = 0, list(manager.get_roots())
        while todo:
            node = todo.pop()
            count += 1
            todo.extend(child for children in node.children.values() for child in children)
        return count
    except Exception:  # noqa: BLE001 - a figure for the report, never a failure
        return None


def check_token_exact(model: str, device: torch.device, dtype: str, path: str, plan: Plan) -> dict:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    if dtype == "bfloat16" and not _computes_bf16(device):
        return {"skipped": f"this {device.type} does not compute bfloat16 natively"}
    if path == "cuda_graphs" and device.type != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device"}
    import torch._dynamo

    torch._dynamo.reset()  # each variant compiles from scratch, within dynamo's recompile limit
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model_path=model, dtype=dtype, device=str(device), num_blocks=256,
                                    chunk_size=16, max_num_batched_tokens=64, max_num_seqs=16,
                                    compile="off" if path == "eager" else "on",
                                    cuda_graphs=path == "cuda_graphs"))
    ready_s = time.perf_counter() - t0
    forward = engine.runner.forward
    warm_graph_steps = forward.graph_steps
    prompts = _prompts(model, plan.prompts)
    t1 = time.perf_counter()
    got = staggered_tokens(engine, prompts, plan.max_tokens)
    engine_s = time.perf_counter() - t1
    want = [hf_greedy(model, dtype, str(device), p, plan.max_tokens) for p in prompts]
    mismatches = [_mismatch(model, dtype, str(device), i, p, g, w)
                  for i, (p, g, w) in enumerate(zip(prompts, got, want, strict=True)) if g != w]
    result = {
        "describe": engine.runner.describe(), "prompts": len(prompts), "max_tokens": plan.max_tokens,
        "mismatches": mismatches, "ready_seconds": round(ready_s, 2), "engine_seconds": round(engine_s, 2),
        "compiled": forward.compiled, "fallback_reason": forward.fallback_reason,
        "recompilations": forward.recompilations,
        "free_blocks": engine.allocator.num_free, "total_blocks": engine.allocator.num_blocks,
    }
    problems = [f"{len(mismatches)} of {len(prompts)} prompts differ from generate"] if mismatches else []
    if forward.recompilations:
        problems.append(f"{forward.recompilations} recompilations after warm-up")
    if path != "eager" and not forward.compiled:
        problems.append(f"did not compile: {forward.fallback_reason}")
    if engine.allocator.num_used:
        problems.append(f"{engine.allocator.num_used} KV blocks still held after every request finished")
    if path == "cuda_graphs":
        result.update(buckets=list(forward.captured), graphs_reason=forward.graphs_reason,
                      capture_skips=forward.capture_skips, recorded_graphs=_recorded_cuda_graphs(device),
                      graph_steps=forward.graph_steps - warm_graph_steps)
        if not forward.cuda_graphs:
            problems.append(f"no CUDA graphs captured: {forward.graphs_reason}")
        elif not result["graph_steps"]:
            problems.append("no decode step replayed the captured graphs")
    if problems:
        result["error"] = "; ".join(problems)
    return result


def _mismatch(model: str, dtype: str, device: str, index: int, prompt: list[int], got: list[int],
              want: list[int]) -> dict:
    """Where the engine left `generate`'s tokens, and by how much `generate`'s own logits preferred
    its token there: a gap of a few bf16 ulps is a near-tie rounding flipped, a large one a bug."""
    at = next((i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), min(len(got), len(want)))
    found = {"prompt": index, "prompt_len": len(prompt), "first_diff": at}
    if at < min(len(got), len(want)):
        hf = _reference_model(model, dtype, device)
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + want[:at]], device=device)).logits[0, -1].float()
        found.update(engine_token=got[at], generate_token=want[at],
                     generate_logit_gap=round(float(logits[want[at]] - logits[got[at]]), 5))
    return found


# ---------------------------------------------------------------- bench_engine


def check_bench(model: str, device: torch.device, plan: Plan) -> dict:
    from microbench import batching as bench_engine

    dtype = "bfloat16" if _computes_bf16(device) else "float32"
    cuda = device.type == "cuda"
    requests = bench_engine.make_requests(plan.bench_requests, 0, plan.bench_prompt, plan.bench_output,
                                          min(_vocab(model), 11000))
    threads = torch.get_num_threads()
    engine = bench_engine.run_engine(model, requests, plan.bench_batch, 512, 2048, threads, device=str(device),
                                     dtype=dtype, cuda_graphs=cuda)
    static = bench_engine.run_generate(model, requests, plan.bench_batch, device=str(device), dtype=dtype)
    want = sum(n for _, n in requests)
    result = {"dtype": dtype, "requests": plan.bench_requests, "batch": plan.bench_batch,
              "engine_tok_per_s": round(engine["tok_per_s"], 1), "generate_tok_per_s": round(static["tok_per_s"], 1),
              "ratio": round(engine["tok_per_s"] / static["tok_per_s"], 3),
              "engine_mean_decode_step_ms": round(engine["mean_decode_step_ms"], 2),
              "engine_outside_forward_share": round(engine["outside_forward_share"], 3)}
    if engine["output_tokens"] != want:
        result["error"] = f"the engine produced {engine['output_tokens']} tokens, not {want}"
    return result


def _vocab(model: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).vocab_size


# ---------------------------------------------------------------- running


def planned_checks(device: torch.device, model: str, plan: Plan) -> dict[str, Callable[[], dict]]:
    """Name -> the check, in the order they run: the cheap ones first, so a run cut short by the
    wrapper's timeout has done the most."""
    checks: dict[str, Callable[[], dict]] = {
        "kv_transfer": lambda: check_kv_transfer(device, plan.kv_blocks, plan.kv_transfers)}

    def token_exact(dtype: str, path: str) -> None:
        checks[f"token_exact/{dtype}/{path}"] = functools.partial(check_token_exact, model, device, dtype,
                                                                  path, plan)

    for dtype in DTYPES:
        token_exact(dtype, "eager")
    if device.type == "cuda":  # graphs before plain compiled: their prefill steps run the plain graph too
        for dtype in DTYPES:
            token_exact(dtype, "cuda_graphs")
    checks["bench_engine"] = lambda: check_bench(model, device, plan)
    for dtype in DTYPES:
        token_exact(dtype, "compiled")
    return checks


def select(checks: dict[str, Callable[[], dict]], wanted: str | None) -> dict[str, Callable[[], dict]]:
    """The checks whose names start with one of the comma-separated prefixes in `wanted`."""
    if not wanted:
        return checks
    prefixes = [w.strip() for w in wanted.split(",") if w.strip()]
    chosen = {name: fn for name, fn in checks.items() if any(name.startswith(p) for p in prefixes)}
    if not chosen:
        raise SystemExit(f"device_check: --checks {wanted!r} names none of: {', '.join(checks)}")
    return chosen


def run_check(name: str, fn: Callable[[], dict]) -> dict:
    t0 = time.perf_counter()
    try:
        figures = fn()
        error = figures.pop("error", None)
    except Exception as exc:  # noqa: BLE001 - a failing check never stops the others
        figures, error = {"traceback": traceback.format_exc(limit=6)}, f"{type(exc).__name__}: {exc}"
    return {"name": name, "ok": error is None, "seconds": round(time.perf_counter() - t0, 2), "error": error,
            **figures}


def run_isolated(name: str, args: argparse.Namespace, timeout_s: float) -> dict:
    """`name` in a child process of this script (`--only`), within `timeout_s`."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, "-m", "microbench.device_check", "--device", args.device, "--model", args.model,
               "--out", str(out), "--only", name, "--no-isolate"] + (["--quick"] if args.quick else [])
        # its own process group: a timeout ends its children too (the KV check's two, compile workers)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
            return {"name": name, "ok": False, "seconds": round(time.perf_counter() - t0, 2),
                    "error": f"did not finish within {timeout_s:.0f} s"}
        if out.exists():  # the child's own process start and imports counted too
            return {**json.loads(out.read_text())["checks"][0],
                    "process_seconds": round(time.perf_counter() - t0, 2)}
        return {"name": name, "ok": False, "seconds": round(time.perf_counter() - t0, 2),
                "error": f"the child exited {proc.returncode} without a result", "stderr": stderr[-2000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default="device_check.json")
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens, requests and blocks")
    ap.add_argument("--budget", type=float, default=450.0,
                    help="seconds for the whole run: a check is not started past it")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each check in its own process (default: on CUDA)")
    ap.add_argument("--checks", help="comma-separated name prefixes, e.g. kv_transfer,token_exact/float32")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # one check, for --isolate's children
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: --device cuda but torch sees no CUDA device "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    isolate = args.device == "cuda" if args.isolate is None else args.isolate
    plan = QUICK if args.quick else FULL
    checks = select(planned_checks(device, args.model, plan), args.checks)
    if args.only:
        checks = {args.only: checks[args.only]}
    report = {"environment": environment(device), "model": args.model, "quick": args.quick, "checks": []}
    start = time.monotonic()
    for name, fn in checks.items():
        left = args.budget - (time.monotonic() - start)
        if left <= 5:
            record = {"name": name, "ok": False, "seconds": 0.0, "error": f"not run: the {args.budget:.0f} s budget was spent"}
        elif isolate:
            record = run_isolated(name, args, left)
        else:
            record = run_check(name, fn)
        report["checks"].append(record)
        print(f"{'ok  ' if record['ok'] else 'FAIL'} {name} ({record['seconds']} s)"
              + (f": {record['error']}" if record["error"] else ""), flush=True)
        _write(args.out, report)
    report["ok"] = all(c["ok"] for c in report["checks"])
    report["seconds"] = round(time.monotonic() - start, 1)
    _write(args.out, report)
    return 0 if report["ok"] else 1


def _write(path: str, report: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
