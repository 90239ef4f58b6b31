"""The C ABI of the kernels, stated once: argument types come from csrc/pdserve_kernels.h.

`bind(lib)` gives every `PD_API` function of the header its ctypes `restype` and `argtypes`, read
from its prototype there (the header is the one table; no binding repeats a signature), and checks
that the library exports each one and that the structs shared across the FFI (`pd_layer`,
`pd_step`) have the sizes of their mirrors here (`LayerArgs`, `StepArgs`): a field added on one
side only is a `KernelUnavailable` at load, never a misread struct.
"""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

from engine.kernels.cpu_ops import KernelUnavailable

HEADER = Path(__file__).parent / "csrc" / "pdserve_kernels.h"
C_TYPES: dict[str, type | None] = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32,
                                   "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}
_PROTOTYPE = re.compile(r"PD_API\s+([a-z0-9_]+)\s+(pd_[a-z0-9_]+)\s*\(([^)]*)\)\s*;")

_P, _F, _I32, _I64 = ctypes.c_void_p, ctypes.c_float, ctypes.c_int32, ctypes.c_int64


class LayerArgs(ctypes.Structure):
    """pdserve_kernels.h's `pd_layer`: one layer's weights (the GEMM's panels) and shape."""

    _fields_ = [*((name, _P) for name in ("norm1", "qkv", "qkv_bias", "o", "o_bias", "norm2", "gate_up",
                                          "gate_up_bias", "down", "down_bias")),
                *((name, _F) for name in ("eps1", "eps2", "scale", "softcap")),
                ("layer", _I64),
                *((name, _I32) for name in ("hidden", "heads", "kv_heads", "dim", "inter", "window"))]


class StepArgs(ctypes.Structure):
    """pdserve_kernels.h's `pd_step`: what every layer of one step reads."""

    _fields_ = [("kv", _P),
                *((name, _I64) for name in ("blk_stride", "layer_stride", "tok_stride")),
                *((name, _P) for name in ("slot_blocks", "slot_offsets", "tables", "lens")),
                ("table_stride", _I64),
                *((name, _P) for name in ("chunks", "cos", "sin", "h", "qkv", "attn", "gu", "act", "tmp")),
                *((name, _I32) for name in ("tokens", "decodes", "n_chunks", "block_size", "threads", "dtype"))]


def _ctype(declaration: str) -> type | None:
    """A parameter's or return's ctypes type: any pointer is an address; else the named scalar."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = declaration.replace("const ", "").split()
    name = words[0] if words else ""
    if name not in C_TYPES:
        raise ValueError(f"{HEADER.name}: no ctypes type for {declaration.strip()!r}")
    return C_TYPES[name]


@functools.cache
def signatures() -> dict[str, tuple[type | None, tuple[type | None, ...]]]:
    """Each export's (restype, argtypes), parsed from the header."""
    text = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    table = {}
    for ret, name, params in _PROTOTYPE.findall(" ".join(text.split())):
        args = () if params.strip() == "void" else tuple(_ctype(p) for p in params.split(","))
        table[name] = (_ctype(ret), args)
    return table


def bind(lib: ctypes.CDLL) -> None:
    """Type every export of `lib` from the header and check the shared structs' sizes."""
    for name, (restype, argtypes) in signatures().items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise KernelUnavailable(f"{lib._name} does not export {name}, which {HEADER.name} declares; delete it "
                                    "to rebuild") from None
        fn.restype, fn.argtypes = restype, list(argtypes)
    for struct, size_fn in ((LayerArgs, lib.pd_layer_size), (StepArgs, lib.pd_step_size)):
        if ctypes.sizeof(struct) != size_fn():
            raise KernelUnavailable(f"{struct.__name__} is {ctypes.sizeof(struct)} bytes but the C side's is "
                                    f"{size_fn()}: abi.py and {HEADER.name} disagree")
