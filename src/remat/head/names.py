"""Head strategy names as plans write them, checked without importing torch."""

from __future__ import annotations

__all__ = ["HEAD_STRATEGY_KINDS", "check_head_name"]

HEAD_STRATEGY_KINDS = ("keep", "recompute", "chunked")
"""The head strategies (`remat.head.strategies`): ``keep``, ``recompute``, ``chunked:<tokens>``."""


def check_head_name(text: object) -> tuple[str, int | None]:
    """``(kind, chunk tokens or None)`` of a head strategy name; a clear error otherwise."""
    if not isinstance(text, str):
        raise TypeError(f"a head strategy is text such as 'keep', 'recompute' or 'chunked:1024', got {type(text).__name__}.")
    kind, colon, argument = text.partition(":")
    if kind not in HEAD_STRATEGY_KINDS:
        raise ValueError(f"unknown head strategy {text!r}; allowed: keep, recompute, chunked:<tokens> (e.g. chunked:1024).")
    if kind == "chunked":
        if not argument.isdigit() or int(argument) < 1:
            raise ValueError(f"head strategy {text!r} needs a positive number of tokens per chunk, e.g. chunked:1024.")
        return kind, int(argument)
    if colon:
        raise ValueError(f"head strategy {text!r} takes no argument; write {kind!r}.")
    return kind, None
