"""Byte counts in words: the binary unit that shows them (B, KiB, MiB, GiB) and, where a figure is
compared against another, the exact count too. Below every stage, so errors at any layer read alike.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["format_bytes", "format_bytes_exact", "in_unit", "table_unit"]


def format_bytes(num_bytes: int | float) -> str:
    """``"512 B"``, ``"1.50 KiB"``, ``"12.25 MiB"``, ``"16.00 GiB"`` (binary units, two decimals, sign kept):
    a small model's figures never read ``"0.00 GiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_bytes_exact(num_bytes: int | float) -> str:
    """`format_bytes` with the exact count after it, ``"1.50 KiB (1,536 bytes)"``; plain ``"512 B"``
    below 1 KiB, where the two are the same."""
    text = format_bytes(num_bytes)
    return text if text.endswith(" B") else f"{text} ({round(num_bytes):,} bytes)"


_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def table_unit(values: Iterable[int | float | None]) -> tuple[str, int]:
    """The unit a column of byte counts reads in, and its size: the largest binary unit of which the
    largest value is at least one (``B`` when every value is under 1 KiB), so that one column has one
    unit and a small model's column does not read ``0.00``."""
    largest = max((abs(v) for v in values if v is not None), default=0)
    return next(((name, size) for name, size in _UNITS if largest >= size), ("B", 1))


def in_unit(num_bytes: int | float, size: int, digits: int = 2) -> str:
    """``num_bytes`` in the unit of ``size`` bytes (from `table_unit`): whole bytes, else ``digits`` decimals."""
    return f"{num_bytes:.0f}" if size == 1 else f"{num_bytes / size:.{digits}f}"
