"""The simulator's error, measured: `pdserve simulate` against the clusters it stands for.

    python -m simulate.fidelity [--json] [--only emulated,real,external] [--time-scale 8]

- vs_emulated: `pdserve bench --emulate h100:llama-3.1-8b` (the tests' tiny model computing the
  tokens, every step paced to the H100 model at `--time-scale`, its figures divided back) against
  `pdserve simulate` of the same config, arrangements and seeded workload: 1P+1D and colocated x2.
  The emulated run's own fidelity (its late steps) is printed beside it: an emulated run that is not
  faithful is no reference.
- vs_real: the real SmolLM2 cluster on this CPU (`pdserve bench`, no emulation) against
  `pdserve simulate --emulate host` (this host's profile, measured first: simulate/host.py), and
  against the host fitted to the run's records: its steps (`calibrated`), its steps and serving
  path (`served`, simulate/serving.py), another run's (`held_out`, with `--calibration DIR`).
- speed (with `--only speed`): simulated seconds per host second at 8-64 devices.
- vs_external: Vidur (simulate/vidur_compare.py) on a window of the Mooncake conversation trace,
  colocated, against `pdserve simulate` of the same window; null with the reason if it cannot run.

Each entry gives, per arrangement, TTFT and ITL p50 / p99 of the reference and the simulation (ms)
and the relative error (simulated / reference - 1), the workload and the commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
KEYS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"))
TRACE = ROOT / "bench" / "data" / "conversation_window.jsonl"  # --trace: Mooncake's whole conversation trace
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"


def _cli(args: list[str], timeout_s: float) -> dict:
    """`pdserve ARGS --json`'s summary."""
    done = subprocess.run([PY, "-m", "cli", *args, "--json", "--no-progress"], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout_s, env=os.environ | {"RAY_USAGE_STATS_ENABLED": "0"})
    if done.returncode != 0:
        raise RuntimeError(f"pdserve {' '.join(args[:1])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _config(path: Path, model: Path, tiny: bool) -> Path:
    lines = [f"model: {{path: {model}{', create_tiny: llama' if tiny else ''}}}",
             "router: {port: 0, metrics_port: null, http_port: null, worker_start_timeout_s: 900}",
             "prefill: {replicas: 1, num_cpus: 0.5}", "decode: {replicas: 1, num_cpus: 0.5}",
             "kv_cache: {block_size: 16, memory: 64MiB}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def compare(reference: dict, simulated: dict) -> dict:
    """Per arrangement: each figure's reference, simulated value and relative error."""
    out = {}
    for name, ref in reference["arrangements"].items():
        sim = simulated["arrangements"][name]
        row = {}
        for metric, q in KEYS:
            r, s = ref[metric][q], sim[metric][q]
            row[f"{metric[:-3]}_{q}"] = {"reference_ms": r, "simulated_ms": s,
                                          "error": None if not r else s / r - 1}
        row["failed"] = {"reference": ref["num_errors"], "simulated": sim["num_errors"]}
        disturbed = _disturbed(reference, name)
        if disturbed:  # the reference lost a worker: its figures are no measure of the simulator's error
            row["reference_disturbed"] = disturbed
        out[name] = row
    return out


def _disturbed(reference: dict, name: str) -> str | None:
    """Why a reference run's arrangement is not a fair reference (a worker restarted, requests
    failed), or None."""
    pools = (((reference.get("cluster") or {}).get("status") or {}).get(name) or {}).get("pools") or []
    restarts = sum(int(p.get("restarts") or 0) for p in pools)
    failures = [_failure(p["last_failure"]) for p in pools if p.get("last_failure")]
    errors = reference["arrangements"][name].get("num_errors") or 0
    if not restarts and not errors:
        return None
    return f"{restarts} worker restart(s), {errors} request(s) failed" + (f"; {'; '.join(failures)}" if failures else "")


def _failure(text: str) -> str:
    worker, _, why = text.partition(": ")
    if "out of memory" in why:
        why = "killed by Ray's memory monitor (the host ran out of memory)"
    return f"{worker}: {why[:120]}"


def vs_emulated(work: Path, k: float) -> dict:
    cfg = _config(work / "tiny.yaml", work / "tiny-llama", tiny=True)
    workload = ["--preset", "steady", "--num-requests", "40", "--rate", "4", "--input-len", "512",
                "--output-len", "64", "--seed", "1"]
    common = ["--config", str(cfg), "--emulate", "h100:llama-3.1-8b", "--arrangements", "disaggregated,colocated",
              "--workers", "2", *workload]
    bench = ["bench", *common, "--emulate-time-scale", f"{k:g}", "--out", str(work / "bench-emulated")]
    simulate = ["simulate", *common, "--out", str(work / "sim-emulated")]
    ref = _cli(bench, 1800)
    sim = _cli(simulate, 600)
    fidelity = {n: {key: a.get("emulation", {}).get(key) for key in ("faithful", "overrun_share", "suggested_time_scale")}
                for n, a in ref["arrangements"].items()}
    return {"workload": workload, "commands": {"reference": "pdserve " + " ".join(bench),
                                               "simulated": "pdserve " + " ".join(simulate)},
            "emulated_fidelity": fidelity, "arrangements": compare(ref, sim)}


def vs_real(work: Path, calibration: Path | None = None) -> dict:
    if not (SMOLLM2 / "config.json").is_file():
        return {"ran": False, "why_not": f"{SMOLLM2} is missing: `pdserve convert-gguf --smollm2 {SMOLLM2}` first"}
    cfg = _config(work / "smollm2.yaml", SMOLLM2, tiny=False)
    workload = ["--preset", "steady", "--num-requests", "48", "--rate", "0.5", "--input-len", "128",
                "--output-len", "16", "--seed", "1"]
    common = ["--config", str(cfg), "--arrangements", "disaggregated,colocated", "--workers", "2", *workload]
    bench = ["bench", *common, "--out", str(work / "bench-real")]
    simulate = ["simulate", *common, "--emulate", "host", "--out", str(work / "sim-real")]
    ref = _cli(bench, 1800)
    sim = _cli(simulate, 900)
    # the calibration fits, each arrangement's simulation on this host fitted to a real run's records:
    # calibrated: the engine's steps of this run; served: its steps and its serving path (simulate/serving.py);
    # held_out: steps and serving path of another run (--calibration DIR), not the one compared with
    fits = {"calibrated": "steps:{run}/steps.jsonl@{name}", "served": "run:{run}@{name}"}
    if calibration is not None:
        fits["held_out"] = "run:" + str(calibration) + "@{name}"
    out = {"workload": workload, "commands": {"reference": "pdserve " + " ".join(bench),
                                              "simulated": "pdserve " + " ".join(simulate)},
           "assumptions": sim["simulation"]["assumptions"], "arrangements": compare(ref, sim)}
    for key, emulate in fits.items():
        runs, commands = {"arrangements": {}}, []
        for name in ref["arrangements"]:
            cmd = ["simulate", *common[:2], "--arrangements", name, *common[4:], "--emulate",
                   emulate.format(run=work / "bench-real", name=name), "--out", str(work / f"sim-{key}-{name}")]
            runs["arrangements"][name] = _cli(cmd, 900)["arrangements"][name]
            commands.append("pdserve " + " ".join(cmd))
        out["commands"][key], out[key] = commands, compare(ref, runs)
    return out


def vs_external(work: Path, vidur_python: str | None, trace: Path) -> dict | None:
    script = ROOT / "simulate" / "vidur_compare.py"
    if not script.is_file() or not vidur_python:
        return None
    window, replicas = "0:120", "4"
    cmd = [PY, "-m", "simulate.vidur_compare", "--vidur-python", vidur_python, "--trace", str(trace), "--window", window,
           "--replicas", replicas, "--json"]
    vidur = json.loads(subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600).stdout)
    if not vidur.get("ran"):
        return {"ran": False, "why_not": vidur.get("why_not"), "command": " ".join(cmd)}
    simulate = ["simulate", "--config", str(ROOT / "cluster.yaml"), "--emulate", "h100:llama-3.1-8b",
                "--trace", str(trace), "--window", window, "--length-scale", "1", "--arrangements",
                "colocated-chunked", "--workers", replicas, "--out", str(work / "sim-vidur")]
    sim = _cli(simulate, 1800)["arrangements"]["colocated-chunked"]
    rows = {f"{m[:-3]}_{q}": {"vidur_ms": (vidur["vidur"].get(m) or {}).get(q), "simulated_ms": sim[m][q]}
            for m, q in KEYS}
    for row in rows.values():
        row["difference"] = None if not row["vidur_ms"] else row["simulated_ms"] / row["vidur_ms"] - 1
    return {"ran": True, "commands": {"vidur": " ".join(cmd), "simulated": "pdserve " + " ".join(simulate)},
            "vidur_config": vidur.get("config"), "figures": rows}


def speed(sizes: list[int], trace: Path) -> dict:
    """Simulated seconds per host second at each size: the Mooncake conversation trace's first
    120 s at its own rate and at 4x, and the diurnal preset (peak 2 requests/s per device); H100 x
    Llama-3.1-8B, disaggregated half and half (simulate/gpu_cluster.yaml)."""
    from bench.presets import WorkloadOptions, build_workload
    from router.config.loader import load_config
    from simulate.cli import cluster_configs, emulated
    from simulate.run import simulate

    base = load_config(str(ROOT / "simulate" / "gpu_cluster.yaml"))
    base, em = emulated(base, dataclasses.replace(base.emulate, device="h100", model="llama-3.1-8b"), "speed")
    def trace(k: float):
        return build_workload(WorkloadOptions(trace=str(trace), length_scale=1.0, time_scale=k, window=(0.0, 120.0),
                                              max_context=131_072, vocab=(16, 256)))
    out = {}
    for n in sizes:
        cfg = cluster_configs(base, "disaggregated", n, None)["disaggregated"]
        workloads = {"mooncake-1x": trace(1.0), "mooncake-4x": trace(4.0),
                     "diurnal": build_workload(WorkloadOptions(preset="diurnal", num_requests=50 * n, rate=2.0 * n,
                                                               input_len=1024, output_len=256, max_context=131_072))}
        for name, workload in workloads.items():
            run = simulate(cfg, em, workload, name)
            events = sum(len(w["steps"]) for w in run.steps.values())
            out.setdefault(str(n), {})[name] = {
                "requests": len(workload.requests), "failed": sum(not r.ok for r in run.records),
                "simulated_s": round(run.simulated_s, 2), "host_s": round(run.host_s, 2),
                "sim_s_per_host_s": round(run.simulated_s / run.host_s, 3), "engine_steps": events,
                "host_ms_per_step": round(run.host_s / max(events, 1) * 1e3, 3)}
            print(f"speed: {n} devices, {name}: {out[str(n)][name]}", file=sys.stderr)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="emulated,real,external", help="of emulated, real, external, speed")
    parser.add_argument("--sizes", default="8,16,32,64", help="devices, for speed (default 8,16,32,64)")
    parser.add_argument("--time-scale", type=float, default=8.0, help="the emulated cluster's (default 8)")
    parser.add_argument("--vidur-python", default=os.environ.get("VIDUR_PYTHON"),
                        help="a python with vidur installed (simulate/vidur_compare.py)")
    parser.add_argument("--trace", type=Path, default=TRACE,
                        help="the Mooncake conversation trace (docs/simulate.md) for speed and external "
                             "(default: the window of it bench ships)")
    parser.add_argument("--calibration", type=Path, metavar="DIR",
                        help="vs_real also fitted to another real run (a --keep DIR's bench-real): held_out")
    parser.add_argument("--keep", metavar="DIR", help="write the runs' reports here (default: a temporary directory)")
    parser.add_argument("--record", action="store_true",
                        help="save vs_emulated and vs_real in simulate/fidelity.json: `pdserve simulate` prints it")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-sim-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = {"vs_emulated": vs_emulated(work, args.time_scale) if "emulated" in only else None,
                  "vs_real": vs_real(work, args.calibration) if "real" in only else None,
                  "vs_external": vs_external(work, args.vidur_python, args.trace) if "external" in only else None}
        if "speed" in only:
            result["speed"] = speed([int(n) for n in args.sizes.split(",")], args.trace)
    if args.record:
        _record(result)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


def _record(result: dict) -> None:
    """What `pdserve simulate` prints as its error: the entries measured now, the others kept."""
    import platform
    import time

    path = ROOT / "simulate" / "fidelity.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    for key in ("vs_emulated", "vs_real", "vs_external"):
        if result.get(key):
            saved[key] = result[key]
    saved["measured"] = f"{time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} cores, {cpu}"
    path.write_text(json.dumps(saved, indent=2) + "\n")


def _table(result: dict) -> str:
    lines = []
    for entry, value in result.items():
        if not value or "arrangements" not in value:
            lines.append(f"{entry}: {json.dumps(value)}")
            continue
        lines.append(f"{entry}:  (reference / simulated ms, error)")
        for name, row in value["arrangements"].items():
            cells = [f"{k} {v['reference_ms']:.1f}/{v['simulated_ms']:.1f} {v['error']:+.1%}"
                     for k, v in row.items() if k not in ("failed", "reference_disturbed")]
            lines.append(f"  {name:<16} " + "; ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
