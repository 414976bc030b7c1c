"""Byte counts in words: the binary unit that shows them (B, KiB, MiB, GiB) and, where a figure is
compared against another, the exact count too. Below every stage, so errors at any layer read alike.
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_bytes_exact"]


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
