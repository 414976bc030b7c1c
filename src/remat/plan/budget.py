"""Byte budgets from user text: ``"6GiB"``, ``"750MB"``, ``"1.5GiB"``, ``"40%"`` or an int.

Parsing is strict: a unit is required in text (``"40"`` could be bytes, MB or a share), the
unit must be spelled out (``"6G"`` could be GB or GiB), and the value must be positive.
"""

from __future__ import annotations

import math
import re

from remat._units import format_bytes

__all__ = ["parse_budget", "format_bytes", "UNIT_BYTES"]

UNIT_BYTES: dict[str, int] = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
"""Allowed units: decimal (kB = 1000 B) and binary (KiB = 1024 B), case as written here."""

_PATTERN = re.compile(r"^\s*(?P<value>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>%|[A-Za-z]+)\s*$")
_BARE_NUMBER = re.compile(r"^\s*[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?\s*$")
_ALLOWED = "an int (bytes) or text like '6GiB', '750MB', '512MiB', '1.5GiB' or '40%'"


def float_bytes(value: float) -> int:
    """A budget given as a float: bytes where it is a whole number (``8e9``, as Python writes large
    sizes); a fraction is refused with the share it may mean (``0.4``: ``'40%'``)."""
    if value.is_integer() and value >= 1:
        return int(value)
    hint = f" or a share of the baseline peak as text, '{100 * value:g}%'" if 0 < value <= 1 else ""
    raise TypeError(f"budget {value!r} is not a positive whole number of bytes: give bytes (an int, or a whole float such "
                    f"as 8e9), text like '6GiB'{hint}.")


def parse_budget(text: str | int | float, baseline_peak_bytes: int | None = None) -> int:
    """Bytes of the budget ``text``; a percentage is a share of ``baseline_peak_bytes``; a float is
    bytes where it is a whole number (`float_bytes`)."""
    if isinstance(text, float):
        return float_bytes(text)
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise TypeError(f"budget must be {_ALLOWED}; got {type(text).__name__} {text!r}.")
    if isinstance(text, int):
        return _positive(text, text)
    match = _PATTERN.match(text)
    if match is None and _BARE_NUMBER.match(text):
        number = text.strip()
        raise ValueError(f"budget {text!r} has no unit: write {number}GiB (or MiB, GB, B...) for bytes or {number}% "
                         "for a share of the baseline peak.")
    if match is None:
        raise ValueError(f"cannot read budget {text!r}: expected {_ALLOWED} (no sign, unit required).")
    value, unit = float(match["value"]), match["unit"]
    if unit == "%":
        return _percent(text, value, baseline_peak_bytes)
    if unit not in UNIT_BYTES:
        raise ValueError(
            f"unknown unit {unit!r} in budget {text!r}; allowed units: "
            f"{', '.join(UNIT_BYTES)} (write 6GiB for 6*2^30 bytes or 6GB for 6*10^9)."
        )
    return _positive(text, math.floor(value * UNIT_BYTES[unit]))


def _percent(text: str, value: float, baseline_peak_bytes: int | None) -> int:
    if baseline_peak_bytes is None:
        raise ValueError(
            f"budget {text!r} is a share of the baseline peak, but no baseline peak is known; "
            "give a profile (its measured peak) or a byte budget such as '6GiB'."
        )
    if not 0 < value <= 100:
        raise ValueError(f"budget share {text!r} must be in (0%, 100%]; use bytes for more than the baseline.")
    return _positive(text, math.floor(baseline_peak_bytes * value / 100))


def _positive(text: str | int, num_bytes: int) -> int:
    if num_bytes <= 0:
        raise ValueError(f"budget {text!r} is {num_bytes} bytes; a budget must be a positive byte count.")
    return num_bytes


