"""Accelerator profiles (datasheet bandwidth, dense FLOP/s, memory) and rates as people write
them: what `pdserve plan`'s roofline and the emulated devices (sizing/cost_model.py) read.

Figures are dense bf16, no sparsity. `parse_rate('400Gbit')` -> bytes/s.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from protocol.sizes import PlanError


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    bandwidth: float  # bytes/s of device memory
    flops: float  # dense bf16 FLOP/s (tensor cores)
    memory: str  # device memory, for the budget
    source: str


DEVICES: dict[str, DeviceProfile] = {d.name: d for d in (
    # NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 1,979 TFLOPS BF16 with sparsity = 989 dense
    DeviceProfile("h100", 3.35e12, 989e12, "80GiB", "H100 SXM5: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16"),
    # NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 141 GB, the H100's tensor cores
    DeviceProfile("h200", 4.8e12, 989e12, "141GB", "H200 SXM: 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16"),
    # NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e, 312 TFLOPS BF16 dense
    DeviceProfile("a100", 2.039e12, 312e12, "80GiB", "A100 80GB SXM: 2.04 TB/s HBM2e, 312 TFLOP/s dense BF16"),
    # NVIDIA L40S datasheet: 864 GB/s GDDR6, 362 TFLOPS BF16 dense (733 with sparsity)
    DeviceProfile("l40s", 864e9, 362e12, "48GiB", "L40S: 864 GB/s GDDR6, 362 TFLOP/s dense BF16"),
)}

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(i?)(b|bit|bits|byte|bytes|flops?)?"
                   r"\s*(?:/s|ps)?\s*$", re.IGNORECASE)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_rate(text: str, what: str) -> float:
    """'400Gbit' / '400Gb/s' / '100Gbps' -> bytes/s (bits / 8: a lower-case b is a bit);
    '3.35TB/s', '25GB/s' -> bytes/s; '989T', '989TFLOPs', '1.2e15' -> per second. Decimal
    prefixes (k, M, G, T, P); 'Gi' and friends binary."""
    match = _RATE.match(text)
    if match is None:
        raise PlanError(f"cannot read {text!r} as {what}; use e.g. 400Gbit, 3.35TB/s, 989TFLOPs")
    number, prefix, binary, unit = match.groups()
    scale = 1024.0 ** ("kmgtp".index(prefix.lower()) + 1) if binary and prefix else _PREFIX[prefix.lower()]
    is_bits = unit is not None and (unit == "b" or unit.lower().startswith("bit"))  # "B" is bytes
    value = float(number) * scale / (8 if is_bits else 1)
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"{what} must be positive, got {text!r}")
    return value
