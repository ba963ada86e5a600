"""Byte sizes as people write them on a command line: "123", "64KiB", "1.5GiB", "2GB", "10kB"."""

from __future__ import annotations

import re
from decimal import Decimal

from .errors import UsageError

# Binary units are powers of 1024, decimal ones powers of 1000 (IEC 80000-13); "k" is lower case
# in SI, but a capitalised "KB" is common enough to accept as 1000 too.
UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
MAX_SIZE = 1 << 60  # 1 EiB: any larger size is a typo
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int) -> int:
    """Bytes in `text`; a fractional result must come out a whole number of bytes.

    Raises:
        UsageError: naming the text when it is not a size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise UsageError(f"bad size {text!r}: negative")
        if text > MAX_SIZE:
            raise UsageError(f"bad size {_short(str(text))}: more than {MAX_SIZE} bytes (1 EiB)")
        return text
    m = _SIZE.fullmatch(str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise UsageError(f"bad size {_short(str(text))!r} (examples: 123, 64KiB, 1.5GiB, 2GB, 10kB)")
    if len(m.group(1)) > 30:  # Decimal would take it, but no arena is 10**30 bytes
        raise UsageError(f"bad size {_short(str(text))!r}: more than {MAX_SIZE} bytes (1 EiB)")
    n = Decimal(m.group(1)) * UNITS[m.group(2).lower()]
    if n != n.to_integral_value():
        raise UsageError(f"bad size {text!r}: {n} is not a whole number of bytes")
    if n > MAX_SIZE:
        raise UsageError(f"bad size {text!r}: more than {MAX_SIZE} bytes (1 EiB)")
    return int(n)


def _short(text: str) -> str:
    """`text`, cut to 40 characters for a message (a 4,400-digit number is not worth printing)."""
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


def format_size(n: int) -> str:
    """`n` bytes in the largest binary unit with at least one whole unit, e.g. "1.5 GiB", "300 B"."""
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{f'{n / k:.2f}'.rstrip('0').rstrip('.')} {unit}"
    return f"{n} B"


def parse_capacity(text: str) -> int | list[int]:
    """One size for every GPU ("64MiB"), or a comma-separated size per GPU ("64MiB,32MiB")."""
    sizes = [parse_size(x) for x in text.split(",")]
    return sizes[0] if len(sizes) == 1 else sizes
