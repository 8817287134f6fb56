"""Byte sizes for people: parsing `4GiB` or `512MB`, and printing sizes back."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Parse a byte size such as `4GiB`, `512MiB`, `1.5GB` or `1048576`."""
    match = _SIZE_RE.fullmatch(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use a number with an optional unit "
                         f"such as 512MiB, 4GiB or 2GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(num_bytes: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit.lower()]
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f}{unit}"
    return f"{num_bytes}B"


def exact_size(num_bytes: int) -> str:
    """A size in the largest unit that divides it (bytes: `B`), so that parse_size reads it
    back exactly."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit.lower()]
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"
