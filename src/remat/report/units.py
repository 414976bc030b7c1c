"""Human units for bytes and times: one scale per axis, the unit in every label.

Binary units throughout (1 MiB = 2**20 bytes, 1 GiB = 2**30 bytes), as the rest of remat.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 2**10
MIB = 2**20
GIB = 2**30


@dataclass(kw_only=True, frozen=True)
class ByteScale:
    """How one axis shows bytes."""

    unit: str
    """``"KiB"``, ``"MiB"`` or ``"GiB"``."""
    bytes_per_unit: int
    """2**10, 2**20 or 2**30."""

    def __call__(self, num_bytes: float) -> float:
        return num_bytes / self.bytes_per_unit


def byte_scale(max_bytes: float) -> ByteScale:
    """GiB from 1 GiB up, MiB from 1 MiB up; KiB only for toy models below 1 MiB."""
    if max_bytes >= GIB:
        return ByteScale(unit="GiB", bytes_per_unit=GIB)
    if max_bytes >= MIB:
        return ByteScale(unit="MiB", bytes_per_unit=MIB)
    return ByteScale(unit="KiB", bytes_per_unit=KIB)


def format_bytes(num_bytes: float) -> str:
    """``"4.0 GiB"``, ``"12.5 MiB"``, ``"3.0 KiB"``, ``"512 B"`` (binary units, sign kept)."""
    size = abs(num_bytes)
    sign = "-" if num_bytes < 0 else ""
    for unit, factor in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= factor:
            return f"{sign}{size / factor:.1f} {unit}"
    return f"{sign}{size:.0f} B"


def format_flops(flops: float) -> str:
    """``"6.0 GFLOP"``, ``"852.0 kFLOP"`` (decimal prefixes, as FLOP counts are quoted)."""
    for prefix, factor in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(flops) >= factor:
            return f"{flops / factor:.1f} {prefix}FLOP"
    return f"{flops:.0f} FLOP"


def format_ms(time_ms: float) -> str:
    """``"12.3 ms"``; seconds from 10 s up (``"12.5 s"``); sub-millisecond to 3 decimals."""
    if abs(time_ms) >= 10_000:
        return f"{time_ms / 1000:.1f} s"
    if abs(time_ms) < 1:
        return f"{time_ms:.3f} ms"
    return f"{time_ms:.1f} ms"


def format_pct(pct: float) -> str:
    """Signed percentage with one decimal below 10 %: ``"+9%"``, ``"-0.4%"``, ``"+0.0%"``."""
    if abs(pct) >= 10:
        return f"{pct:+.0f}%"
    return f"{pct:+.1f}%"


def format_ratio(ratio: float) -> str:
    """``"3.1x"``; ``"inf"`` is spelled out for a zero denominator."""
    if ratio == float("inf"):
        return "unbounded"
    return f"{ratio:.1f}x"
