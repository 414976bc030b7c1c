"""Build the target of a command: a built-in model name or ``path/to/file.py:function``.

``function()`` returns ``model, batch`` and optionally ``loss_fn`` and ``optimizer``. The
plan, run, demo and estimate commands share this loader with ``remat profile``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from torch import nn

from remat.models.registry import MODEL_NAMES, BuiltModel, build


def load_target(spec: str, **sizes: Any) -> BuiltModel:
    """A built-in model (``"gpt"``, ``"hf:llama"``...) or the result of ``file.py:function()``.

    Sizes whose value is None are ignored, so a CLI can pass every option through.
    """
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if ":" in spec and spec.split(":", 1)[0] not in ("hf",):
        if sizes:
            raise ValueError(
                f"size options {sorted(sizes)} apply to built-in models only, not to {spec!r}; "
                "set the sizes inside the build function instead."
            )
        return load_file_target(spec)
    return build(spec, **sizes)


def load_file_target(spec: str) -> BuiltModel:
    """Import ``path.py`` and call ``function()`` for ``"path.py:function"``."""
    path_text, _, func_name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(
            f"file {path_text!r} in {spec!r} does not exist; pass path/to/file.py:function "
            f"or a built-in model ({', '.join(MODEL_NAMES)})."
        )
    module = _import_file(path)
    func = getattr(module, func_name, None)
    if not callable(func):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{path_text} has no function {func_name!r}; callables found: {', '.join(found) or 'none'}. "
            "Name a function that returns (model, batch[, loss_fn[, optimizer]])."
        )
    return _as_built(func(), spec)


def _import_file(path: Path) -> Any:
    name = f"remat_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def _as_built(result: Any, spec: str) -> BuiltModel:
    if not isinstance(result, (tuple, list)) or not 2 <= len(result) <= 4:
        raise ValueError(
            f"{spec} returned {type(result).__name__}; it must return a tuple "
            "(model, batch[, loss_fn[, optimizer]])."
        )
    model, batch, *rest = result
    if not isinstance(model, nn.Module):
        raise TypeError(f"{spec} returned a {type(model).__name__} as the model; return an nn.Module first.")
    loss_fn = rest[0] if rest else None
    optimizer = rest[1] if len(rest) > 1 else None
    return BuiltModel(model=model, batch=batch, loss_fn=loss_fn, optimizer=optimizer, name=spec)
