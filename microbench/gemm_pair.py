"""The bfloat16 GEMM of two builds side by side: this tree's kernels against a git revision's.

A change to the GEMM is judged by timing both builds in one process, taking turns call set by call
set, so a neighbour's load on this shared host falls on both alike: each round runs one model's
linears (every layer's q|k|v, o, gate|up and down, distinct random weights per layer, so they stream
from memory as a step's do) once on each build, in alternating order, and the figure is the median
of the rounds' paired time ratios. Both builds compile the kernels' sources with the engine's flags
(`kernel_build.flags`) into a scratch directory; their outputs must be the same bits.

    python -m microbench.gemm_pair [--base main] [--model DIR] [--rows 32,128,256] [--rounds 30]
                                   [--threads 1] [--no-amx] [--json]

`--rows` is a call's rows (a prompt step run as one region gives each thread tiles of up to 256 rows
on AMX, 128 for a 512-token step on two threads); `--no-amx` turns the tiles off in both builds
(`pd_use_amx(0)`), for the `vdpbf16ps` path an AVX512-BF16 CPU without AMX runs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from engine.kernels import kernel_build
from microbench.linears import layer_shapes
from microbench.profile_step import _model

CSRC = "engine/kernels/csrc"
ROOT = Path(__file__).resolve().parent.parent  # the git work tree whose revisions --base names
I64, PTR = ctypes.c_int64, ctypes.c_void_p


def _sources_at(rev: str, into: Path) -> None:
    """The kernels' sources and headers as revision `rev` has them, written into `into`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], capture_output=True, text=True,
                           check=True, cwd=ROOT).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], capture_output=True, check=True, cwd=ROOT).stdout
        (into / name).write_bytes(blob)


def _build(src: Path, out: Path) -> ctypes.CDLL:
    cc = kernel_build.compiler()
    subprocess.run([cc, *kernel_build.flags("native"), *sorted(map(str, src.glob("*.c"))), "-o", str(out), "-lm"],
                   check=True, capture_output=True, timeout=kernel_build.BUILD_TIMEOUT_S)
    lib = ctypes.CDLL(str(out))  # RTLD_LOCAL: two builds' symbols never mix
    lib.pd_amx_pack.argtypes = [PTR, I64, I64, PTR]
    lib.pd_bf16_gemm.argtypes = [PTR, I64, PTR, PTR, PTR, I64, ctypes.c_int, I64, I64, ctypes.c_int]
    lib.pd_use_amx.argtypes = [ctypes.c_int]
    return lib


def _panels(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    panels = torch.zeros((n + 15) // 16 * ((k + 31) // 32 * 32) * 16, dtype=torch.bfloat16)
    lib.pd_amx_pack(weight.data_ptr(), n, k, panels.data_ptr())
    return panels


def _run(lib: ctypes.CDLL, layers: list, inputs: dict, out: torch.Tensor, rows: int, threads: int) -> float:
    t0 = time.perf_counter()
    for (n, k), panels in layers:
        x = inputs[k]
        rc = lib.pd_bf16_gemm(x.data_ptr(), k, panels.data_ptr(), None, out.data_ptr(), n, rows, n, k, threads)
        if rc != 0:
            raise SystemExit(f"gemm_pair: pd_bf16_gemm returned {rc} ({rows} rows, {n} x {k})")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="main", help="git revision to compare this tree with (default: main)")
    p.add_argument("--model", help="checkpoint directory whose linear shapes to use (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rows", default="32,128,256")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-amx", dest="amx", action="store_false", help="both builds on vdpbf16ps, the tiles off")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.rounds < 1 or args.threads < 1 or min(rows_list) < 1:
        p.error("--rounds, --threads and every --rows value must be at least 1")
    hf_config = AutoConfig.from_pretrained(_model(args.model))
    q, kv, _, o, gate, _, down = layer_shapes(hf_config)
    shapes = [(q[0] + 2 * kv[0], q[1]), o, (2 * gate[0], gate[1]), down]  # as the engine fuses them: q|k|v, o, gate|up, down
    with tempfile.TemporaryDirectory(prefix="gemm_pair-") as tmp:
        libs = {}
        for side, rev in (("base", args.base), ("tree", None)):
            src = Path(tmp) / side
            src.mkdir()
            if rev is None:
                for path in (*kernel_build.SOURCES, *kernel_build.HEADERS):
                    (src / path.name).write_bytes(path.read_bytes())
            else:
                _sources_at(rev, src)
            libs[side] = _build(src, Path(tmp) / f"{side}.so")
            if not libs[side].pd_use_amx(int(args.amx)) and args.amx:
                raise SystemExit("gemm_pair: no AMX tiles here (CPU or OS); run with --no-amx")
        torch.manual_seed(0)
        weights = [torch.randn(n, k).div(k ** 0.5).to(torch.bfloat16)
                   for _ in range(hf_config.num_hidden_layers) for n, k in shapes]
        layers = {side: [(tuple(w.shape), _panels(lib, w)) for w in weights] for side, lib in libs.items()}
        del weights
        report = {"base": args.base, "model": hf_config.model_type, "layers": hf_config.num_hidden_layers,
                  "threads": args.threads, "amx": args.amx, "rows": {}}
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in shapes}
            outs = {side: torch.empty(rows * max(n for n, _ in shapes), dtype=torch.bfloat16) for side in libs}
            flops = 2 * rows * sum(n * k for n, k in shapes) * hf_config.num_hidden_layers
            times: dict[str, list[float]] = {"base": [], "tree": []}
            for r in range(args.rounds):
                for side in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                    times[side].append(_run(libs[side], layers[side], inputs, outs[side], rows, args.threads))
            same = torch.equal(outs["base"], outs["tree"])  # each build's buffer after the same calls: the last ones' outputs
            ratios = sorted(t / b for t, b in zip(times["tree"], times["base"], strict=True))
            report["rows"][rows] = {
                "base_gflops_best": flops / min(times["base"]) / 1e9, "tree_gflops_best": flops / min(times["tree"]) / 1e9,
                "base_gflops_median": flops / statistics.median(times["base"]) / 1e9,
                "tree_gflops_median": flops / statistics.median(times["tree"]) / 1e9,
                "time_ratio_median": statistics.median(ratios), "same_bits": same}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['model']}: {len(shapes) * report['layers']} bfloat16 linears, {args.threads} thread(s), "
          f"{'AMX tiles' if args.amx else 'vdpbf16ps'}; this tree against {args.base}, {args.rounds} rounds")
    print(f"{'rows':>6}{'base GFLOP/s':>14}{'tree GFLOP/s':>14}{'time ratio':>12}  bits")
    for rows, r in report["rows"].items():
        print(f"{rows:>6}{r['base_gflops_median']:>14.0f}{r['tree_gflops_median']:>14.0f}"
              f"{r['time_ratio_median']:>12.3f}  {'same' if r['same_bits'] else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
