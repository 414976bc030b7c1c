"""Apply a plan to the user's model in place (`apply_`), undo it (`remove_`), or do it all (`auto_`)."""

from __future__ import annotations

__all__ = ["apply_", "remove_", "auto_"]


def __getattr__(name: str):
    if name in __all__:
        from remat.apply import api

        return getattr(api, name)
    raise AttributeError(f"module 'remat.apply' has no attribute {name!r}")
