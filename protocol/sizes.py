"""Sizes as people write them ("512MiB", "1.5GB") and as people read them."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2,
    "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}


_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class PlanError(ValueError):
    """The inputs describe a budget that cannot work (or cannot be parsed)."""


def parse_bytes(text: str | int) -> int:
    """"80GiB", "512MiB", "1.5GB", "1024" -> bytes (binary units for Ki/Mi/Gi/Ti)."""
    if isinstance(text, int):
        return text
    match = _BYTES_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise PlanError(f"cannot read {text!r} as a size; use e.g. 80GiB, 512MiB, 1.5GB, 1024")
    try:
        return int(Decimal(match.group(1)) * _UNITS[unit])
    except InvalidOperation as err:
        raise PlanError(f"cannot read {text!r} as a size") from err


def format_bytes(num_bytes: int | float) -> str:
    """Binary-unit rendering: 131072 -> '128.00 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
