"""`pdserve plan`: how a device's memory splits into weights, overhead and KV cache, and what its
bandwidth and FLOP/s allow (the roofline, bench/roofline.py).

`--model` is a built-in shape name (see sizing.memory.BUILTIN_SHAPES) or a local checkpoint
directory (config.json; parameters counted from *.safetensors headers when present). A device
profile (`--device`, or `--bandwidth` and `--flops`, or `--measure` for this host) adds the
decode step's floor per batch size, token rates, the compute-bound batch, the prefill ceiling and
the KV transfer time of one context over `--link`; `--measure` also puts the floor next to a
direct weight read and the engine's own decode step (bench/host_measure.py), and fits this host's
cost model for the checkpoint into an `emulate:` section (bench/calibrate.py). Prints a table, or
one JSON object with `--json`; bad input exits 2 with a message.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import struct
import sys
from dataclasses import asdict
from pathlib import Path

from bench import plan_trace
from bench.roofline import BATCHES, DEVICES, Roofline, format_roofline, parse_rate
from protocol.sizes import PlanError, format_bytes, parse_bytes
from sizing.memory import BUILTIN_SHAPES, MemoryPlan, ModelShape, plan_memory

_MAX_HEADER_BYTES = 100 * 1024 * 1024


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `plan` on the `pdserve` subcommand parser."""
    parser = subparsers.add_parser(
        "plan", help="memory budget: weights, KV per token, how many requests fit",
        description="Split device memory into weights + runtime overhead + KV cache.",
    )
    parser.add_argument("--model",
                        help=f"built-in shape ({', '.join(BUILTIN_SHAPES)}) or checkpoint dir (required without --trace)")
    parser.add_argument("--dtype", default=None,
                        help="weights and KV dtype (default: the checkpoint's, else bfloat16)")
    parser.add_argument("--device-memory", default=None,
                        help="usable device memory (default: --device's, else 80GiB)")
    parser.add_argument("--overhead", default="8GiB",
                        help="activations, buffers, runtime (8GiB)")
    parser.add_argument("--context", type=int, default=8192, help="tokens per request (8192)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (with a profile: roofline rows)")
    roofline = parser.add_argument_group("roofline (any of these adds it)")
    roofline.add_argument("--device", choices=list(DEVICES),
                          help="; ".join(d.source for d in DEVICES.values()))
    roofline.add_argument("--bandwidth", metavar="RATE", help="memory bandwidth, e.g. 3.35TB/s (overrides --device)")
    roofline.add_argument("--flops", metavar="RATE", help="dense FLOP/s, e.g. 989TFLOPs (overrides --device)")
    roofline.add_argument("--measure", action="store_true",
                          help="measure this host's bandwidth and FLOP/s; for a checkpoint also a direct weight "
                               "read and the engine's decode step")
    roofline.add_argument("--threads", type=int, default=1, help="torch threads for --measure (default 1, a worker's)")
    roofline.add_argument("--link", default="400Gbit", metavar="RATE",
                          help="link for the KV transfer time of one context (default: %(default)s)")
    plan_trace.add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Prints the plan; returns 0, or 2 with a message on stderr for bad input."""
    if args.trace is not None:
        return plan_trace.run_trace(args)
    if args.model is None:
        print("pdserve plan: --model is required (or --trace FILE for a static recommendation)", file=sys.stderr)
        return 2
    try:
        shape, checkpoint_dtype = load_model_shape(args.model)
        memory = args.device_memory or (DEVICES[args.device].memory if args.device else "80GiB")
        plan = plan_memory(
            shape,
            args.dtype or checkpoint_dtype or "bfloat16",
            parse_bytes(memory),
            parse_bytes(args.overhead),
            args.context,
            block_size=args.block_size,
        )
        profile = _profile(args)
        link = parse_rate(args.link, "--link")
    except PlanError as err:
        print(f"pdserve plan: {err}", file=sys.stderr)
        return 2
    document = plan.to_dict() | {"model_shape": asdict(shape)}
    text = [format_plan(plan, shape)]
    if profile is not None:
        bandwidth, peak, device, measured = profile
        roof = Roofline(plan.weights_bytes, shape.num_params, plan.kv_bytes_per_token, args.context,
                        bandwidth, peak, plan.kv_budget_bytes)
        text.append(format_roofline(roof, device, link))
        document |= _roofline_json(roof, device, link)
        if measured is not None:
            measured |= _against_host(args, roof, measured)
            text.append(format_measured(measured))
            document["measured"] = measured
    print(json.dumps(document) if args.json else "\n".join(text))
    return 0


def _profile(args: argparse.Namespace) -> tuple[float, float, str, dict | None] | None:
    """(bandwidth bytes/s, FLOP/s, its description, the host measurement or None); None when
    no flag asks for a roofline."""
    if not (args.device or args.bandwidth or args.flops or args.measure):
        return None
    if args.threads < 1:
        raise PlanError(f"--threads must be at least 1, got {args.threads}")
    base = DEVICES[args.device] if args.device else None
    measured = None
    if args.measure:
        from bench import host_measure  # torch: slow to import, needed only here

        print(f"pdserve plan: measuring this host with {args.threads} torch thread(s)...", file=sys.stderr)
        measured = host_measure.reads(args.threads, _checkpoint(args.model)) | {
            "flops": host_measure.flops(args.threads), "threads": args.threads}
    bandwidth = (parse_rate(args.bandwidth, "--bandwidth") if args.bandwidth
                 else measured["bandwidth"] if measured else base.bandwidth if base else None)
    peak = (parse_rate(args.flops, "--flops") if args.flops
            else measured["flops"] if measured else base.flops if base else None)
    if bandwidth is None or peak is None:
        raise PlanError("a roofline needs both --bandwidth and --flops (or --device, or --measure)")
    source = "measured on this host" if measured else base.source if base else "--bandwidth, --flops"
    name = "this host" if measured else args.device or "custom"
    peak_text = f"{peak / 1e12:,.0f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:,.1f} GFLOP/s"
    return bandwidth, peak, f"{name}: {bandwidth / 1e9:,.1f} GB/s, {peak_text} ({source})", measured


def _roofline_json(roof: Roofline, device: str, link: float) -> dict:
    return {"device": device, "bandwidth_bytes_per_s": roof.bandwidth, "flops_per_s": roof.peak_flops,
            "roofline": [roof.decode(b).to_dict() for b in BATCHES],
            "compute_bound_batch": roof.compute_bound_batch(),
            "compute_bound_batch_weights_only": roof.compute_bound_batch(0),
            "prefill_tok_s": roof.prefill_tok_s,
            "kv_transfer": {"link_bytes_per_s": link, "bytes": roof.context_kv_bytes, "s": roof.transfer_s(link)}}


def _checkpoint(model: str) -> Path | None:
    path = Path(model)
    return path if (path / "config.json").is_file() and any(path.glob("*.safetensors")) else None


def _against_host(args: argparse.Namespace, roof: Roofline, measured: dict) -> dict:
    """For a checkpoint: the floor of reading its weights vs reading them directly, and the
    engine's decode steps vs their floors (their context: a few dozen tokens)."""
    path = _checkpoint(args.model)
    if path is None:
        return {"note": "a built-in shape has no weights to read: give a checkpoint directory to compare"}
    from bench import calibrate, host_measure

    engine = host_measure.engine_decode(path, args.threads)
    short = dataclasses.replace(roof, context=16)  # the engine run's prompts (8) + outputs so far
    dtype = args.dtype or load_model_shape(args.model)[1] or "float32"
    host = calibrate.fit(path, dtype, calibrate.measure_steps(path, args.threads, repeats=1), measured["bandwidth"])
    return {"floor_ms": measured["weights_bytes"] / roof.bandwidth * 1e3,
            "weight_read_ms": measured.pop("weight_read_s") * 1e3,
            "engine_decode_ms": {b: s * 1e3 for b, s in engine.items()},
            "engine_floor_ms": {b: short.decode(b).step_s * 1e3 for b in engine},
            "fit": {"flops": host.flops, "overhead_ms": host.overhead_s * 1e3, "rms_error_ms": host.rms_error_s * 1e3,
                    "steps": host.steps, "emulate": host.emulate_section(str(path), dtype)}}


def format_measured(m: dict) -> str:
    lines = [f"{'measured':<14} {m['bandwidth'] / 1e9:,.2f} GB/s (reading a 256 MiB float32 buffer), "
             f"{m['flops'] / 1e9:,.1f} GFLOP/s (1024^3 float32 matmul), {m['threads']} torch thread(s)"]
    if "note" in m:
        return "\n".join([*lines, f"{'':<14} {m['note']}"])
    off = m["floor_ms"] / m["weight_read_ms"] - 1
    lines.append(f"{'weight read':<14} {m['weights_bytes'] / 1e6:,.0f} MB: the floor predicts {m['floor_ms']:,.1f} ms, "
                 f"reading every weight tensor took {m['weight_read_ms']:,.1f} ms (floor {off:+.0%})")
    steps = "; ".join(f"batch {b}: {ms:,.1f} ms (floor {m['engine_floor_ms'][b]:,.1f} ms, "
                      f"{ms / m['engine_floor_ms'][b]:.2f}x)" for b, ms in m["engine_decode_ms"].items())
    lines.append(f"{'engine decode':<14} fastest step, {steps}")
    f = m["fit"]
    lines.append(f"{'cost model':<14} this host's steps fit {m['bandwidth'] / 1e9:,.2f} GB/s (measured), "
                 f"{f['flops'] / 1e9:,.1f} GFLOP/s and {f['overhead_ms']:,.2f} ms a step (rms error "
                 f"{f['rms_error_ms']:,.1f} ms over {f['steps']} steps); to emulate it, cluster.yaml's emulate: "
                 + json.dumps(f["emulate"]))
    return "\n".join(lines)


def load_model_shape(model: str) -> tuple[ModelShape, str | None]:
    """A built-in shape, or (shape, checkpoint dtype) read from a checkpoint directory."""
    if model in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[model], None
    path = Path(model)
    config_path = path / "config.json"
    if not config_path.is_file():
        known = ", ".join(BUILTIN_SHAPES)
        raise PlanError(f"--model {model!r}: not a built-in shape ({known}) "
                        f"nor a directory with config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PlanError(f"{config_path}: cannot read ({err})") from err
    if not isinstance(config, dict):
        raise PlanError(f"{config_path}: expected a JSON object")
    num_params = count_safetensors_params(path)
    shape = ModelShape.from_hf_config(config, num_params=num_params, name=path.name)
    dtype = config.get("torch_dtype") or config.get("dtype")
    return shape, dtype if isinstance(dtype, str) else None


def count_safetensors_params(checkpoint_dir: Path) -> int | None:
    """Total elements of every tensor in the directory's *.safetensors headers (no data read)."""
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        return None
    return sum(_safetensors_elements(file) for file in files)


def _safetensors_elements(file: Path) -> int:
    """Reads the 8-byte little-endian header length, then the JSON header of tensor shapes."""
    try:
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > _MAX_HEADER_BYTES:
                raise PlanError(f"{file}: implausible safetensors header ({header_len} bytes)")
            header = json.loads(handle.read(header_len))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlanError(f"{file}: not a readable safetensors file ({err})") from err
    try:
        return sum(math.prod(entry["shape"]) for name, entry in header.items()
                   if name != "__metadata__")
    except (KeyError, TypeError) as err:
        raise PlanError(f"{file}: malformed safetensors header ({err!r})") from err


def _windowed_row(plan: MemoryPlan, shape: ModelShape) -> list[tuple[str, str]]:
    """For a model with sliding-window layers: what its KV needs when those keep only their window
    (pdserve's pool keeps every token of every layer, so capacity uses the line above)."""
    if not shape.sliding_windows:
        return []
    sliding = [w for w in shape.sliding_windows if w is not None]
    return [("KV windowed", f"{format_bytes(int(plan.windowed_kv_bytes_per_token))} per token over "
                            f"{plan.context_tokens:,} tokens ({len(sliding)} of {shape.num_layers} layers "
                            f"keep a {min(sliding):,}-token window); pdserve's pool holds every token")]


def format_plan(plan: MemoryPlan, shape: ModelShape) -> str:
    """The human table: one line per figure, the seed's budget order."""
    rows = [
        ("model", f"{shape.name}: {shape.num_layers} layers, {shape.num_kv_heads} KV heads x "
                  f"{shape.head_dim} dims, {shape.num_params / 1e9:.2f} B params"),
        ("dtype", f"{plan.dtype} ({plan.dtype_bytes} bytes per value)"),
        ("device memory", format_bytes(plan.device_memory_bytes)),
        ("weights", format_bytes(plan.weights_bytes)),
        ("overhead", format_bytes(plan.overhead_bytes)),
        ("KV budget", format_bytes(plan.kv_budget_bytes)),
        ("KV per token", format_bytes(plan.kv_bytes_per_token)),
        *_windowed_row(plan, shape),
        ("KV capacity", f"{plan.capacity_tokens:,} tokens "
                        f"({plan.num_blocks:,} blocks of {plan.block_size} tokens)"),
        ("per request", f"{format_bytes(plan.bytes_per_request)} for "
                        f"{plan.context_tokens:,} tokens ({plan.blocks_per_request:,} blocks)"),
        ("requests fit", f"{plan.requests_that_fit:,} concurrent "
                         f"{plan.context_tokens:,}-token requests"),
    ]
    lines = [f"{label:<14} {value}" for label, value in rows]
    if shape.max_positions is not None and plan.context_tokens > shape.max_positions:
        lines.append(f"warning: context {plan.context_tokens:,} exceeds the model's "
                     f"{shape.max_positions:,} positions")
    return "\n".join(lines)
