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

from remat.models.registry import MODEL_NAMES, BuiltModel, build, model_sizes

SIZE_OPTIONS: dict[str, tuple[str, ...]] = {
    "layers": ("num_layers", "depth", "num_blocks"),
    "d_model": ("d_model", "width", "channels"),
    "heads": ("num_heads",),
    "seq": ("seq_len", "image_size"),
    "batch": ("batch_size",),
    "vocab": ("vocab_size",),
    "dropout": ("dropout",),
    "attention": ("attention",),
}
"""Command-line size options -> the size keyword each built-in model calls them (``--layers``
is ``num_layers`` for gpt, ``depth`` for mlp, ``num_blocks`` for convnet...)."""


def sizes_from_options(name: str, **options: Any) -> dict[str, Any]:
    """Translate command-line size options (`SIZE_OPTIONS` keys; None = not given) for model ``name``."""
    given = {k: v for k, v in options.items() if v is not None}
    if given and is_file_target(name):
        raise ValueError(
            f"size options {sorted(given)} apply to built-in models only, not to {name!r}; "
            "set the sizes inside the build function instead."
        )
    known = model_sizes(name) if given else {}
    sizes = {}
    for option, value in given.items():
        keys = [k for k in SIZE_OPTIONS.get(option, ()) if k in known]
        if not keys:
            usable = sorted(o for o, ks in SIZE_OPTIONS.items() if any(k in known for k in ks))
            raise ValueError(
                f"option --{option.replace('_', '-')} does not apply to model {name!r}; "
                f"its size options: {', '.join('--' + o.replace('_', '-') for o in usable)}."
            )
        sizes[keys[0]] = value
    return sizes


def is_file_target(spec: str) -> bool:
    """True for ``path/to/file.py:function`` (as opposed to a built-in name such as ``hf:gpt2``)."""
    return ":" in spec and not spec.startswith("hf:")


def load_target(spec: str, *, seed: int = 0, **sizes: Any) -> BuiltModel:
    """A built-in model (``"gpt"``, ``"hf:llama"``...) or the result of ``file.py:function()``.

    Sizes whose value is None are ignored, so a CLI can pass every option through; ``seed``
    seeds a built-in model (a build function seeds itself).
    """
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if is_file_target(spec):
        if sizes:
            raise ValueError(
                f"size options {sorted(sizes)} apply to built-in models only, not to {spec!r}; "
                "set the sizes inside the build function instead."
            )
        return load_file_target(spec)
    return build(spec, seed=seed, **sizes)


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
    sys.path.insert(0, str(path.resolve().parent))  # the file may import its neighbours
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.resolve().parent))
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
