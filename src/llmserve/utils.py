"""Small pure-Python helpers shared by every layer (no torch here)."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}


def parse_size(value: int | float | str, field: str = "size") -> int:
    """Parse a memory size into bytes.

    Accepts an int/float (bytes) or a string such as ``"4GiB"``, ``"512MiB"``,
    ``"2GB"`` (decimal), ``"1.5G"``. Binary units (KiB, MiB, GiB, TiB) are
    powers of 1024, decimal ones (KB, MB, GB, TB) powers of 1000.

    Raises:
        ValueError: naming ``field`` when the value is not a positive size.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a size in bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        num = float(value)
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ValueError(
                f"{field} must be a size in bytes or a string like '4GiB' or '512MiB', got {value!r}")
        unit = (m.group(2) or "").lower()
        if unit not in _UNITS:
            raise ValueError(f"{field}: unknown unit in {value!r}; use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB")
        num = float(m.group(1)) * _UNITS[unit]
    if num <= 0:
        raise ValueError(f"{field} must be positive, got {value!r}")
    return int(num)


def format_size(num_bytes: int | float) -> str:
    """Format bytes with binary units, e.g. ``1.25 GiB``."""
    num = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    return f"{num:.2f} TiB"


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)
