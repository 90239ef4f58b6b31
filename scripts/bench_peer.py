"""pdserve against a peer OpenAI-compatible server: the same checkpoint, CPU cores, requests, client.

One after the other: pdserve disaggregated (1 prefill + 1 decode worker, cores 0 and 1),
pdserve colocated (2 workers, cores 0 and 1) and `transformers serve --continuous-batching`
(transformers' own OpenAI server, pinned to cores 0 and 1 with 2 torch threads). Each gets a
short warm-up, then one closed-loop workload — 16 concurrent streams, prompts of 128-512
tokens, 64 output tokens (EOS ignored), 32 requests — replayed through the same client
(bench/openai_client.py: streaming /v1/completions). Prompts are random token ids made
stable under decode/encode, so pdserve (token ids) and the peer (their text) see the same
tokens. Prints one table (output tok/s, TTFT p50/p99, ITL p50/p99) and pdserve's ratios to the
peer (tok/s: > 1 is better; latencies: < 1 is better); `--json`: {"rows": [...], "ratios": {...}}.
Each server has `--timeout-s` to start and finish; every server started is stopped.

    python -m scripts.bench_peer [--model models/smollm2-135m-instruct] [--json] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import yaml  # noqa: E402
from transformers import AutoConfig, AutoTokenizer  # noqa: E402

from bench.arrangements import ARRANGEMENTS, arrangement_config  # noqa: E402
from bench.metrics import RequestRecord, Slo, summarize_run  # noqa: E402
from bench.openai_client import Endpoint, replay_openai  # noqa: E402
from bench.presets import WorkloadOptions, build_workload  # noqa: E402
from bench.workload import RequestSpec, Workload, make_workload  # noqa: E402
from router.config.loader import parse_config  # noqa: E402

PEER = "transformers"
SERVERS = ("pdserve-disaggregated", "pdserve-colocated", PEER)
CORES = (0, 1)
PEER_INSTALL = "pip install 'transformers[serving]' (it adds fastapi)"


def make_workload_for(tokenizer, args: argparse.Namespace) -> Workload:
    """The closed-loop workload, each prompt replaced by encode(decode(prompt)) (a fixed point)."""
    low, high = args.prompt_len
    mean, spread = (low + high) // 2, (high - low) / (high + low)
    opts = WorkloadOptions(preset="steady", num_requests=args.num_requests, concurrency=args.concurrency,
                           input_len=mean, range_ratio=spread, output_len=args.output_len, seed=args.seed,
                           max_context=8192, vocab=(100, min(40000, len(tokenizer))))
    workload = build_workload(opts)
    specs = [dataclasses.replace(s, prompt_token_ids=_stable(tokenizer, s.prompt_token_ids))
             for s in workload.requests]
    return make_workload(workload.name, specs, workload.concurrency, workload.metadata)


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


# ---- the servers: subprocesses, each a context manager yielding its /v1 URL -------------------
def pdserve_cmd(model: str, arrangement: str, http_port: int, workdir: Path) -> list[str]:
    """`pdserve serve` of `arrangement` on len(CORES) workers, worker i pinned to core i."""
    base = parse_config({"model": {"path": str(Path(model).resolve())},
                         "router": {"host": "127.0.0.1", "port": _free_port(), "metrics_port": None,
                                    "http_port": http_port, "shutdown_grace_s": 5},
                         "prefill": {"num_cpus": 1, "torch_threads": 1},
                         "decode": {"num_cpus": 1, "torch_threads": 1},
                         "kv_cache": {"block_size": 16, "memory": "768MiB"}}, where="bench_peer")
    config = workdir / f"{arrangement}.yaml"
    config.write_text(yaml.safe_dump(dataclasses.asdict(arrangement_config(base, arrangement, len(CORES), True))))
    return [str(Path(sys.executable).with_name("pdserve")), "serve", "--config", str(config),
            "--log-level", "WARNING"]


def peer_cmd(model: str, http_port: int) -> list[str]:
    """`transformers serve --continuous-batching`, pinned to CORES before it starts."""
    pin = f"import os, sys; os.sched_setaffinity(0, {set(CORES)}); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", pin, str(Path(sys.executable).with_name("transformers")), "serve", model,
            "--continuous-batching", "--device", "cpu", "--host", "127.0.0.1", "--port", str(http_port)]


@contextlib.contextmanager
def serving(cmd: list[str], http_port: int, timeout_s: float):
    """Runs `cmd` until its /health answers 200 (within `timeout_s`), yields its /v1 URL, and
    stops it at exit (SIGTERM to its process group, SIGKILL after 30 s)."""
    env = os.environ | {"OMP_NUM_THREADS": str(len(CORES))}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{http_port}/health", timeout_s, log)
            yield f"http://127.0.0.1:{http_port}/v1"
        finally:
            _stop(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read()[-1500:]
            hint = f" (the peer needs {PEER_INSTALL})" if "fastapi" in tail.lower() else ""
            raise RuntimeError(f"the server exited with {proc.returncode}{hint}:\n{tail}")
        with contextlib.suppress(OSError):  # not listening yet, or 503 while its workers start
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


# ---- measuring ------------------------------------------------------------------------------
def measure(name: str, cmd: list[str], http_port: int, endpoint: dict, workload: Workload,
            timeout_s: float) -> list[RequestRecord]:
    """Start the server, warm it up, replay `workload` through the OpenAI client, stop it; all
    within `timeout_s`."""
    print(f"bench_peer: {name}: starting", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    with serving(cmd, http_port, timeout_s) as url:
        async def run() -> list[RequestRecord]:
            await replay_openai(Endpoint(url, **endpoint), warm_up_workload(workload), f"{name} warm-up",
                                show_progress=False)
            return (await replay_openai(Endpoint(url, **endpoint), workload, name))[0]

        return asyncio.run(asyncio.wait_for(run(), max(1.0, deadline - time.monotonic())))


def row(name: str, records: list[RequestRecord]) -> dict:
    s = summarize_run(records, Slo())
    prompt = [r.prompt_tokens for r in records if r.ok]
    return {"server": name, "requests": s["num_requests"], "failed": s["num_errors"],
            "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else None,
            "output_tok_per_s": s["output_tok_per_s"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"], "itl_p50_ms": s["itl_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"]}


def ratios(rows: list[dict]) -> dict:
    """Each pdserve row over the peer's row, metric by metric."""
    peer = next((r for r in rows if r["server"] == PEER and not r.get("error")), None)
    out = {}
    for r in rows:
        if peer is None or r["server"] == PEER or r.get("error"):
            continue
        keys = ("output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
        out[r["server"]] = {k: r[k] / peer[k] if r[k] and peer[k] else None for k in keys}
    return out


_COLUMNS = (("tok/s", "output_tok_per_s"), ("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"),
            ("ITL p50", "itl_p50_ms"), ("ITL p99", "itl_p99_ms"))


def format_table(rows: list[dict], ratio: dict) -> str:
    lines = [f"{'server':<24}{'ok':>7}{'prompt':>8}" + "".join(f"{label:>10}" for label, _ in _COLUMNS)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['server']:<24}  failed: {r['error']}")
            continue
        cells = "".join(f"{r[key]:10.1f}" if r[key] is not None else f"{'-':>10}" for _, key in _COLUMNS)
        lines.append(f"{r['server']:<24}{r['requests'] - r['failed']:>4}/{r['requests']:<2}"
                     f"{r['mean_prompt_tokens'] or 0:8.0f}{cells}")
    for name, values in ratio.items():
        lines.append(f"{name} / {PEER}: " + ", ".join(f"{label} x{values[key]:.2f}" for label, key in _COLUMNS
                                                        if values[key] is not None))
    return "\n".join(lines + ["(ms; prompt: mean tokens the server counted; ratios: tok/s above 1 and "
                              "latencies below 1 favour pdserve)"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if len(os.sched_getaffinity(0)) < len(CORES):
        print(f"bench_peer: needs {len(CORES)} CPU cores", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    workload = make_workload_for(tokenizer, args)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    # the peer refuses ignore_eos; an end-of-sequence id no token has makes every output exact-length
    peer_body = {"extra_body": {"generation_config": json.dumps({"do_sample": False, "eos_token_id": vocab + 1})},
                 "tokenizer": args.model}
    rows, records = [], {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.servers:
            port = _free_port()
            cmd = peer_cmd(args.model, port) if name == PEER else pdserve_cmd(
                args.model, name.removeprefix("pdserve-"), port, Path(workdir))
            try:
                records[name] = measure(name, cmd, port, peer_body if name == PEER else {}, workload, args.timeout_s)
                rows.append(row(name, records[name]))
            except Exception as e:  # one server's failure is its row; the others still run
                reason = str(e) or f"not done within {args.timeout_s:g} s"
                rows.append({"server": name, "error": f"{type(e).__name__}: {reason}"})
    ratio = ratios(rows)
    print(json.dumps({"rows": rows, "ratios": ratio}, indent=2) if args.json else format_table(rows, ratio))
    if args.out:
        _write(Path(args.out), records, workload)
    return 0 if rows and not any(r.get("error") for r in rows) else 1


def _write(out: Path, records: dict[str, list[RequestRecord]], workload: Workload) -> None:
    from bench.report import build_summary, summarize_arrangements, write_report

    summary = build_summary(summarize_arrangements(records, Slo()), workload, Slo(), {"bench": "bench_peer"})
    for path in write_report(out, summary, records, plot=True):
        print(f"bench_peer: wrote {path}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct", help="checkpoint dir (default: %(default)s)")
    p.add_argument("--servers", default=",".join(SERVERS),
                   help="comma-separated, run in this order; pdserve-<any arrangement> (default: %(default)s)")
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
    args.servers = [name.strip() for name in args.servers.split(",") if name.strip()]
    unknown = [n for n in args.servers if n != PEER and n.removeprefix("pdserve-") not in ARRANGEMENTS]
    if unknown:
        p.error(f"--servers: unknown {unknown}; use pdserve-<{'|'.join(ARRANGEMENTS)}> or {PEER}")
    return args


if __name__ == "__main__":
    sys.exit(main())
