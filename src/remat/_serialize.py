"""Versioned JSON for frozen dataclasses (no pickle).

Every top-level document carries ``{"format": <kind>, "version": <int>, ...}``. Nested
dataclasses, tuples, dicts and optionals are rebuilt from the type hints, so a
dataclass round-trips as ``from_dict(cls, to_dict(obj)) == obj``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def to_dict(obj: Any) -> Any:
    """Plain JSON-able structure of a dataclass (recursively)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def _build(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return _build(non_none[0], value) if len(non_none) == 1 else value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value))
    if origin in (dict, typing.Dict):
        return {k: _build(args[1], v) for k, v in value.items()} if args else dict(value)
    if origin is list:
        return [_build(args[0], v) for v in value]
    if tp is float and isinstance(value, int):
        return float(value)
    return value


def from_dict(cls: type[T], data: dict) -> T:
    """Rebuild dataclass ``cls`` from :func:`to_dict` output; unknown keys are an error."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(
            f"{cls.__name__}: unknown field(s) {sorted(unknown)}; allowed: {sorted(names)}. "
            "The file was written by a different remat version: regenerate it."
        )
    kwargs = {k: _build(hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def dump_document(obj: Any, kind: str, version: int) -> str:
    """JSON text of ``obj`` wrapped with its format name and version."""
    return json.dumps({"format": kind, "version": version, "data": to_dict(obj)}, indent=1)


def load_document(cls: type[T], text_or_path: str | Path, kind: str, version: int) -> T:
    """Inverse of :func:`dump_document`; checks the format name and version."""
    text = Path(text_or_path).read_text() if isinstance(text_or_path, Path) else text_or_path
    if not text.lstrip().startswith("{"):
        text = Path(text).read_text()
    doc = json.loads(text)
    if doc.get("format") != kind:
        raise ValueError(
            f"expected a remat {kind!r} JSON document, got format={doc.get('format')!r}; "
            f"pass a file written by `remat {kind}` / {cls.__name__}.to_json()."
        )
    if doc.get("version") != version:
        raise ValueError(
            f"{kind} JSON version {doc.get('version')!r} is not supported (this remat reads "
            f"version {version}); regenerate the file with this remat."
        )
    return from_dict(cls, doc["data"])
