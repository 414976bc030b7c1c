"""Measurement of the real model: blocks, saved-tensor accounting, live-memory tracking, op
tables, FLOPs, timing. `remat.profile` (in `remat.measure.profile`) ties them together.

Names load on first use, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "find_blocks": "remat.measure.blocks",
    "SavedAccountant": "remat.measure.saved",
    "LiveTracker": "remat.measure.tracker",
    "StepTracking": "remat.measure.tracker",
    "TrackedStep": "remat.measure.tracker",
    "track_step": "remat.measure.tracker",
    "OpRecorder": "remat.measure.ops",
    "op_flops": "remat.measure.flops",
    "model_hash": "remat.measure.fingerprint",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'remat.measure' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
