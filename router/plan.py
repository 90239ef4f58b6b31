"""`pdserve plan`: how a device's memory splits into weights, overhead and KV cache.

`--model` is a built-in shape name (see engine.memory.BUILTIN_SHAPES) or a local checkpoint
directory (config.json; parameters counted from *.safetensors headers when present).
Prints a table, or one JSON object with `--json`; bad input exits 2 with a message.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from dataclasses import asdict
from pathlib import Path

from engine.memory import (
    BUILTIN_SHAPES,
    MemoryPlan,
    ModelShape,
    PlanError,
    format_bytes,
    parse_bytes,
    plan_memory,
)

_MAX_HEADER_BYTES = 100 * 1024 * 1024


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `plan` on the `pdserve` subcommand parser."""
    parser = subparsers.add_parser(
        "plan", help="memory budget: weights, KV per token, how many requests fit",
        description="Split device memory into weights + runtime overhead + KV cache.",
    )
    parser.add_argument("--model", required=True,
                        help=f"built-in shape ({', '.join(BUILTIN_SHAPES)}) or checkpoint dir")
    parser.add_argument("--dtype", default=None,
                        help="weights and KV dtype (default: the checkpoint's, else bfloat16)")
    parser.add_argument("--device-memory", default="80GiB", help="usable device memory (80GiB)")
    parser.add_argument("--overhead", default="8GiB",
                        help="activations, buffers, runtime (8GiB)")
    parser.add_argument("--context", type=int, default=8192, help="tokens per request (8192)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Prints the plan; returns 0, or 2 with a message on stderr for bad input."""
    try:
        shape, checkpoint_dtype = load_model_shape(args.model)
        plan = plan_memory(
            shape,
            args.dtype or checkpoint_dtype or "bfloat16",
            parse_bytes(args.device_memory),
            parse_bytes(args.overhead),
            args.context,
            block_size=args.block_size,
        )
    except PlanError as err:
        print(f"pdserve plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict() | {"model_shape": asdict(shape)}))
    else:
        print(format_plan(plan, shape))
    return 0


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
