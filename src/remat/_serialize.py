"""Versioned JSON for frozen dataclasses (no pickle), read through one strict schema.

Every top-level document carries ``{"format": <kind>, "version": <int>, "data": {...}}``.
Nested dataclasses, tuples, dicts and optionals are rebuilt from the type hints, so a
dataclass round-trips as ``from_dict(cls, to_dict(obj)) == obj``.

Reading is strict, and everything is checked before anything is built: the JSON types match
the type hints exactly (no ``true`` where an int is expected, no ``1.5`` for an int, no ``null``
for a field that is not optional), no ``NaN``/``Infinity`` unless the document allows them,
numbers non-negative unless `Rules.signed` names the field, ``*_fraction`` fields in [0, 1],
no duplicate keys, no unknown or missing fields, a bounded size (`MAX_DOCUMENT_BYTES`) and
nesting depth (`MAX_DEPTH`). Every error names the offending field by its path in the document
(``data.blocks[2].fwd_ms``). Text and files are different calls: `parse_document` takes JSON
text, `read_document` a path to a regular file; nothing guesses which of the two a string is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from remat._files import write_atomic

T = TypeVar("T")

MAX_DOCUMENT_BYTES = 256 * 2**20
"""Largest JSON document read (a profile of a 100-layer model with every op recorded is a few MiB)."""

MAX_INT = 2**63 - 1
"""Largest integer read: sizes and counts go through int64 arrays in the planner."""

MAX_DEPTH = 256
"""Deepest nesting of JSON arrays and objects read (nested recompute segments add two levels each)."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a document kind allows beyond the type hints."""

    signed: frozenset[str] = frozenset()
    """Numeric fields (by name, anywhere in the document) that may be negative."""
    finite: bool = True
    """False: floats may be NaN or +-Infinity (a verification records an infinite difference)."""
    floors: tuple[tuple[str, int], ...] = ()
    """``(field name, least value)`` for numeric fields with a floor other than 0."""
    check: Callable[[Any], None] | None = None
    """Cross-field checks of the whole built document (raise ValueError), beyond each class's own."""


class DocumentError(ValueError):
    """A JSON document that does not follow its schema (a ValueError)."""


def to_dict(obj: Any) -> Any:
    """Plain JSON-able structure of a dataclass (recursively)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


class _Reader:
    """Builds one document's dataclasses from parsed JSON, checking each value against its hint."""

    def __init__(self, kind: str, rules: Rules) -> None:
        self.kind, self.rules = kind, rules
        self.floors = dict(rules.floors)

    def fail(self, path: str, message: str) -> DocumentError:
        return DocumentError(
            f"{self.kind} JSON: {path} {message.rstrip('.')}. The file was edited or damaged: "
            f"regenerate it with `remat {self.kind}`."
        )

    def build(self, tp: Any, value: Any, path: str, name: str) -> Any:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            non_none = [a for a in args if a is not type(None)]
            return self.build(non_none[0], value, path, name)
        if value is None:
            raise self.fail(path, f"is null; expected {_describe(tp)}")
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, value, path)
        if origin is tuple or origin is list:
            if not isinstance(value, list):
                raise self.fail(path, f"is {_json_type(value)}; expected an array")
            if origin is list or (len(args) == 2 and args[1] is Ellipsis):
                built = [self.build(args[0], v, f"{path}[{i}]", name) for i, v in enumerate(value)]
            else:
                if len(value) != len(args):
                    raise self.fail(path, f"has {len(value)} items; expected {len(args)}")
                built = [self.build(a, v, f"{path}[{i}]", name) for i, (a, v) in enumerate(zip(args, value))]
            return built if origin is list else tuple(built)
        if origin in (dict, typing.Dict):
            if not isinstance(value, dict):
                raise self.fail(path, f"is {_json_type(value)}; expected an object")
            return {k: self.build(args[1], v, f"{path}.{k}", name) for k, v in value.items()}
        return self.scalar(tp, value, path, name)

    def scalar(self, tp: Any, value: Any, path: str, name: str) -> Any:
        if tp is bool or tp is str:
            if type(value) is not tp:
                raise self.fail(path, f"is {_json_type(value)} {value!r}; expected {_describe(tp)}")
            return value
        if tp is int:
            if type(value) is not int:
                raise self.fail(path, f"is {_json_type(value)} {value!r}; expected an integer")
            if abs(value) > MAX_INT:
                raise self.fail(path, f"is {value!r}; integers must lie within +-{MAX_INT} (int64)")
        elif tp is float:
            if type(value) not in (int, float):
                raise self.fail(path, f"is {_json_type(value)} {value!r}; expected a number")
            value = float(value)
            if not math.isfinite(value) and self.rules.finite:
                raise self.fail(path, f"is {value!r}; expected a finite number")
        else:
            raise TypeError(f"cannot read type {tp!r} from JSON (field {path})")
        self.check_range(value, path, name)
        return value

    def check_range(self, value: int | float, path: str, name: str) -> None:
        if math.isnan(value):
            return
        floor = self.floors.get(name, None if name in self.rules.signed else 0)
        if floor is not None and value < floor:
            what = "times" if name.endswith("_ms") else "sizes" if name.endswith("_bytes") else "values"
            raise self.fail(path, f"is {value!r}; {what} of {name!r} must be >= {floor}")
        if name.endswith("_fraction") and value > 1:
            raise self.fail(path, f"is {value!r}; a fraction must be in [0, 1]")

    def dataclass(self, cls: type[T], data: Any, path: str) -> T:
        if not isinstance(data, dict):
            raise self.fail(path, f"is {_json_type(data)}; expected an object ({cls.__name__})")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise DocumentError(
                f"{self.kind} JSON: {path} ({cls.__name__}) has unknown field(s) {unknown}; allowed: "
                f"{sorted(fields)}. The file was written by a different remat version: regenerate it."
            )
        missing = sorted(n for n, f in fields.items() if n not in data and _required(f))
        if missing:
            raise self.fail(path, f"({cls.__name__}) lacks the field(s) {missing}")
        kwargs = {k: self.build(hints[k], v, f"{path}.{k}", k) for k, v in data.items()}
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:
            raise self.fail(path, f"({cls.__name__}) is inconsistent: {exc}") from None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _describe(tp: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def from_dict(cls: type[T], data: dict, *, kind: str = "remat", rules: Rules = Rules()) -> T:
    """Rebuild dataclass ``cls`` from :func:`to_dict` output under the strict schema."""
    return _Reader(kind, rules).dataclass(cls, data, "data")


def dump_document(obj: Any, kind: str, version: int) -> str:
    """JSON text of ``obj`` wrapped with its format name and version."""
    return json.dumps({"format": kind, "version": version, "data": to_dict(obj)}, indent=1)


def _depth(value: Any) -> int:
    """Deepest nesting of arrays and objects in ``value`` (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _parse(text: str, kind: str, rules: Rules) -> Any:
    def constant(name: str) -> float:
        if rules.finite:
            raise DocumentError(f"{kind} JSON holds {name}; every number must be finite. The file was "
                                f"edited or damaged: regenerate it with `remat {kind}`.")
        return float(name)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise DocumentError(f"{kind} JSON has the key {key!r} twice in one object; each key may "
                                    f"appear once. Regenerate the file with `remat {kind}`.")
            out[key] = value
        return out

    try:
        doc = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=constant)
    except DocumentError:
        raise
    except RecursionError:
        raise DocumentError(f"{kind} JSON nests deeper than {MAX_DEPTH} levels; not a remat document.") from None
    except (json.JSONDecodeError, ValueError) as exc:  # ValueError: an integer of over 4300 digits
        start = text.lstrip()[:60]
        raise DocumentError(
            f"{kind} JSON text is not valid JSON ({exc}); it starts {start!r}. Pass the text of a "
            f"file written by `remat {kind}`, or read a file with its load(path)."
        ) from None
    depth = _depth(doc)
    if depth > MAX_DEPTH:
        raise DocumentError(f"{kind} JSON nests {depth} levels deep; at most {MAX_DEPTH} allowed.")
    return doc


def parse_document(cls: type[T], text: str, kind: str, version: int, rules: Rules = Rules()) -> T:
    """Inverse of :func:`dump_document` for JSON ``text`` (never a path: see `read_document`)."""
    if not isinstance(text, str):
        raise TypeError(
            f"{cls.__name__}.from_json takes JSON text (str), got {type(text).__name__}; "
            f"to read a file use {cls.__name__}.load(path)."
        )
    if len(text) > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"{kind} JSON text is {len(text)} characters; at most {MAX_DOCUMENT_BYTES} allowed.")
    if not text.strip():
        raise DocumentError(f"{kind} JSON text is empty; pass the text of a file written by `remat {kind}`.")
    doc = _parse(text, kind, rules)
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt != kind:
        raise DocumentError(
            f"expected a remat {kind!r} JSON document, got format={fmt!r}; "
            f"pass a file written by `remat {kind}` / {cls.__name__}.to_json()."
        )
    if type(doc.get("version")) is not int or doc["version"] != version:
        raise DocumentError(
            f"{kind} JSON version {doc.get('version')!r} is not supported (this remat reads "
            f"version {version}); regenerate the file with this remat."
        )
    extra = sorted(set(doc) - {"format", "version", "data"})
    if extra or "data" not in doc:
        raise DocumentError(f"{kind} JSON must hold exactly the keys format, version, data; "
                            f"got {sorted(doc)}. Regenerate the file with `remat {kind}`.")
    reader = _Reader(kind, rules)
    built = reader.dataclass(cls, doc["data"], "data")
    if rules.check is not None:
        try:
            rules.check(built)
        except ValueError as exc:
            raise reader.fail("data", f"is inconsistent: {exc}") from None
    return built


def read_text_file(path: str | os.PathLike, what: str, limit: int | None = None) -> str:
    """The UTF-8 text of the regular file at ``path``, at most ``limit`` bytes (no device, FIFO or
    directory: those are refused before anything is read)."""
    limit = MAX_DOCUMENT_BYTES if limit is None else limit
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: a path must be a str or a pathlib.Path, got {type(path).__name__}.")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise DocumentError(f"{what}: {str(path)!r} is not a regular file ({_file_kind(info.st_mode)}); "
                            "pass the path of a JSON file written by remat.")
    with os.fdopen(fd, "rb") as handle:
        if info.st_size > limit:
            raise DocumentError(f"{what}: {str(path)!r} is {info.st_size} bytes; at most {limit} allowed.")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise DocumentError(f"{what}: {str(path)!r} holds more than {limit} bytes; at most {limit} allowed.")
    if not data.strip():
        raise DocumentError(f"{what}: {str(path)!r} is empty; pass a JSON file written by remat.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"{what}: {str(path)!r} is not UTF-8 text ({exc}); pass a JSON file written by remat.") from None


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_document(cls: type[T], path: str | os.PathLike, kind: str, version: int, rules: Rules = Rules()) -> T:
    """:func:`parse_document` of the file at ``path`` (a regular file; its text is never a path)."""
    return parse_document(cls, read_text_file(path, f"{cls.__name__}.load"), kind, version, rules)


class JsonDocument:
    """``to_json`` / ``from_json`` / ``load`` / ``save`` of a top-level dataclass document: a
    subclass sets ``DOCUMENT = (format, version, rules)``."""

    DOCUMENT: tuple[str, int, Rules]

    def to_json(self) -> str:
        """The document as JSON text (``{"format", "version", "data"}``)."""
        return dump_document(self, *self.DOCUMENT[:2])

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        """The document in JSON ``text`` (as `to_json` writes it), checked against the schema; a
        path is refused: read files with `load`."""
        return parse_document(cls, text, *cls.DOCUMENT)

    @classmethod
    def load(cls: type[T], path: str | os.PathLike) -> T:
        """The document in the JSON file at ``path`` (as `save` writes it), checked like `from_json`."""
        return read_document(cls, path, *cls.DOCUMENT)

    def save(self, path: str | os.PathLike) -> None:
        """Write `to_json` to ``path`` atomically (a temporary file, then a rename)."""
        write_atomic(path, self.to_json())
