"""Hugging Face key/value caches where blocks are replayed.

A cache is appended to by every forward of a layer, so a replay would append the keys and
values a second time; training does not read it. Hugging Face's own gradient checkpointing
turns it off (``use_cache=True`` is incompatible with gradient checkpointing).
"""

from __future__ import annotations

from typing import Any

__all__ = ["drop_kv_caches", "is_kv_cache"]


def is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers ``Cache`` (checked by name: transformers stays optional)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def drop_kv_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every Hugging Face key/value cache replaced by None."""
    if not any(is_kv_cache(v) for v in (*args, *kwargs.values())):
        return args, kwargs
    args = tuple(None if is_kv_cache(v) else v for v in args)
    return args, {k: None if is_kv_cache(v) else v for k, v in kwargs.items()}
