"""The kernels' C ABI is stated once (engine/kernels/csrc/pdserve_kernels.h) and checked at load:
the library exports exactly what the header declares, every export is `pd_*`, the bindings' types
come from the header, and a struct mirror of the wrong size or a missing export refuses to load."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from engine.kernels import abi, kernel_build
from engine.kernels.cpu_ops import KernelUnavailable
from tests.kernel_util import KERNELS, WHY

needs_kernels = pytest.mark.skipif(KERNELS is None, reason=f"no CPU kernels here: {WHY}")
CSRC = kernel_build.CSRC


def _library():
    path = kernel_build.build(kernel_build.compiler(), KERNELS.variant)
    return path, ctypes.CDLL(str(path))


def test_the_header_states_each_export_once_with_its_types():
    table = abi.signatures()
    assert all(name.startswith("pd_") for name in table)
    restype, args = table["pd_paged_decode"]
    assert restype is ctypes.c_int and len(args) == 24
    assert args[:3] == (ctypes.c_int, ctypes.c_void_p, ctypes.c_int64) and args[20] is ctypes.c_float
    assert table["pd_isa"] == (ctypes.c_int, ())
    assert table["pd_f32_pack"][0] is None
    code = re.sub(r"/\*.*?\*/", "", abi.HEADER.read_text(), flags=re.S)
    declared = len(re.findall(r"^PD_API (?!extern)", code, re.M))
    assert len(table) == declared  # no PD_API prototype the parser missed


def test_no_source_declares_an_export_the_header_does_not():
    """Prototypes live in the header only: no .c file re-declares a pd_ function (layer.c had 12)."""
    redeclared = [f"{path.name}: {m}" for path in CSRC.glob("*.c")
                  for m in re.findall(r"^\w[\w\s\*]*\bpd_\w+\([^;{]*\);", path.read_text(), re.M)]
    assert not redeclared, redeclared


def test_no_kernel_is_a_page_long_macro():
    """Kernels are plain functions (decode_rows.h and argmax_row.h are included once per dtype), not
    page-long macros: a macro is a small helper (the largest, a GEMM tile's inner loop, 25 lines)."""
    for path in (*CSRC.glob("*.c"), *CSRC.glob("*.h")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("#define"):
                span = 1
                while lines[i + span - 1].rstrip().endswith("\\"):
                    span += 1
                assert span <= 25, f"{path.name}:{i + 1}: a {span}-line macro"


@needs_kernels
@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm here to read the library's symbols")
def test_the_library_exports_exactly_the_header():
    path, _ = _library()
    listed = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in listed.stdout.splitlines() if line.split()[1] in "TDB"}
    assert exported == set(abi.signatures()) | {"pd_layer_seconds"}


@needs_kernels
def test_a_struct_mirror_of_another_size_refuses_to_load(monkeypatch):
    _, lib = _library()
    abi.bind(lib)  # the real mirrors agree
    assert ctypes.sizeof(abi.LayerArgs) == lib.pd_layer_size() and ctypes.sizeof(abi.StepArgs) == lib.pd_step_size()

    class Short(ctypes.Structure):
        _fields_ = abi.StepArgs._fields_[:-2]  # `threads` and `dtype` forgotten on the Python side

    monkeypatch.setattr(abi, "StepArgs", Short)
    with pytest.raises(KernelUnavailable, match=r"Short is \d+ bytes but the C side's is \d+"):
        abi.bind(lib)


@needs_kernels
def test_a_declared_export_the_library_lacks_refuses_to_load(monkeypatch):
    _, lib = _library()
    table = dict(abi.signatures()) | {"pd_not_built": (ctypes.c_int, ())}
    monkeypatch.setattr(abi, "signatures", lambda: table)
    with pytest.raises(KernelUnavailable, match="does not export pd_not_built"):
        abi.bind(lib)
