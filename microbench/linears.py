"""The linears of a decode step, oneDNN's prepacked path against the small-batch GEMM, side by side.

One model's linear shapes (every layer's Q/K/V/O projections and MLP, random weights; the LM head
left out) at each row count: oneDNN on its prepacked weights (`PackedLinear` without the GEMM; where
oneDNN has no bfloat16 on this CPU, AVX2 alone, torch's `F.linear`, "torch" in the report)
against the GEMM on its panels, called at every row count, also past `SMALL_ROWS` where that is set
and `PackedLinear` hands the larger products to oneDNN (to check where the cut belongs on this
host, or that the GEMM wins everywhere). `--dtype bfloat16` compares oneDNN's bfloat16 linears
with the bfloat16 GEMM (engine/kernels/csrc/bf16_gemm.c: on AMX tiles where the CPU has them, at up to their
64 rows, past the engine's cut of 32 too; else by AVX512-BF16's vdpbf16ps, or AVX2's FMAs on the pairs
widened, any row count). The two
take turns for `--rounds` rounds; each prints its best time per pass over all layers.

    python -m microbench.linears [--model DIR] [--rows 1,4,16,64,256,512,1024] [--threads 2]
                                    [--dtype float32|bfloat16] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn
from transformers import AutoConfig

from engine.forward import dense
from engine.kernels import cpu_kernel
from microbench.profile_step import _model


def layer_shapes(hf_config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linears: q, k, v, o, gate, up, down."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = getattr(hf_config, "num_key_value_heads", heads) * head_dim
    return [(heads * head_dim, hidden), (kv, hidden), (kv, hidden), (hidden, heads * head_dim),
            (inter, hidden), (inter, hidden), (hidden, inter)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rows", default="1,4,16,64,256,512,1024")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    kernels, why = cpu_kernel.load()
    if kernels is None:
        raise SystemExit(f"bench_linears: no CPU kernels here: {why}")
    dtype = getattr(torch, args.dtype)
    gemm = kernels.gemm_for(dtype)
    if gemm is None or not dense.packable(dtype, gemm):
        raise SystemExit(f"bench_linears: no {args.dtype} GEMM here (bfloat16 needs AMX, AVX512-BF16 or AVX2)")
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    hf_config = AutoConfig.from_pretrained(_model(args.model))
    shapes = layer_shapes(hf_config) * hf_config.num_hidden_layers
    torch.manual_seed(0)
    linears = [nn.Linear(k, n, bias=False, dtype=dtype) for n, k in shapes]
    # oneDNN's prepacked linears; where oneDNN has no bfloat16 here (AVX2 alone), torch's F.linear
    native = dense.packable(dtype)
    onednn = [dense.PackedLinear(m, keep_weight=False) for m in linears] if native else linears
    panels = [(gemm.pack(m.weight), m.out_features) for m in linears]
    del linears
    results: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in rows_list:
            inputs = {k: torch.randn(1, rows, k, dtype=dtype) for _, k in shapes}
            flat = {k: x[0] for k, x in inputs.items()}
            best = {"onednn": float("inf"), "small_gemm": float("inf")}
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for layer in onednn:
                    layer(inputs[layer.in_features])
                t1 = time.perf_counter()
                for (_, k), (weights, out) in zip(shapes, panels, strict=True):
                    gemm(flat[k], weights, None, out)
                t2 = time.perf_counter()
                best = {"onednn": min(best["onednn"], t1 - t0), "small_gemm": min(best["small_gemm"], t2 - t1)}
            results[rows] = best
    report = {"model": hf_config.model_type, "layers": hf_config.num_hidden_layers, "threads": args.threads,
              "dtype": args.dtype, "small_rows": gemm.max_rows, "baseline": "onednn" if native else "torch",
              "seconds": results}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['model']}: {len(shapes)} {args.dtype} linears ({report['layers']} layers), {args.threads} "
          f"thread(s); the engine uses the GEMM for {gemm.reach}")
    print(f"{'rows':>6}{report['baseline'] + ' ms':>12}{'GEMM ms':>10}{'ratio':>8}")
    for rows, best in results.items():
        print(f"{rows:>6}{1e3 * best['onednn']:>12.1f}{1e3 * best['small_gemm']:>10.1f}"
              f"{best['small_gemm'] / best['onednn']:>8.2f}")


if __name__ == "__main__":
    main()
