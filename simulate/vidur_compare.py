"""Vidur (MLSys'24, the `vidur` package) on a window of a Mooncake trace: `pdserve simulate`'s external reference.

    python -m simulate.vidur_compare --vidur-python /work/vidur-venv/bin/python \
        --trace mooncake_conversation_trace.jsonl --window 0:120 --replicas 16 \
        --device h100 --model meta-llama/Meta-Llama-3-8B --json

Vidur runs in its own Python (a venv with `pip install vidur`) in a subprocess with a timeout: a colocated
cluster of `--replicas` replicas at tensor parallel 1, Sarathi chunked prefill (`--chunk-size` is its
per-step token budget), round-robin placement, no prefix caching. The window's requests go to Vidur as
its trace-replay CSV (Date, Time in s from the window's start, PromptTokenCount, CompletionTokenCount).
TTFT is Vidur's per-request `prefill_e2e_time`; ITL its `decode_token_execution_plus_preemption_time`
(a DDSketch, read at its 1% quantiles). Where Vidur cannot run (not importable; its profiles not on
this machine and the hub not reachable) the JSON has ran=false and why_not: the error and the hub
datasets it asked for.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRACE_DATE = "2024-01-01"  # Vidur's trace replay keeps the rows of one `Date`
HUB_MARK = "VIDUR_COMPARE_HUB "
PROBE_MARK = "VIDUR_COMPARE_PROBE "

# Run in Vidur's Python: its version, the model names it has a config for, the one `argv[1]` names,
# the hub datasets its predictor reads its profiles from by default, and the KV pool its memory
# planner gives one replica at tensor parallel 1 (tokens).
PROBE = f"""
import json, re, sys
from importlib.metadata import version
from vidur.config import CacheConfig, RandomForrestExecutionTimePredictorConfig, ReplicaConfig
from vidur.config.model_config import BaseModelConfig
from vidur.utils.memory_planner import MemoryPlanner

def key(name):
    return re.sub(r"meta-|-hf$", "", name.lower())

def subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)

names = sorted({{c.get_name() for c in subclasses(BaseModelConfig)}})
model = next((n for n in names if key(n) == key(sys.argv[1])), None)
predictor = RandomForrestExecutionTimePredictorConfig()
out = {{"version": version("vidur"), "models": names, "model": model,
        "profiles": [predictor.model_profiling_dataset, predictor.network_profiling_dataset]}}
if model is not None:
    replica = ReplicaConfig(model_name=model, device=sys.argv[2], network_device=sys.argv[2] + "_dgx",
                            tensor_parallel_size=1, num_pipeline_stages=1)
    cache = CacheConfig()
    out["kv_tokens"] = int(MemoryPlanner(replica, cache).get_max_kv_cache_size_in_tokens())
    out["memory_margin_fraction"] = cache.memory_margin_fraction
    out["device_memory_gb"] = replica.device_config.total_memory_gb
print({PROBE_MARK!r} + json.dumps(out))
"""

# Vidur's `python -m vidur.main`, with every hub download it asks for named on stderr first.
BOOTSTRAP = f"""
import json, runpy, sys
from importlib.util import find_spec
if find_spec("vidur.execution_time_predictor.sklearn_execution_time_predictor"):
    import vidur.execution_time_predictor.sklearn_execution_time_predictor as predictor
    if hasattr(predictor, "snapshot_download"):
        fetch = predictor.snapshot_download
        def logged(repo_id, **kw):
            url = "https://huggingface.co/datasets/" + repo_id
            print({HUB_MARK!r} + json.dumps({{"repo_id": repo_id, "url": url}}), file=sys.stderr, flush=True)
            return fetch(repo_id=repo_id, **kw)
        predictor.snapshot_download = logged
sys.argv = ["vidur.main", *sys.argv[1:]]
runpy.run_module("vidur.main", run_name="__main__")
"""


def parse_window(text: str) -> tuple[float, float]:
    """`START:END` in seconds of the trace's clock."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*:\s*(\d+(?:\.\d*)?)\s*", text)
    if not match or float(match[1]) >= float(match[2]):
        raise argparse.ArgumentTypeError(f"--window wants START:END seconds with START < END, got {text!r}")
    return float(match[1]), float(match[2])


def load_window(trace: Path, start: float, end: float) -> list[dict]:
    """The Mooncake records (timestamp ms, input_length, output_length) arriving in [start, end) s."""
    rows = []
    with trace.open() as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if start <= row["timestamp"] / 1000 < end:
                    rows.append(row)
    return rows


def write_vidur_trace(rows: list[dict], path: Path, start: float, max_tokens: int) -> dict:
    """Vidur's trace-replay CSV of `rows`, arrivals from the window's start; the workload summary."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for row in rows:
            out.writerow([TRACE_DATE, row["timestamp"] / 1000 - start, row["input_length"], row["output_length"]])
    return {"requests": len(rows), "input_tokens": sum(r["input_length"] for r in rows),
            "output_tokens": sum(r["output_length"] for r in rows),
            "longest_request_tokens": max((r["input_length"] + r["output_length"] for r in rows), default=0),
            "truncated_by_vidur": sum(r["input_length"] + r["output_length"] > max_tokens for r in rows),
            "zero_output_raised_to_1": sum(r["output_length"] < 1 for r in rows)}


def probe(python: str, model: str, device: str, timeout: float) -> dict:
    """What Vidur's Python knows (see PROBE); {"error": ...} if it cannot say."""
    proc = subprocess.run([python, "-c", PROBE, model, device], capture_output=True, text=True,
                          timeout=timeout, env=vidur_env())
    for line in proc.stdout.splitlines():
        if line.startswith(PROBE_MARK):
            return json.loads(line[len(PROBE_MARK):])
    return {"error": last_error(proc.stderr) or f"probe exited {proc.returncode} with no answer"}


def vidur_env() -> dict[str, str]:
    """No wandb, one thread for its numeric libraries (the host is shared)."""
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def scheduler_config(args: argparse.Namespace, model: str, max_tokens: int) -> dict:
    """The Vidur settings of this run, as they go on its command line (the JSON's `config`)."""
    return {"model": model, "device": args.device, "network_device": f"{args.device}_dgx",
            "num_replicas": args.replicas, "tensor_parallel_size": 1, "num_pipeline_stages": 1,
            "global_scheduler": "round_robin", "replica_scheduler": "sarathi", "chunk_size": args.chunk_size,
            "batch_size_cap": args.batch_cap, "block_size": 16, "max_tokens": max_tokens,
            "execution_time_predictor": "random_forrest", "training_threads": args.threads, "seed": args.seed,
            "extra_flags": args.vidur_flag}


def vidur_args(cfg: dict, trace_csv: Path, out_dir: Path) -> list[str]:
    """`python -m vidur.main` flags for `cfg` (see scheduler_config)."""
    predictor = f"--{cfg['execution_time_predictor']}_execution_time_predictor_config"
    flags = {"--seed": cfg["seed"], "--cluster_config_num_replicas": cfg["num_replicas"],
             "--replica_config_model_name": cfg["model"], "--replica_config_device": cfg["device"],
             "--replica_config_network_device": cfg["network_device"],
             "--replica_config_tensor_parallel_size": 1, "--replica_config_num_pipeline_stages": 1,
             "--cache_config_block_size": cfg["block_size"],
             "--cache_config_num_blocks": cfg["kv_tokens"] // cfg["block_size"],
             "--global_scheduler_config_type": cfg["global_scheduler"],
             "--replica_scheduler_config_type": cfg["replica_scheduler"],
             "--sarathi_scheduler_config_chunk_size": cfg["chunk_size"],
             "--sarathi_scheduler_config_batch_size_cap": cfg["batch_size_cap"],
             "--request_generator_config_type": "trace_replay",
             "--trace_request_generator_config_trace_file": trace_csv,
             "--trace_request_generator_config_date": TRACE_DATE,
             "--trace_request_generator_config_max_tokens": cfg["max_tokens"],
             "--trace_request_generator_config_prefill_scale_factor": 1,
             "--trace_request_generator_config_decode_scale_factor": 1,
             "--trace_request_generator_config_time_scale_factor": 1,
             "--execution_time_predictor_config_type": cfg["execution_time_predictor"],
             f"{predictor}_num_training_job_threads": cfg["training_threads"],
             f"{predictor}_cache_dir": out_dir / "cache",
             "--metrics_config_output_dir": out_dir / "metrics"}
    switches = ["--metrics_config_store_token_completion_metrics", "--no-metrics_config_store_plots",
                "--no-metrics_config_enable_chrome_trace", "--no-metrics_config_store_batch_metrics",
                "--no-metrics_config_store_utilization_metrics", "--no-cache_config_enable_prefix_caching"]
    return [str(x) for pair in flags.items() for x in pair] + switches + cfg["extra_flags"]


def last_error(stderr: str) -> str | None:
    """The exception line that ends a traceback, with the line after it when the message runs on."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", lines[i]) or re.match(r"^[\w.]+Error$", lines[i]):
            return " ".join(lines[i:i + 2])
    return None


def hub_requests(stderr: str) -> list[dict]:
    """The hub datasets Vidur asked for, in order, each once (BOOTSTRAP's marks)."""
    seen: dict[str, dict] = {}
    for line in stderr.splitlines():
        if line.startswith(HUB_MARK):
            req = json.loads(line[len(HUB_MARK):])
            seen.setdefault(req["repo_id"], req)
    return list(seen.values())


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def read_metrics(out_dir: Path) -> dict:
    """TTFT, ITL and TPOT in ms at p50/p90/p99 from Vidur's newest run under `out_dir` (its seconds)."""
    runs = sorted(out_dir.rglob("request_metrics.csv"), key=lambda path: path.stat().st_mtime)
    if not runs:
        raise FileNotFoundError(f"Vidur wrote no request_metrics.csv under {out_dir}")
    with runs[-1].open() as f:
        rows = list(csv.DictReader(f))
    ttft = [float(r["prefill_e2e_time"]) for r in rows if r.get("prefill_e2e_time")]
    tpot = [float(r["decode_time_execution_plus_preemption_normalized"]) for r in rows
            if r.get("decode_time_execution_plus_preemption_normalized")]
    qs = (50, 90, 99)
    return {"ttft_ms": {f"p{q}": 1000 * percentile(ttft, q) for q in qs},
            "itl_ms": read_itl(runs[-1].parent / "plots" / "decode_token_execution_plus_preemption_time.csv", qs),
            "tpot_ms": {f"p{q}": 1000 * percentile(tpot, q) for q in qs},
            "requests_completed": len(ttft)}


def read_itl(path: Path, qs: tuple[int, ...]) -> dict[str, float] | None:
    """ITL quantiles (ms) from Vidur's DDSketch CDF file (1% steps); None if no decode token ran."""
    if not path.is_file():
        return None
    with path.open() as f:
        cdf = {round(float(r["cdf"]), 2): float(r["decode_token_execution_plus_preemption_time"])
               for r in csv.DictReader(f)}
    return {f"p{q}": 1000 * cdf[q / 100] for q in qs}


def run_vidur(python: str, argv: list[str], timeout: float, log: Path) -> tuple[int | None, str, float]:
    """Vidur's main in a subprocess: exit code (None on timeout), its stderr, wall seconds."""
    began = time.monotonic()
    with log.open("w") as out:
        try:
            proc = subprocess.run([python, "-c", BOOTSTRAP, *argv], stdout=out, stderr=subprocess.PIPE,
                                  text=True, timeout=timeout, env=vidur_env())
            code, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, stderr = None, exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
    log.with_suffix(".stderr").write_text(stderr)
    return code, stderr, time.monotonic() - began


def why_not(code: int | None, stderr: str, timeout: float, profiles: list[str]) -> str:
    """One paragraph: what stopped Vidur, what it asked the hub for, the profiles it reads."""
    if code is None:
        reason = f"Vidur did not finish within {timeout:g} s"
    else:
        reason = last_error(stderr) or f"Vidur exited {code}"
    asked = hub_requests(stderr)
    if asked:
        reason += ("; Vidur fetches its profiles (mlp/attention/all_reduce/send_recv .csv.xz) or its "
                   "trained predictions from the hub at run time and ships none: it asked for "
                   + ", ".join(req["url"] for req in asked)
                   + f" (its profiles: the datasets {' and '.join(profiles)})")
    return reason


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vidur-python", required=True, help="a python with `vidur` installed")
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL")
    parser.add_argument("--window", type=parse_window, default=(0.0, 120.0), help="START:END s (default 0:120)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--device", default="h100", choices=("h100", "a100"))
    parser.add_argument("--model", default="meta-llama/Meta-Llama-3-8B")
    parser.add_argument("--chunk-size", type=int, default=256, help="Sarathi's token budget per step (default 256)")
    parser.add_argument("--batch-cap", type=int, default=64, help="requests in a replica's batch (default 64)")
    parser.add_argument("--max-model-len", type=int, default=131072,
                        help="Vidur's max_tokens: longer requests lose prompt tokens (default 131072)")
    parser.add_argument("--threads", type=int, default=1, help="Vidur's predictor-training jobs (default 1)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--vidur-flag", action="append", default=[], metavar="--NAME=VALUE",
                        help="one more flag for vidur.main, as it takes it (repeatable)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for Vidur's run (default 1800)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep Vidur's files here (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file")
    if args.replicas < 1 or args.chunk_size < 1 or args.batch_cap < 1:
        parser.error("--replicas, --chunk-size and --batch-cap must be at least 1")
    return args


def compare(args: argparse.Namespace, work: Path) -> dict:
    """Convert, probe, run and read Vidur; the report (ran=false with why_not where it stops)."""
    start, end = args.window
    rows = load_window(args.trace, start, end)
    max_tokens = min(args.max_model_len, max((r["input_length"] + r["output_length"] for r in rows), default=1))
    trace_csv = work / "vidur_trace.csv"
    workload = {"trace": str(args.trace), "window_s": [start, end],
                **write_vidur_trace(rows, trace_csv, start, max_tokens), "vidur_trace": str(trace_csv)}
    report: dict = {"ran": False, "why_not": None, "workload": workload, "command": None, "vidur": None}
    if not Path(args.vidur_python).is_file():
        return {**report, "why_not": f"--vidur-python {args.vidur_python}: no such interpreter"}
    known = probe(args.vidur_python, args.model, args.device, min(args.timeout, 300))
    if "error" in known or known["model"] is None:
        why = known.get("error") or f"Vidur has no model config matching {args.model!r}; it has {known['models']}"
        return {**report, "why_not": why, "vidur_package": known}
    cfg = scheduler_config(args, known["model"], max_tokens)
    cfg.update({k: known[k] for k in ("kv_tokens", "memory_margin_fraction", "device_memory_gb", "profiles")})
    argv = vidur_args(cfg, trace_csv, work)
    report.update(config=cfg, vidur_package={"version": known["version"]},
                  command=" ".join([args.vidur_python, "-m", "vidur.main", *argv]))
    code, stderr, wall = run_vidur(args.vidur_python, argv, args.timeout, work / "vidur.log")
    report["wall_s"] = round(wall, 1)
    if args.work_dir:
        report["work_dir"] = str(work)
    if code != 0:
        return {**report, "why_not": why_not(code, stderr, args.timeout, cfg["profiles"])}
    try:
        return {**report, "ran": True, "vidur": read_metrics(work / "metrics")}
    except FileNotFoundError as exc:
        return {**report, "why_not": str(exc)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        report = compare(args, args.work_dir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="vidur-") as tmp:
            report = compare(args, Path(tmp))
    if args.json:
        print(json.dumps(report, indent=2))
    elif report["ran"]:
        cfg, figures = report["config"], report["vidur"]
        print(f"Vidur {cfg['replica_scheduler']} x{cfg['num_replicas']} {cfg['device']} {cfg['model']}: "
              + ", ".join(f"{name} p50/p99 {quantiles['p50']:.1f}/{quantiles['p99']:.1f} ms"
                          for name, quantiles in figures.items() if isinstance(quantiles, dict)))
    else:
        print(f"Vidur did not run: {report['why_not']}")
    return 0 if report["ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
